"""GGUF's quantised blocks kept as they are on disk, read as floats or as the engine's blocks.

Why: a GGUF's weights are already the blocks the engine runs (Q4_1 and Q4_0 are the int4
path's blocks, Q8_0 the int8 path's), so a converted target holds them unchanged instead of
their fp32 expansion (the demo target: 98 MB, not 538 MB), and the low-bit paths take them
without requantising (bit-identical to llama.cpp's weights). Every other consumer (the fp32
reference, training, the float dtypes) reads floats dequantised here on load.

On disk (a target folder's ``model.safetensors``): each quantised tensor is a uint8 array
[rows, row bytes] under its Hugging Face name, rows in HF order; the file's metadata key
``memspec.ggml`` maps those names to ``[type name, columns]``. Float tensors (F32, F16,
BF16) are stored as themselves and have no entry.

Per type (engine_linear): Q4_0, Q4_1, Q5_0 and Q8_0 are decoded here (torch) and map
exactly onto the engine's int4 / int8 blocks, Q4_K onto int4 blocks with fp16-rounded
sub-block scales; Q6_K is requantised to int8 and Q5_1 / Q5_K held in fp16.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from memspec.common.errors import ModelError
from memspec.procs.decoder.forward.lean import Arch, LeanLM
from memspec.procs.decoder.forward.linear import (
    GROUP,
    DenseLinear,
    Int4Linear,
    Int8Linear,
    Linear,
    make_linear,
)

META_KEY = "memspec.ggml"
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34}  # per 32 weights
FP16_TYPES = ("Q5_1", "Q5_K")  # held in fp16 under int4 (engine_linear says why)
Q4K_BYTES, QK_K = 144, 256  # a Q4_K super-block: 256 weights in 8 sub-blocks of 32


def _halves(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of each block [rows, blocks, bytes], as fp32 [rows, blocks]."""
    return b[..., at:at + 2].contiguous().view(torch.float16)[..., 0].float()


def _blocks(raw: torch.Tensor, kind: str, cols: int) -> torch.Tensor:
    if cols % GROUP:
        raise ModelError(f"a {kind} tensor of {cols} columns is not whole 32-weight blocks",
                         "rebuild the weight file from its GGUF")
    rows = raw.shape[0]
    want = cols // GROUP * _BLOCK_BYTES[kind]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != want:
        raise ModelError(f"a {kind} tensor of {cols} columns should be uint8 [{rows}, {want}], "
                         f"is {raw.dtype} {list(raw.shape)}", "rebuild the weight file")
    return raw.view(rows, cols // GROUP, _BLOCK_BYTES[kind])


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """ggml's 4-bit order: byte j holds weight j (low nibble) and j + 16 (high)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def int4_parts(raw: torch.Tensor, kind: str, cols: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K], d, m fp32 [N, K/32]) with w = d * q + m: Q4_1 as it is; Q4_0's
    w = d * (q - 8) has m = -8 d, exact in fp16 (a power-of-two multiple)."""
    b = _blocks(raw, kind, cols)
    rows = raw.shape[0]
    d = _halves(b, 0)
    if kind == "Q4_1":
        m, qs = _halves(b, 2), b[..., 4:]
    elif kind == "Q4_0":
        m, qs = -8.0 * d, b[..., 2:]
    else:
        raise ValueError(kind)
    return _nibbles(qs).reshape(rows, cols).contiguous(), d, m


def q4k_parts(raw: torch.Tensor, cols: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K as int4 blocks. A super-block holds fp16 d and dmin and per sub-block 6-bit sc
    and mn, w = (d sc) q - (dmin mn): affine per 32 weights, as the engine's blocks are. Only
    the products d sc and dmin mn are rounded, to the kernels' fp16 (a relative 2^-11 of a
    scale: the error `memspec bench gguf` measures beside llama.cpp's own)."""
    rows = raw.shape[0]
    if cols % QK_K or raw.dtype != torch.uint8 or raw.shape[1] != cols // QK_K * Q4K_BYTES:
        raise ModelError(f"a Q4_K tensor of {cols} columns should be uint8 [{rows}, "
                         f"{cols // QK_K * Q4K_BYTES}], is {raw.dtype} {list(raw.shape)}",
                         "rebuild the weight file from its GGUF")
    b = raw.view(rows, cols // QK_K, Q4K_BYTES)
    d, dmin = _halves(b, 0), _halves(b, 2)
    s = b[..., 4:16].reshape(rows, -1, 3, 4)
    lo, hi, mix = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat([lo & 63, (mix & 15) | ((lo >> 2) & 48)], dim=-1).float()
    mn = torch.cat([hi & 63, (mix >> 4) | ((hi >> 2) & 48)], dim=-1).float()
    qs = b[..., 16:].reshape(rows, -1, 4, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(rows, cols)
    scale = (d[..., None] * sc).reshape(rows, -1).half().float()
    low = (-(dmin[..., None] * mn)).reshape(rows, -1).half().float()
    return q.contiguous(), scale, low


def int8_parts(raw: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], d fp32 [N, K/32]) of Q8_0 blocks, w = d * q."""
    b = _blocks(raw, "Q8_0", cols)
    q = b[..., 2:].contiguous().view(torch.int8).reshape(raw.shape[0], cols)
    return q, _halves(b, 0)


def q5_0_parts(raw: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_0 as int8 blocks, exactly: w = d (q - 16) with q in [0, 31] is the Q8_0 block of
    scale d and values q - 16 (a requantisation to Q8_0's own scale would round them)."""
    b = _blocks(raw, "Q5_0", cols)
    rows = raw.shape[0]
    high = b[..., 2:6].contiguous().view(torch.int32)  # bit j: weight j's fifth bit
    bits = (high >> torch.arange(32, dtype=torch.int32)) & 1  # [rows, blocks, 32]
    q = _nibbles(b[..., 6:]).to(torch.int32) | (bits << 4)
    return (q - 16).to(torch.int8).reshape(rows, cols), _halves(b, 0)


def dequantize(raw: torch.Tensor, kind: str, cols: int) -> torch.Tensor:
    """One tensor as fp32 [rows, cols]."""
    rows = raw.shape[0]
    if kind in ("Q4_0", "Q4_1"):
        return Int4Linear.from_blocks(*int4_parts(raw, kind, cols), torch.float32).dequantize()
    if kind == "Q8_0":
        return Int8Linear.from_blocks(*int8_parts(raw, cols), torch.float32).dequantize()
    import gguf
    import numpy as np

    qtype = getattr(gguf.GGMLQuantizationType, kind, None)
    if qtype is None:
        raise ModelError(f"unknown GGUF block type {kind}", "rebuild the weight file")
    out = gguf.quants.dequantize(np.ascontiguousarray(raw.numpy()), qtype)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).view(rows, cols)


def block_types(path: Path) -> dict[str, tuple[str, int]]:
    """``{name: (type, columns)}`` of a weight file's GGUF blocks ({} for a plain file)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception:  # noqa: BLE001 - the caller's own load reports a damaged file
        return {}
    if META_KEY not in meta:
        return {}
    try:
        return {k: (str(v[0]), int(v[1])) for k, v in json.loads(meta[META_KEY]).items()}
    except (ValueError, TypeError, IndexError, AttributeError):
        raise ModelError(f"{path}: its {META_KEY} metadata does not parse",
                         "rebuild the weight file from its GGUF") from None


def float_gguf_dtype(model_dir: Path) -> str | None:
    """The float dtype of a folder converted from an F16 / BF16 / F32 GGUF (no tensor in
    blocks), None for any other folder: such a file runs in its own precision, as
    llama.cpp runs it, not quantised by ``auto``."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("model*.safetensors"))
    try:
        with safe_open(str(files[0]), framework="pt") as f:
            meta = f.metadata() or {}
            if META_KEY not in meta or json.loads(meta[META_KEY]):
                return None
            name = next(k for k in f.keys() if k.endswith("mlp.up_proj.weight"))  # noqa: SIM118
            dtype = f.get_slice(name).get_dtype()
    except Exception:  # noqa: BLE001 - not a converted GGUF: the usual rule decides
        return None
    return {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}.get(dtype)


def is_block_folder(model_dir: Path) -> bool:
    return any(block_types(f) for f in sorted(Path(model_dir).glob("model*.safetensors")))


def dequantized(tensors: Mapping[str, torch.Tensor], types: Mapping[str, tuple[str, int]]
                ) -> dict[str, torch.Tensor]:
    """``tensors`` with every block tensor as fp32."""
    return {k: dequantize(v, *types[k]) if k in types else v for k, v in tensors.items()}


def engine_linear(raw: torch.Tensor, kind: str, cols: int, fmt: str, act_dtype: torch.dtype,
                  bias: torch.Tensor | None) -> Linear:
    """One block tensor in the engine format nearest the file's, so the model keeps the
    file's own error and adds little. Under ``int4``: the 4-bit types as int4 blocks
    (Q4_0 / Q4_1 exactly, Q4_K to fp16 scales), Q8_0 and Q5_0 as int8 blocks exactly
    (Q5_0's d (q - 16) is an int8 block of scale d), Q6_K requantised to int8 blocks, and
    Q5_1 / Q5_K as fp16 values. Measured on SmolLM2-135M (`memspec bench gguf`, KL
    divergence from the file's own fp32 forward, against llama.cpp's on the file): Q5_1
    requantised to int8 was 1.45x llama.cpp's (int8 blocks have no offset, so its grid is
    rounded again), in fp16 0.22x; Q6_K in int8 0.71x and 1.3x llama.cpp's speed, in fp16
    0.54x and 1.2x. Under ``int8`` all are int8 blocks."""
    if fmt == "int4" and kind in ("Q4_0", "Q4_1"):
        return Int4Linear.from_blocks(*int4_parts(raw, kind, cols), act_dtype, bias)
    if fmt == "int4" and kind == "Q4_K":
        return Int4Linear.from_blocks(*q4k_parts(raw, cols), act_dtype, bias)
    if kind == "Q8_0":
        return Int8Linear.from_blocks(*int8_parts(raw, cols), act_dtype, bias)
    if kind == "Q5_0":
        return Int8Linear.from_blocks(*q5_0_parts(raw, cols), act_dtype, bias)
    if fmt == "int4" and kind in FP16_TYPES:  # their values, through the 16-bit kernel
        return DenseLinear(dequantize(raw, kind, cols).half().contiguous(), bias)
    return Int8Linear(dequantize(raw, kind, cols), act_dtype, bias)


def lean_model(arch: Arch, tensors: Mapping[str, torch.Tensor],
               types: Mapping[str, tuple[str, int]], fmt: str, act_dtype: torch.dtype,
               fuse: bool = True) -> LeanLM:
    """The lean model of a block folder's tensors: under a low-bit ``fmt`` each block
    projection in its nearest engine format (engine_linear), the rest (float tensors, the
    embedding and LM head) as ``fmt`` makes them from floats."""
    linears: dict[str, Linear] = {}
    if fmt in ("int4", "int8"):
        for i in range(arch.layers):
            p = f"model.layers.{i}"
            for name in (f"{p}.self_attn.q_proj", f"{p}.self_attn.k_proj",
                         f"{p}.self_attn.v_proj", f"{p}.self_attn.o_proj",
                         f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj", f"{p}.mlp.down_proj"):
                key, bias = f"{name}.weight", tensors.get(f"{name}.bias")
                bias = None if bias is None else bias.float()
                if key in types:
                    linears[name] = engine_linear(tensors[key], *types[key], fmt, act_dtype,
                                                  bias)
                elif key in tensors:  # a float projection: quantised as ``fmt`` says
                    linears[name] = make_linear(tensors[key].float(), fmt, act_dtype, bias)
    taken = {f"{n}.{part}" for n in linears for part in ("weight", "bias")}
    dense = dequantized({k: v for k, v in tensors.items() if k not in taken}, types)
    return LeanLM.from_weights(arch, dense, fmt, act_dtype, fuse=fuse, linears=linears)
