"""Which code a result was measured on: the git commit and whether the tree was clean.

A figure from a tree with uncommitted changes cannot be reproduced from its commit alone,
so every bench JSON says which it was. Untracked files that git ignores (built models,
caches) do not make a tree dirty; anything `git status --porcelain` lists does.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
GIT_TIMEOUT_S = 30


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                              text=True, timeout=GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def provenance(root: Path = REPO) -> dict[str, Any]:
    """{"commit": full hash or None, "clean": bool or None (None: not a git checkout, or no
    git), "dirty_files": how many paths git lists as changed or untracked}."""
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain") if commit is not None else None
    if commit is None or status is None:
        return {"commit": None, "clean": None, "dirty_files": None,
                "note": "not a git checkout (or git is missing): the code is not identified"}
    changed = [ln for ln in status.splitlines() if ln.strip()]
    return {"commit": commit.strip(), "clean": not changed, "dirty_files": len(changed)}
