"""Open any local Hugging Face causal-LM directory as target (or as a plainly loaded draft)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from memspec.common.errors import ModelError

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
    _check_dir(path, role)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True, low_cpu_mem_usage=True)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"cannot load {role} model from {path} ({first[:160]})",
                         "check or rebuild its weight files") from None
    return model.to(device).eval()


def load_tokenizer(path: Path):
    _check_dir(path, "target")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load tokenizer from {path} ({str(exc)[:120]})",
                         "the folder needs tokenizer.json / tokenizer_config.json") from None


def eos_token_ids(path: Path, tokenizer=None) -> tuple[int, ...]:
    """EOS ids from generation_config (chat models stop on more than one) and the tokenizer."""
    ids: set[int] = set()
    try:
        gen = GenerationConfig.from_pretrained(path, local_files_only=True)
        eos = gen.eos_token_id
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    except OSError:
        pass
    if not ids:
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        eos = getattr(cfg, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """Chat-formatted when the tokenizer has a template (instruct targets), raw otherwise."""
    if chat and getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return [int(t) for t in out]
    return [int(t) for t in tokenizer(prompt)["input_ids"]]
