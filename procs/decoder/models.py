"""Open any local Hugging Face causal-LM directory as target (or as a plainly loaded draft).

A restarted decoder's requests wait for this, so the common case takes the short way: a
tokenizer whose `tokenizer_config.json` names a generic tokenizers-backed class is built by
that class directly (AutoTokenizer would first import the model's configuration module, a
second on a CPU, to learn what the file already says), and the EOS ids are read from the
JSON files themselves; anything else goes through transformers' Auto classes.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from memspec.common.errors import ModelError, RequestError
from memspec.common.limits import CHAT_ROLES, TOOL_ROLE, LimitError
from memspec.common.messages import ChatTurn
from memspec.common.paths import memspec_home
from memspec.procs.decoder.engine import SpecEngine
from memspec.procs.decoder.forward.checkpoint import lean_arch, load_state_dict, read_config
from memspec.procs.decoder.forward.ggml import is_block_folder
from memspec.procs.decoder.forward.lean import LeanLM
from memspec.procs.decoder.forward.precision import resolve_dtype
from memspec.procs.decoder.forward.quantized import (
    dense_state_dict,
    load_hf_dequantized,
    quant_format,
    quantized_lean,
)
from memspec.procs.decoder.forward.runners import (
    FLOAT_DTYPES,
    LOW_BIT,
    HFRunner,
    Runner,
    accelerate,
    default_act_dtype,
)
from memspec.procs.decoder.tokenizer import GENERIC_TOKENIZERS, serving_tokenizer

SUPPORTED_HINT = "use a local HF causal-LM folder (config.json + safetensors), e.g. Llama or Qwen2"


def _check_dir(path: Path, role: str) -> None:
    if not Path(path).is_dir():
        raise ModelError(f"{role} model folder {path} not found",
                         "run `memspec zoo target`" if role == "target" else SUPPORTED_HINT)
    if not (Path(path) / "config.json").is_file():
        raise ModelError(f"{role} folder {path} has no config.json", SUPPORTED_HINT)


def load_causal_lm(path: Path, role: str = "target", dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> torch.nn.Module:
    """Load weights from disk only (never a hub): ``local_files_only`` guards that."""
    from transformers import AutoModelForCausalLM

    _check_dir(path, role)
    if quant_format(path) is not None or is_block_folder(path):
        # GPTQ / AWQ / GGUF blocks: their exact dequantised weights
        return load_hf_dequantized(path, dtype).to(device).eval()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True, low_cpu_mem_usage=True)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"cannot load {role} model from {path} ({first[:160]})",
                         "check or rebuild its weight files") from None
    return model.to(device).eval()


def _tokenizer_class(path: Path):  # noqa: ANN202
    """The class a generic tokenizer's config names, else None (AutoTokenizer decides)."""
    try:
        name = json.loads((Path(path) / "tokenizer_config.json").read_text()).get(
            "tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    if name not in GENERIC_TOKENIZERS or not (Path(path) / "tokenizer.json").is_file():
        return None
    import transformers

    return getattr(transformers, name, None)


# tokenizers already loaded, by folder: a standby decoder loads the target's ahead of its
# run (standby.py), and the run then takes it from here
_TOKENIZERS: dict[str, object] = {}
_CHAT_WARM: set[str] = set()  # serving tokenizers whose chat template has run once


def load_tokenizer(path: Path):
    key = str(Path(path).resolve())
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = _load_tokenizer(path)
    return _TOKENIZERS[key]


def load_serving_tokenizer(path: Path, chat: bool = False):
    """What the decoder and predictor processes use: tokenizer.py's light tokenizer where
    it gives transformers' ids and text (no transformers import on their start-up), else
    the full one. ``chat`` (the decoder): its chat template is compiled and run once here,
    at start-up, or the first request pays for it (~65 ms on a 2-core Xeon)."""
    key = "serving:" + str(Path(path).resolve())
    if key not in _TOKENIZERS:
        _check_dir(path, "target")
        _TOKENIZERS[key] = serving_tokenizer(path) or load_tokenizer(path)
    tokenizer = _TOKENIZERS[key]
    if chat and key not in _CHAT_WARM:
        _CHAT_WARM.add(key)
        with contextlib.suppress(RequestError):  # a template that rejects the probe: no warm
            encode_prompt(tokenizer, "Hello.")
    return tokenizer


def _load_tokenizer(path: Path):
    _check_dir(path, "target")
    try:
        cls = _tokenizer_class(path)
        if cls is not None:
            return cls.from_pretrained(path, local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load tokenizer from {path} ({str(exc)[:120]})",
                         "the folder needs tokenizer.json / tokenizer_config.json") from None


def _json_eos(file: Path) -> list[int]:
    """`eos_token_id` of a JSON config file ([] when it has none or is missing)."""
    try:
        eos = json.loads(file.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [] if eos is None else [eos])]


def eos_token_ids(path: Path, tokenizer=None) -> tuple[int, ...]:
    """EOS ids from generation_config (chat models stop on more than one), else the model
    config, and the tokenizer's."""
    ids: set[int] = set(_json_eos(Path(path) / "generation_config.json")
                        or _json_eos(Path(path) / "config.json"))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def build_target(model_dir: Path, dtype: str, device: str | torch.device = "cpu",
                 act_dtype: torch.dtype | None = None, fast: bool = True,
                 prepared: Path | None = None) -> Runner:
    """The target in ``dtype`` (already resolved from ``auto``). ``float32`` is the eager HF
    path the engine had before static caches; every other dtype runs the lean forward.
    ``prepared``: a home whose cache of quantised weights a CPU target reads and writes
    (prepared.py; the decoder's, so a restart skips the quantisation)."""
    device = torch.device(device)
    if dtype == "float32":
        return HFRunner(load_causal_lm(model_dir, "target", device=device))
    arch = lean_arch(read_config(model_dir))
    if arch is None:
        if dtype in LOW_BIT:
            raise ModelError(f"dtype {dtype} needs a Llama, Qwen2 or Mistral target",
                             "set dtype = \"bfloat16\" or \"float32\" in the pool")
        model = load_causal_lm(model_dir, "target", dtype=FLOAT_DTYPES[dtype], device=device)
        return HFRunner(model)
    if dtype in LOW_BIT and device.type != "cpu":
        raise ModelError(f"dtype {dtype} has CPU kernels only", "use bfloat16 on this device")
    act = act_dtype or (FLOAT_DTYPES.get(dtype) or default_act_dtype(device))
    qfmt = quant_format(model_dir)
    if qfmt is not None and dtype == "int4":  # GPTQ / AWQ blocks as they are: nothing to cache
        lean = quantized_lean(qfmt, arch, load_state_dict(model_dir), act)
        return accelerate(lean, fast)
    if prepared is not None and device.type == "cpu":
        from memspec.procs.decoder.forward.prepared import lean_target

        return accelerate(lean_target(model_dir, arch, dtype, act,
                                      lambda: cpu_lean(model_dir, arch, dtype, act), prepared),
                          fast)
    if device.type == "cpu":
        return accelerate(cpu_lean(model_dir, arch, dtype, act), fast)
    weights = {k: v.to(device) for k, v in dense_state_dict(model_dir).items()}
    return accelerate(LeanLM.from_weights(arch, weights, dtype, act, fuse=True), fast)


def cpu_lean(model_dir: Path, arch, dtype: str, act: torch.dtype) -> LeanLM:  # noqa: ANN001
    """The fused lean model on the CPU: a GGUF-block folder's blocks as they are where the
    dtype runs them (ggml.py), else the folder's float weights in ``dtype``."""
    from memspec.procs.decoder.forward import ggml
    from memspec.procs.decoder.forward.checkpoint import load_tensors

    if ggml.is_block_folder(model_dir):
        tensors, types = load_tensors(model_dir)
        return ggml.lean_model(arch, tensors, types, dtype, act)
    return LeanLM.from_weights(arch, dense_state_dict(model_dir), dtype, act, fuse=True)


def open_engine(pool, device: str | torch.device = "cpu", dtype: str | None = None,
                fast: bool = True, phases: Callable[[str], None] = lambda phase: None,
                serving: bool = False):
    """The pool's target in its resolved precision, wrapped in an engine; plus the tokenizer
    and the dtype actually used (``auto`` resolved, see precision.py). ``phases(name)`` is
    called as each part is done (the decoder times its start-up: startup.py). ``serving``:
    the decoder process's light tokenizer (load_serving_tokenizer), not the full one."""
    tokenizer = load_serving_tokenizer(pool.target, chat=True) if serving else load_tokenizer(
        pool.target)
    phases("tokenizer")
    chosen = resolve_dtype(dtype or pool.dtype, pool.target, device)
    target = build_target(pool.target, chosen, device, fast=fast, prepared=memspec_home())
    phases("target")
    engine = SpecEngine(target, eos_token_ids(pool.target, tokenizer), gamma=pool.gamma,
                        max_context=pool.max_context, lookup=pool.lookup)
    _keep_head_features(engine, pool)
    phases("engine")
    return engine, tokenizer, chosen


def _keep_head_features(engine: SpecEngine, pool) -> None:
    """A pool with heads: the target keeps their feature rows from the first request on (a
    request that starts before a head lands must still have the rows the head will read)."""
    from memspec.procs.decoder.drafts.head import is_head, read_head_config

    for d in pool.drafts:
        if not is_head(d.path):
            continue
        try:
            engine.use_features(read_head_config(d.path)[0].feature_layers)
            return
        except ModelError:
            continue  # a broken head is quarantined when it loads; the next one decides


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """Chat-formatted when the tokenizer has a template (instruct targets), raw otherwise."""
    if chat and getattr(tokenizer, "chat_template", None):
        return encode_chat(tokenizer, [{"role": "user", "content": prompt}])
    return [int(t) for t in tokenizer(prompt)["input_ids"]]


def check_template_roles(tokenizer, turns: Sequence[ChatTurn]) -> None:
    """A `tool` turn only where the target's chat template renders one (the other roles are
    checked at the front doors, common/limits.py): a template that does not know the role
    would render it as plain text the model was never trained on."""
    if not any(t.role == TOOL_ROLE for t in turns):
        return
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str) or TOOL_ROLE not in template:
        i = next(i for i, t in enumerate(turns) if t.role == TOOL_ROLE)
        raise LimitError(f"messages[{i}].role", f"messages[{i}].role '{TOOL_ROLE}' is not "
                                                "rendered by the target's chat template",
                         f"use {', '.join(CHAT_ROLES)}")


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """A chat rendered by the target's own template, ready for the assistant's reply (with
    `tools`: the template's own rendering of them). A one-user-turn chat gives exactly
    `encode_prompt`'s ids (what `memspec generate` runs)."""
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("the target's tokenizer has no chat template",
                           "send a plain prompt instead of chat messages")
    try:
        extra = {"tools": tools} if tools else {}
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            **extra)
    except Exception as exc:  # a template's own checks (roles, order) raise anything
        first = (str(exc).splitlines() or [""])[0][:200]
        raise RequestError(f"the target's chat template rejects these messages ({first})",
                           "send user/assistant turns as the model expects") from None
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(t) for t in out]
