"""Weight formats for the lean model's linear layers: dense, int8 and int4, in blocks of 32.

Decoding one token is a pass over every weight, so on a CPU the step time is set by the
bytes of weights read: int8 halves bf16's bytes and int4 quarters them. Both low-bit
formats are the GGUF block formats, quantised per 32 inputs of each output:
- int4 (Q4_1): w = d * q + m with q in [0, 15]; weights that were dequantised from a Q4_1
  file (the demo target) come back to exactly their blocks, so int4 loses nothing there;
- int8 (Q8_0): w = d * q with q in [-127, 127].
The C++ forward (native.py) runs them with its own VNNI kernels; the PyTorch forward here
uses ``_weight_int4pack_mm_for_cpu`` for int4 and a dequantised copy for int8.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

GROUP = 32
INT4_GROUP = GROUP


class Linear:
    """y = x @ W.T (+ b); subclasses hold W in one storage format."""

    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError


PAD_ROWS = 8


def padded(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``f`` over ``x``, calls of fewer than PAD_ROWS rows run as exactly PAD_ROWS rows:
    BLAS and PyTorch's int4 kernel pick their blocking by the row count, and a token's
    logits must not depend on whether it was verified with others or stepped alone."""
    m = x.shape[0]
    if m >= PAD_ROWS:
        return f(x)
    xp = x.new_zeros((PAD_ROWS, x.shape[1]))
    xp[:m] = x
    return f(xp)[:m]


class DenseLinear(Linear):
    """Dense weights (small calls padded: :func:`padded`)."""

    pad_rows = PAD_ROWS

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if w.dtype != x.dtype:  # 16-bit weights beside fp32 rows (ggml.py's wide types)
            w, b = w.to(x.dtype), None if b is None else b.to(x.dtype)
        return padded(lambda v: F.linear(v, w, b), x)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def _groups(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"block formats need in_features divisible by {GROUP}, got {k}")
    return w.float().view(n, k // GROUP, GROUP)


class Int4Linear(Linear):
    """Q4_1 blocks: per (output, 32 inputs) a scale d and a minimum m (fp16, as in GGUF)."""

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype,
                 bias: torch.Tensor | None = None) -> None:
        g = _groups(weight)
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        d = ((hi - lo) / 15.0).half().float()
        m = lo.half().float()
        safe = torch.where(d > 0, d, torch.ones_like(d))
        self.q = torch.round((g - m[..., None]) / safe[..., None]).clamp(0, 15).to(torch.uint8)
        self.q = self.q.view(weight.shape).contiguous()
        self.d, self.m = d, m  # [N, K/32] fp32 holding fp16 values
        self.act_dtype = act_dtype
        self.bias = None if bias is None else bias.to(act_dtype)
        self._packed: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_blocks(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                    act_dtype: torch.dtype, bias: torch.Tensor | None = None) -> Int4Linear:
        """Blocks quantised before (a restarted decoder's cache of them: prepared.py)."""
        self = cls.__new__(cls)
        self.q, self.d, self.m, self.act_dtype = q, d, m, act_dtype
        self.bias = None if bias is None else bias.to(act_dtype)
        self._packed = None
        return self

    def _torch_pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """PyTorch's int4 layout: w = (q - 8) * scale + zero, so zero = m + 8d."""
        if self._packed is None:
            packed = torch._convert_weight_to_int4pack_for_cpu(self.q.to(torch.int32), 1)
            sz = torch.stack([self.d.t(), (self.m + 8.0 * self.d).t()], dim=-1)
            self._packed = (packed, sz.to(self.act_dtype).contiguous())
        return self._packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        packed, sz = self._torch_pack()
        y = padded(lambda v: torch._weight_int4pack_mm_for_cpu(v, packed, GROUP, sz), x)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        g = self.q.view(n, k // GROUP, GROUP).float()
        return (g * self.d[..., None] + self.m[..., None]).view(n, k)

    @property
    def nbytes(self) -> int:
        return self.q.numel() // 2 + 2 * 2 * self.d.numel()


class Int8Linear(Linear):
    """Q8_0 blocks: per (output, 32 inputs) one fp16 scale."""

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype,
                 bias: torch.Tensor | None = None) -> None:
        g = _groups(weight)
        d = (g.abs().amax(dim=2) / 127.0).half().float()
        safe = torch.where(d > 0, d, torch.ones_like(d))
        self.q = torch.round(g / safe[..., None]).clamp(-127, 127).to(torch.int8)
        self.q = self.q.view(weight.shape).contiguous()
        self.d = d
        self.act_dtype = act_dtype
        self.bias = None if bias is None else bias.to(act_dtype)
        self._dense: torch.Tensor | None = None

    @classmethod
    def from_blocks(cls, q: torch.Tensor, d: torch.Tensor, act_dtype: torch.dtype,
                    bias: torch.Tensor | None = None) -> Int8Linear:
        """Blocks quantised before (a restarted decoder's cache of them: prepared.py)."""
        self = cls.__new__(cls)
        self.q, self.d, self.act_dtype = q, d, act_dtype
        self.bias = None if bias is None else bias.to(act_dtype)
        self._dense = None
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._dense is None:  # the PyTorch path has no kernel for Q8_0 blocks
            self._dense = self.dequantize().to(self.act_dtype)
        return padded(lambda v: F.linear(v, self._dense, self.bias), x)

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        return (self.q.view(n, k // GROUP, GROUP).float() * self.d[..., None]).view(n, k)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantised rows (an embedding lookup from the tied LM head)."""
        q = self.q[ids].float()
        return (q.view(len(ids), -1, GROUP) * self.d[ids][..., None]).view(len(ids), -1)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 2 * self.d.numel()


def make_linear(weight: torch.Tensor, fmt: str, act_dtype: torch.dtype,
                bias: torch.Tensor | None = None) -> Linear:
    """``fmt``: a float dtype name (weights cast to the activation dtype) or int8 / int4."""
    if fmt == "int8":
        return Int8Linear(weight, act_dtype, bias)
    if fmt == "int4":
        return Int4Linear(weight, act_dtype, bias)
    dt = act_dtype
    return DenseLinear(weight.to(dt).contiguous(), None if bias is None else bias.to(dt))


class PermutedLinear(Linear):
    """A layer whose input columns were reordered so that act-order groups are contiguous:
    y = inner(x[:, perm]) (the gather GPTQ's own act-order kernels do too)."""

    def __init__(self, inner: Linear, perm: torch.Tensor) -> None:
        self.inner, self.perm = inner, perm
        self.bias = inner.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.index_select(-1, self.perm))

    def dequantize(self) -> torch.Tensor:
        w = dense_of(self.inner)
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes + self.perm.numel() * 4  # int32 would do


def dense_of(lin: Linear) -> torch.Tensor:
    return lin.weight.float() if isinstance(lin, DenseLinear) else lin.dequantize()


def fuse_prebuilt(parts: list[Linear]) -> list[Linear]:
    """Projections of one input as one layer where their formats allow it: int4 blocks
    (with the same input gather, if any) concatenate by output; others stay apart."""
    if len(parts) == 1:
        return parts
    gathers = [p for p in parts if isinstance(p, PermutedLinear)]
    if len(gathers) == len(parts):
        perm = gathers[0].perm
        if all(torch.equal(perm, p.perm) for p in gathers[1:]):
            inner = fuse_prebuilt([p.inner for p in gathers])
            if len(inner) == 1:
                return [PermutedLinear(inner[0], perm)]
        return parts
    blocks = [p for p in parts if type(p) is Int4Linear]
    if len(blocks) != len(parts):
        return parts
    act = blocks[0].act_dtype
    bias = None
    if any(p.bias is not None for p in blocks):
        bias = torch.cat([p.bias if p.bias is not None else
                          torch.zeros(p.q.shape[0], dtype=act) for p in blocks])
    return [Int4Linear.from_blocks(torch.cat([p.q for p in blocks]),
                                   torch.cat([p.d for p in blocks]),
                                   torch.cat([p.m for p in blocks]), act, bias)]
