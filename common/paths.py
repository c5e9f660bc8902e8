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


# ---- GGUF targets: a file's stat -> the folder `memspec zoo target --gguf` made of it ------
GGUF_INDEX = "targets/index.json"


def gguf_stat_key(gguf: Path) -> str:
    """A GGUF as the index knows it: a file changed in place gets a new key (and is hashed
    and converted again), an unchanged one is found without reading its gigabytes."""
    st = gguf.stat()
    return f"{gguf}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def _gguf_index() -> dict:
    import json

    try:
        index = json.loads((memspec_home() / GGUF_INDEX).read_text())
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def converted_gguf_folder(gguf: Path) -> Path | None:
    """The converted folder of a GGUF (resolved path), or None where it has none yet."""
    folder = _gguf_index().get(gguf_stat_key(gguf))
    if isinstance(folder, str) and (Path(folder) / "memspec_convert.json").is_file():
        return Path(folder)
    return None


def record_gguf_folder(gguf: Path, folder: Path) -> None:
    """Remember a conversion (atomically; a read-only home only forgets it)."""
    import json

    index = _gguf_index()
    index[gguf_stat_key(gguf)] = str(folder)
    path = memspec_home() / GGUF_INDEX
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(index, indent=1))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
