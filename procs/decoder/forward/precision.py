"""Which precision the target decodes in: ``dtype = "auto"`` resolved per device.

The rule follows `memspec bench engine` on a 2-core AVX-512 CPU (SmolLM2-135M, ms per
target step / 5-token verify as a bare matmul pass): bf16 13.2 / 14.5, int8 5.9 / 9.8,
int4 3.9 / 8.4. A batch-1 step is bound by weight bytes, so on a CPU the smallest format
with a native kernel wins both the step and the verify: int4 (group-32, the layout the
GGUF Q4_1 weights came in), else int8. GPUs decode in bf16 (fp16 where bf16 is missing).
Anything the lean forward does not cover runs the eager HF path in fp32. A target converted
from an F16 / BF16 / F32 GGUF runs in the file's own precision (ggml.float_gguf_dtype), as
llama.cpp runs it; a quantised GGUF's blocks go to their nearest engine formats (ggml.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from memspec.procs.decoder.forward.checkpoint import lean_arch, read_config
from memspec.procs.decoder.forward.ggml import float_gguf_dtype
from memspec.procs.decoder.forward.linear import INT4_GROUP


def resolve_dtype(requested: str, target_dir: Path, device: str | torch.device = "cpu") -> str:
    if requested != "auto":
        return requested
    device = torch.device(device)
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    arch = lean_arch(read_config(target_dir))
    if arch is None:
        return "float32"
    own = float_gguf_dtype(target_dir)
    if own is not None:
        return own
    dims = (arch.hidden, arch.intermediate, arch.heads * arch.head_dim)
    if hasattr(torch, "_weight_int4pack_mm_for_cpu") and all(d % INT4_GROUP == 0 for d in dims):
        return "int4"
    return "int8" if hasattr(torch, "_weight_int8pack_mm") else "float32"
