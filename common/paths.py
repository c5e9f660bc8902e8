"""Where built artefacts live: ``$MEMSPEC_HOME`` (default ``<repo>/models``, git-ignored)."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_POOL = PACKAGE_ROOT / "pool.toml"
TARGET_DIRNAME = "smollm2-135m-instruct"


def memspec_home() -> Path:
    """Artefact root; an env var so CI, Jetsons and tests can point it elsewhere."""
    env = os.environ.get("MEMSPEC_HOME")
    return Path(env).expanduser().resolve() if env else PACKAGE_ROOT / "models"


def default_target_dir() -> Path:
    return memspec_home() / TARGET_DIRNAME


def expand_path(raw: str, base: Path) -> Path:
    """Expand ``$MEMSPEC_HOME``/``~`` and resolve relative paths against the pool file's folder."""
    env = dict(os.environ)
    env.setdefault("MEMSPEC_HOME", str(memspec_home()))
    text = raw
    for key in ("MEMSPEC_HOME",):
        text = text.replace("${" + key + "}", env[key]).replace("$" + key, env[key])
    p = Path(os.path.expanduser(os.path.expandvars(text)))
    return p if p.is_absolute() else (base / p).resolve()
