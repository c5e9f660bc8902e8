"""Where built artefacts live (the converted target, the native build, traces, caches).

``$MEMSPEC_HOME`` when set; else, in a checkout (the repository itself, editable installs
included), its git-ignored ``./models``; else, for an installed package, the user's cache
(``$XDG_CACHE_HOME/memspec``, default ``~/.cache/memspec``): site-packages may be read-only
or shared, and two environments then share one conversion. Nothing is written under the
installed package.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_POOL = PACKAGE_ROOT / "pool.toml"
TARGET_DIRNAME = "smollm2-135m-instruct"
HOME_ENV = "MEMSPEC_HOME"


def is_checkout(root: Path = PACKAGE_ROOT) -> bool:
    """The package runs from its repository (pyproject.toml beside it), not from an
    installed copy (a wheel carries no pyproject.toml inside the package)."""
    return (root / "pyproject.toml").is_file()


def user_cache_dir() -> Path:
    """The XDG cache directory for memspec (an unset or relative XDG_CACHE_HOME is ignored,
    as the spec says)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "memspec"


def memspec_home() -> Path:
    """Artefact root; an env var so CI, Jetsons and tests can point it elsewhere."""
    env = os.environ.get(HOME_ENV)
    if env:
        return Path(env).expanduser().resolve()
    return PACKAGE_ROOT / "models" if is_checkout() else user_cache_dir()


def default_target_dir() -> Path:
    return memspec_home() / TARGET_DIRNAME


def expand_path(raw: str, base: Path) -> Path:
    """Expand ``$MEMSPEC_HOME``/``~`` and resolve relative paths against the pool file's folder."""
    env = dict(os.environ)
    env.setdefault(HOME_ENV, str(memspec_home()))
    text = raw
    for key in (HOME_ENV,):
        text = text.replace("${" + key + "}", env[key]).replace("$" + key, env[key])
    p = Path(os.path.expanduser(os.path.expandvars(text)))
    return p if p.is_absolute() else (base / p).resolve()


def pool_identity(pool: str | Path | None) -> str:
    """Which pool a server runs, comparable across processes without loading it: the pool
    file's resolved path and bytes (sha256, 16 hex digits; its relative paths resolve from
    its folder, so the path is part of it). `memspec generate` reuses a `memspec up` only
    when this matches."""
    path = Path(pool).expanduser() if pool else DEFAULT_POOL
    h = hashlib.sha256(str(path.resolve()).encode() + b"\0")
    try:
        h.update(path.read_bytes())
    except OSError:
        pass
    return h.hexdigest()[:16]
