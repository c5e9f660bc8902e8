"""A checkpoint folder as the forward reads it: its config, its tensors, the lean forward's
view of its architecture, and the buffers an HF module rebuilds because no file holds them."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from memspec.common.errors import ModelError
from memspec.procs.decoder.forward.lean import Arch, UnsupportedArch


def read_config(model_dir: Path) -> dict:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read {model_dir}/config.json ({exc})",
                         "point the pool at a Hugging Face model folder") from None


def lean_arch(config: dict) -> Arch | None:
    """The lean forward's view of a config, or None when only the HF path can run it."""
    try:
        return Arch.from_config(config)
    except UnsupportedArch:
        return None
    except (KeyError, TypeError, ValueError):
        return None


def load_tensors(model_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, int]]]:
    """All tensors of a (possibly sharded) safetensors checkpoint as stored, on the CPU, and
    the GGUF block type of each one kept in blocks (ggml.py; empty for a plain folder)."""
    from safetensors.torch import load_file

    from memspec.procs.decoder.forward import ggml

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        raise ModelError(f"no safetensors weights in {model_dir}",
                         "save the model with safe_serialization=True")
    out: dict[str, torch.Tensor] = {}
    types: dict[str, tuple[str, int]] = {}
    for f in files:
        try:
            out.update(load_file(f))
        except Exception as exc:  # safetensors raises its own error types on corrupt files
            raise ModelError(f"cannot read {f} ({str(exc)[:120]})",
                             "rebuild or re-copy the weight file") from None
        types.update(ggml.block_types(f))
    return out, types


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint on the CPU, GGUF blocks dequantised to fp32."""
    from memspec.procs.decoder.forward import ggml

    tensors, types = load_tensors(model_dir)
    return ggml.dequantized(tensors, types) if types else tensors


def materialise_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (rotary inv_freq) are not in the file: rebuild their modules."""
    for name, mod in list(model.named_modules()):
        if not any(b.is_meta for b in mod.buffers(recurse=False)):
            continue
        if not hasattr(mod, "inv_freq"):
            raise ModelError(f"module {name} has a buffer the weight file does not hold",
                             "this architecture is not supported as a slot-bound draft")
        cfg = getattr(mod, "config", None) or model.config
        with torch.device(device):  # constructor signatures differ across transformers versions
            fresh = type(mod)(config=cfg)
        model.set_submodule(name, fresh)
