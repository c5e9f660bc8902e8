"""What a result was measured on: the code (commit, clean tree), the machine and kernel
path, the tuned knobs and the pool.

A figure from a tree with uncommitted changes cannot be reproduced from its commit alone,
so every bench JSON says which it was. Untracked files that git ignores (built models,
caches) do not make a tree dirty; anything `git status --porcelain` lists does. The same
commit measures differently with another tuned.json (``MEMSPEC_TUNED``), another pool's
drafts or another kernel path (``MEMSPEC_ISA``), so `result_provenance` names those too.
"""

from __future__ import annotations

import hashlib
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


def _sha16(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def shown_path(path: Path) -> str:
    """A path as a result records it: relative to the checkout (never a machine's own
    folders), else the file's name."""
    try:
        return str(Path(path).resolve().relative_to(REPO.resolve()))
    except ValueError:
        return Path(path).name


def tuned_identity() -> dict[str, Any]:
    """The tuned knobs in use (``MEMSPEC_TUNED`` or the committed tuned.json): file, hash."""
    from memspec.common.tuned import tuned_path

    path = tuned_path()
    try:
        return {"file": shown_path(path), "sha256": _sha16(path.read_bytes())}
    except OSError as exc:
        return {"file": shown_path(path), "sha256": None, "error": str(exc)}


def pool_identity(pool: Any = None) -> dict[str, Any]:
    """A pool (a PoolConfig, a pool file, or None: the embedded pool): its file's hash and
    its drafts' (the bytes of every draft's weights, and the lookup setting)."""
    from memspec.common.config import PoolConfig, load_pool
    from memspec.common.draftfiles import fingerprint_digest, pool_fingerprint
    from memspec.common.errors import MemspecError

    try:
        cfg = pool if isinstance(pool, PoolConfig) else load_pool(pool)
        src = Path(cfg.source) if cfg.source else None
        return {"file": shown_path(src) if src else None,
                "sha256": _sha16(src.read_bytes()) if src and src.is_file() else None,
                "drafts_sha256": fingerprint_digest(pool_fingerprint(cfg))}
    except (MemspecError, OSError) as exc:
        return {"file": None if pool is None or isinstance(pool, PoolConfig) else str(pool),
                "sha256": None, "error": str(exc)}


def result_provenance(pool: Any = None, uses_pool: bool = True) -> dict[str, Any]:
    """Everything a bench JSON names about what it measured: the code, the machine and its
    kernel path, the tuned knobs, and (where the bench runs a pool) the pool."""
    from memspec.common import isa
    from memspec.common.machine import cpu_model

    out = provenance()
    out["machine"] = cpu_model()
    out["isa"] = isa.chosen_isa()
    out["isa_native"] = isa.native_isa()
    out["tuned"] = tuned_identity()
    if uses_pool:
        out["pool"] = pool_identity(pool)
    return out


def complete(prov: dict[str, Any] | None, pool: Any = None, uses_pool: bool = True
             ) -> dict[str, Any]:
    """`prov` (a bench's own, taken when it started) with whatever `result_provenance`
    names that it lacks; a bench that took none gets one now."""
    full = result_provenance(pool, uses_pool)
    return {**full, **(prov or {})}
