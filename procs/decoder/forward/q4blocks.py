"""Q4_1 weights stored in the block kernels' own packed layout (as q8blocks.py for Q8_0).

A draft step runs the head's layer (q, k, v, o and the MLP: ~4.1 M weights) once per
proposal; as Q8_0 blocks that is 5.4 MB read per step, as Q4_1 blocks 2.6 MB, through the
kernel the target's own int4 projections use. ``fc`` reads the target's features only in
the teacher pass, and it is the matrix whose rounding costs acceptance most (dev: all Q4_1
1.626 mean accepted tokens, fc kept Q8_0 1.647, all Q8_0 1.649), so head files keep it Q8_0
(head.Q4_MATRICES).

Layout (T = N / 16 tiles, G = K / 32 groups), as qkernels.h packs it: ``nib`` uint8
[T, K/8, 64], byte 4j+i of pair e holding output j's input 8e+i (low nibble) and 8e+4+i
(high nibble); ``d`` and ``m`` fp16 [T, G, 16], w = d * q + m. The quantisation is
Int4Linear's, so the same weights give the same blocks whichever path packed them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from memspec.procs.decoder.forward.linear import GROUP, Int4Linear
from memspec.procs.decoder.forward.q8blocks import (
    TILE,
    PackedBlocks,
    check_parts,
    packable,
    tiled,
    untiled,
)

PARTS = ("q4n", "q4d", "q4m")  # tensor-name suffixes of one packed matrix
DTYPES = {"q4n": torch.uint8, "q4d": torch.float16, "q4m": torch.float16}


def pack(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """One matrix [N, K] as its three packed arrays (keys: PARTS)."""
    n, k = weight.shape
    if not packable((n, k)):
        raise ValueError(f"Q4_1 packing needs N % {TILE} == 0 and K % {GROUP} == 0, "
                         f"got {n}x{k}")
    return pack_blocks(Int4Linear(weight.float(), torch.float32))


def pack_blocks(blocks: Int4Linear) -> dict[str, torch.Tensor]:
    """An Int4Linear's blocks (N % 16 == 0) in the kernels' layout (keys: PARTS)."""
    n, k = blocks.q.shape
    g = k // GROUP
    # q as (tile, output j, pair e, half h, input i): byte (t, e, 4j + i) = lo | hi << 4
    q = blocks.q.view(n // TILE, TILE, k // 8, 2, 4).permute(0, 2, 1, 3, 4)
    nib = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(n // TILE, k // 8, 64)
    return {"q4n": nib.contiguous(), "q4d": tiled(blocks.d.half(), n, g),
            "q4m": tiled(blocks.m.half(), n, g)}


def shape_of(parts: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """(N, K) of a packed matrix."""
    t, e, _ = parts["q4n"].shape
    return t * TILE, e * 8


def codes(parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The 4-bit codes [N, K] (uint8, one a byte) of a packed matrix: `pack_blocks` undone."""
    n, k = shape_of(parts)
    nib = parts["q4n"].view(n // TILE, k // 8, TILE, 4)
    q = torch.stack([nib & 0x0F, nib >> 4], dim=3)  # (t, e, j, h, i)
    return q.permute(0, 2, 1, 3, 4).reshape(n, k)


def unpack(parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The fp32 weights [N, K] a packed matrix stands for (the PyTorch forward's copy)."""
    n, k = shape_of(parts)
    g = k // GROUP
    q = codes(parts).float()
    d, m = untiled(parts["q4d"], n, g), untiled(parts["q4m"], n, g)
    return (q.view(n, g, GROUP) * d[..., None] + m[..., None]).view(n, k)


def check(name: str, parts: Mapping[str, torch.Tensor], shape: tuple[int, int]) -> str | None:
    """What is wrong with a packed matrix that should stand for `shape` (None: nothing)."""
    n, k = shape
    scales = (n // TILE, k // GROUP, TILE)
    return check_parts(name, parts, shape, {"q4n": (n // TILE, k // 8, 64), "q4d": scales,
                                            "q4m": scales}, DTYPES)


class PackedInt4Linear(PackedBlocks, Int4Linear):
    """An Int4Linear held as its packed arrays only (PackedBlocks; half the bytes of q as
    one byte a weight)."""

    UNPACKED = ("q", "d", "m")

    def _unpack(self) -> None:
        n, k = shape_of(self.parts)
        g = k // GROUP
        self.q = codes(self.parts).contiguous()
        self.d = untiled(self.parts["q4d"], n, g)
        self.m = untiled(self.parts["q4m"], n, g)
