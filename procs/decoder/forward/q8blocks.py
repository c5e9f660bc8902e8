"""Q8_0 weights stored in the block kernels' own packed layout, so a slot holds what runs.

A draft head's eight matrices are most of what a draft step reads. In bf16 a CPU without
bf16 dot products widens every weight to fp32 (AVX2 Zen 3, 2 cores: a head step 0.37 ms,
7% of a target step); as Q8_0 blocks it reads half the bytes through the integer kernels
the target's LM rows already use (0.22 ms). Packing at bind time would cost ~20 ms per load
and a decoder-side copy outside the slot budget, so the head file holds the packed arrays
themselves (``pack``) and binding points the kernels at the slot's bytes.

Layout (T = N / 16 output tiles, G = K / 32 groups, C = K / 4), as qkernels.h packs it:
``w`` int8 [T, C, 64] (16 outputs x 4 inputs per 64 bytes), ``d`` fp16 [T, G, 16] the
scales, ``c`` fp32 [T, G, 16] = (d * sum(q)) * 128 and ``s`` int32 [T, G, 16] = 128 *
sum(q), the offset terms of the unsigned-times-signed dot product. The quantisation is
Int8Linear's (d = fp16(max|w| / 127), q = round(w / d)), so the same weights give the same
blocks whichever path packed them. Pure PyTorch: the loader and the trainer need no build.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from memspec.procs.decoder.forward.linear import GROUP, Int8Linear

TILE = 16  # outputs per tile (qkernels.h QTILE)
PARTS = ("q8w", "q8d", "q8c", "q8s")  # tensor-name suffixes of one packed matrix
DTYPES = {"q8w": torch.int8, "q8d": torch.float16, "q8c": torch.float32, "q8s": torch.int32}


def packable(shape: tuple[int, ...]) -> bool:
    """The block kernels tile N by 16 and K by 32; other shapes stay 16-bit."""
    return len(shape) == 2 and shape[0] % TILE == 0 and shape[1] % GROUP == 0


def tiled(x: torch.Tensor, n: int, g: int) -> torch.Tensor:
    """[N, G] -> [T, G, 16]: each tile's 16 outputs side by side per group."""
    return x.reshape(n // TILE, TILE, g).permute(0, 2, 1).contiguous()


def untiled(x: torch.Tensor, n: int, g: int) -> torch.Tensor:
    """[T, G, 16] -> [N, G] as fp32: `tiled` undone."""
    return x.float().view(n // TILE, g, TILE).permute(0, 2, 1).reshape(n, g)


def pack(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """One matrix [N, K] as its four packed arrays (keys: PARTS)."""
    n, k = weight.shape
    if not packable((n, k)):
        raise ValueError(f"Q8_0 packing needs N % {TILE} == 0 and K % {GROUP} == 0, "
                         f"got {n}x{k}")
    return pack_blocks(Int8Linear(weight, torch.float32))


def pack_blocks(blocks: Int8Linear) -> dict[str, torch.Tensor]:
    """An Int8Linear's blocks (N % 16 == 0) in the kernels' layout (keys: PARTS)."""
    n, k = blocks.q.shape
    q, d, g = blocks.q, blocks.d, k // GROUP  # d: fp32 holding fp16 values
    sums = q.view(n, g, GROUP).sum(-1, dtype=torch.int32)
    c = (d * sums.float()) * 128.0
    w = q.view(n // TILE, TILE, k // 4, 4).permute(0, 2, 1, 3).reshape(n // TILE, k // 4, 64)
    return {"q8w": w.contiguous(), "q8d": tiled(d.half(), n, g), "q8c": tiled(c, n, g),
            "q8s": tiled(sums * 128, n, g)}


def shape_of(parts: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """(N, K) of a packed matrix."""
    t, c, _ = parts["q8w"].shape
    return t * TILE, c * 4


def codes(parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The int8 codes [N, K] of a packed matrix: `pack_blocks` undone."""
    n, k = shape_of(parts)
    return parts["q8w"].view(n // TILE, k // 4, TILE, 4).permute(0, 2, 1, 3).reshape(n, k)


def rows(parts: Mapping[str, torch.Tensor], ids: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``ids`` of a packed matrix as int8 codes [n, K] and fp32 scales [n, K/32]:
    what ``codes`` and ``untiled`` give for them, without unpacking the others."""
    n, k = shape_of(parts)
    t, j = ids // TILE, ids % TILE
    q = parts["q8w"].view(n // TILE, k // 4, TILE, 4)[t, :, j, :].reshape(len(ids), k)
    return q.contiguous(), parts["q8d"][t, :, j].float().contiguous()


def unpack(parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The fp32 weights [N, K] a packed matrix stands for (the PyTorch forward's copy)."""
    n, k = shape_of(parts)
    g = k // GROUP
    q = codes(parts).float()
    d = untiled(parts["q8d"], n, g)
    return (q.view(n, g, GROUP) * d[..., None]).view(n, k)


def check(name: str, parts: Mapping[str, torch.Tensor], shape: tuple[int, int]) -> str | None:
    """What is wrong with a packed matrix that should stand for `shape` (None: nothing)."""
    n, k = shape
    want = {"q8w": (n // TILE, k // 4, 64), **{p: (n // TILE, k // GROUP, TILE)
                                              for p in PARTS[1:]}}
    return check_parts(name, parts, shape, want, DTYPES)


def check_parts(name: str, parts: Mapping[str, torch.Tensor], shape: tuple[int, int],
                want: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, torch.dtype]
                ) -> str | None:
    """The first array of a packed matrix that is missing or not ``want``'s shape and
    ``dtypes``' dtype, as one line (None: all are)."""
    missing = [p for p in want if p not in parts]
    if missing:
        return f"{name}.{missing[0]} is missing"
    for p, shp in want.items():
        t = parts[p]
        if t.dtype != dtypes[p] or tuple(t.shape) != shp:
            return (f"{name}.{p} is {t.dtype} {tuple(t.shape)}, a {shape[0]}x{shape[1]} "
                    f"matrix needs {dtypes[p]} {shp}")
    return None


class PackedBlocks:
    """A block-format Linear held as its packed arrays only (a prepared target:
    prepared.py): the C++ forward points its kernels at them (native.linear_spec), and the
    fields the Linear's PyTorch forward reads (``UNPACKED``) are made by ``_unpack`` only
    if that forward asks for them. Mixed in before Int8Linear / Int4Linear."""

    UNPACKED: tuple[str, ...] = ()

    def __init__(self, parts: Mapping[str, torch.Tensor], act_dtype: torch.dtype,
                 bias: torch.Tensor | None = None) -> None:
        self.parts = dict(parts)
        self.act_dtype = act_dtype
        self.bias = None if bias is None else bias.to(act_dtype)
        self._packed = self._dense = None  # the block Linears' PyTorch-path caches

    def _unpack(self) -> None:
        raise NotImplementedError

    def __getattr__(self, name: str):
        if name in type(self).UNPACKED:  # made once, when first used
            self._unpack()
            return getattr(self, name)
        raise AttributeError(name)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())


class PackedInt8Linear(PackedBlocks, Int8Linear):
    """An Int8Linear held as its packed arrays only (PackedBlocks)."""

    UNPACKED = ("q", "d")

    def _unpack(self) -> None:
        n, k = shape_of(self.parts)
        self.q = codes(self.parts).contiguous()
        self.d = untiled(self.parts["q8d"], n, k // GROUP)

