"""The target's weight block, faulted in on another core while the decoder starts.

The native model copies the target's packed weights into one 2 MB-aligned block of huge
pages (csrc/lean_cpu.cpp `to_huge_pages`). A fresh start pays the kernel for every page of
it, and on a VM that hands free memory back to its host that was 0.04-0.3 s of the 94 MB
target's build, on the path to the first answer. The supervisor passes the size the last
decoder of this pool needed (``ARENA_ENV``); the decoder maps that much at the top of its
start-up and zeroes it in a thread (one C call that lets go of the GIL) while it reads its
config and tokenizer (~0.1 s); the native model takes the block when the size still fits,
and the size it needed is written down for the next start. Started before the imports
instead, the faults slowed `import torch` by ~0.07 s (eight fresh runs each, alternating,
first text: 1.27 s from here, 1.41 s from the first import, 1.47 s without a block).
Torch-free until the block is taken.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import threading
from pathlib import Path
from typing import Any

from memspec.common.files import atomic_write_text
from memspec.common.paths import memspec_home

ARENA_ENV = "MEMSPEC_ARENA"  # "<pool id>:<bytes>", set by the supervisor for the decoder
HUGE = 2 << 20  # the block's alignment: a huge page
RECORD = "calib/arena.json"  # under the memspec home: {pool id: bytes}


class Prefault:
    """A mapping of `nbytes` (a multiple of HUGE) at a HUGE-aligned address, zeroed in a
    thread; `block()` waits for it."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        # private: a shared anonymous mapping is shmem, which takes no huge pages where
        # shmem_enabled is "never" (the default), whatever madvise says
        self.map = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE)  # (room to align)
        self._view = ctypes.c_char.from_buffer(self.map)
        base = ctypes.addressof(self._view)
        self.offset = -base % HUGE
        self._thread = threading.Thread(target=self._fault, args=(base + self.offset,),
                                        name="memspec-arena", daemon=True)
        self._thread.start()

    def _fault(self, addr: int) -> None:
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self.map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass  # advice refused: 4 KiB pages, faulted in all the same
        ctypes.memset(addr, 0, self.nbytes)  # (ctypes calls release the GIL)

    def block(self) -> Any:
        """The aligned block as a uint8 tensor over the mapping (it keeps the mapping)."""
        import torch

        self._thread.join()
        whole = torch.frombuffer(self.map, dtype=torch.uint8)
        return whole[self.offset:self.offset + self.nbytes]


_state: dict[str, Any] = {"key": "", "pending": None}


def start_from_env() -> None:
    """Begin faulting the block the supervisor sized (a no-op without ``ARENA_ENV``, and in
    every process but the decoder it was set for: the variable is taken out)."""
    raw = os.environ.pop(ARENA_ENV, "")
    key, _, size = raw.rpartition(":")
    if not key:
        return
    _state["key"] = key
    try:
        nbytes = int(size)
    except ValueError:
        return
    if nbytes > 0 and nbytes % HUGE == 0:
        try:
            _state["pending"] = Prefault(nbytes)
        except (OSError, ValueError):  # no memory to map now: the model allocates its own
            _state["pending"] = None


def take() -> Any:
    """The faulted block (once), or None where none was started."""
    pending, _state["pending"] = _state["pending"], None
    return pending.block() if pending is not None else None


def remember(needed: int) -> None:
    """The size this pool's target needed, for the supervisor's next start of it (the
    first native model a decoder builds is its target; later ones are not recorded)."""
    key, _state["key"] = _state["key"], ""
    sizes = _sizes()
    if not key or needed <= 0 or sizes.get(key) == needed:
        return
    sizes[key] = needed
    try:
        _record_path().parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(_record_path(), json.dumps(sizes))
    except OSError:
        pass  # a read-only home: every start allocates as before


def env_for(pool_id: str) -> dict[str, str]:
    """The decoder's ``ARENA_ENV`` for this pool: its key always (so the decoder records
    its size), the size where one was recorded."""
    size = _sizes().get(pool_id, 0)
    return {ARENA_ENV: f"{pool_id}:{size if isinstance(size, int) else 0}"}


def _sizes() -> dict[str, Any]:
    """The recorded sizes, {pool id: bytes} ({} where none were or the file is unreadable)."""
    try:
        sizes = json.loads(_record_path().read_text())
    except (OSError, ValueError):
        return {}
    return sizes if isinstance(sizes, dict) else {}


def _record_path() -> Path:
    return memspec_home() / RECORD
