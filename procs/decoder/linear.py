"""Weight formats for the lean model's linear layers: dense, int8 and int4 weight-only.

Decoding one token is a pass over every weight, so on a CPU the step time is set by the
bytes of weights read: int8 halves bf16's bytes and int4 quarters them. Both low-bit
formats use PyTorch's own CPU kernels (``_weight_int8pack_mm``,
``_weight_int4pack_mm_for_cpu``) and quantise per output channel (int8) or per group of
32 inputs with a scale and an offset (int4, the layout of a GGUF Q4_1 block).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT4_GROUP = 32


class Linear:
    """y = x @ W.T (+ b); subclasses hold W in one storage format."""

    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError


class DenseLinear(Linear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class Int8Linear(Linear):
    """Symmetric per-output-channel int8 weights; activations stay in their float dtype."""

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype,
                 bias: torch.Tensor | None = None) -> None:
        w = weight.float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        self.q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.to(act_dtype)
        self.bias = None if bias is None else bias.to(act_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x, self.q, self.scale)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.float()[:, None]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()


class Int4Linear(Linear):
    """Asymmetric int4 in groups of 32 inputs: w = (q - 8) * scale + zero.

    With min/max per group this is exactly how a GGUF Q4_1 block stores w = d * q + m
    (scale = d, zero = m + 8d), so weights dequantised from Q4_1 round-trip to their blocks.
    """

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype,
                 bias: torch.Tensor | None = None) -> None:
        w = weight.float()
        n, k = w.shape
        if k % INT4_GROUP:
            raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP}, got {k}")
        g = w.view(n, k // INT4_GROUP, INT4_GROUP)
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        scale = ((hi - lo) / 15.0).clamp(min=1e-12)
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q.view(n, k).contiguous(), 1)
        zero = lo + 8.0 * scale  # (q - 8) * scale + zero == q * scale + lo
        self.scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(act_dtype).contiguous()
        self.bias = None if bias is None else bias.to(act_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_zeros)
        return y if self.bias is None else y + self.bias

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * self.scales_zeros.element_size()


def make_linear(weight: torch.Tensor, fmt: str, act_dtype: torch.dtype,
                bias: torch.Tensor | None = None) -> Linear:
    """``fmt``: a float dtype name (weights cast to it) or ``int8`` / ``int4``."""
    if fmt == "int8":
        return Int8Linear(weight, act_dtype, bias)
    if fmt == "int4":
        return Int4Linear(weight, act_dtype, bias)
    dt = act_dtype
    return DenseLinear(weight.to(dt).contiguous(), None if bias is None else bias.to(dt))
