"""Byte layout of a safetensors file, so its data section can be copied verbatim into a slot.

Shared by the loader (which streams the bytes) and the decoder (which binds views to them).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from memspec.common.errors import ModelError

if TYPE_CHECKING:
    import torch

# safetensors dtype name -> (torch dtype name, bytes per element); torch is imported only
# where a tensor is made, so the loader, which streams bytes, starts without it
DTYPES: dict[str, tuple[str, int]] = {
    "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "F64": ("float64", 8), "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2),
    "I8": ("int8", 1), "U8": ("uint8", 1), "BOOL": ("bool", 1),
}
MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    name: str
    code: str  # the safetensors dtype name (a DTYPES key)
    shape: tuple[int, ...]
    start: int  # offset inside the data section
    end: int

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, DTYPES[self.code][0])


@dataclass(frozen=True)
class Layout:
    path: Path
    data_offset: int  # 8 + header length: where tensor bytes start in the file
    data_size: int
    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, str]

    @property
    def file_size(self) -> int:
        return self.data_offset + self.data_size


def read_layout(path: Path) -> Layout:
    """Parse and sanity-check the header; a corrupt or truncated file is a ModelError."""
    path = Path(path)
    fix = "rebuild or re-copy the weight file"
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ModelError(f"{path} is truncated (no safetensors header)", fix)
            (n,) = struct.unpack("<Q", head)
            if n <= 0 or n > MAX_HEADER or 8 + n > size:
                raise ModelError(f"{path} has a corrupt safetensors header", fix)
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise ModelError(f"weight file {path} not found", fix) from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelError(f"{path} has a corrupt safetensors header", fix) from None
    metadata = header.pop("__metadata__", None) or {}
    entries = []
    data_size = 0
    for name, info in header.items():
        try:
            code = str(info["dtype"])
            itemsize = DTYPES[code][1]
            shape = tuple(int(s) for s in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ModelError(f"{path}: tensor '{name}' has a malformed entry", fix) from None
        numel = 1
        for s in shape:
            numel *= s
        if end - start != numel * itemsize or start < 0:
            raise ModelError(f"{path}: tensor '{name}' size does not match its shape", fix)
        if start % itemsize:
            raise ModelError(f"{path}: tensor '{name}' is misaligned", "re-save with safetensors")
        entries.append(TensorEntry(name, code, shape, start, end))
        data_size = max(data_size, end)
    if 8 + n + data_size > size:
        raise ModelError(f"{path} is truncated ({size} of {8 + n + data_size} bytes)", fix)
    entries.sort(key=lambda e: e.start)
    return Layout(path, 8 + n, data_size, tuple(entries), dict(metadata))


def views_into(buffer: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """Typed tensor views over a flat uint8 buffer that holds the layout's data section."""
    import torch

    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise TypeError("slot buffer must be a flat uint8 tensor")
    if buffer.numel() < layout.data_size:
        raise ModelError(f"{layout.path.name} needs {layout.data_size} bytes, slot holds "
                         f"{buffer.numel()}", "raise the slot capacity")
    return {e.name: buffer[e.start:e.end].view(e.dtype).view(e.shape) for e in layout.tensors}
