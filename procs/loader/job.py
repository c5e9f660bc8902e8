"""One load: validate a ``Load`` request, then stream the file's data section into the slot.

Everything that can go wrong becomes a :class:`LoadError` whose text is the one-line
``LoadFailed.reason``. The caller supplies ``between``, run after every chunk and while a
paced load waits: it keeps heartbeats flowing and raises :class:`Cancelled` when a
matching ``Cancel`` arrives, so a load never blocks the process's control plane.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from memspec.common.errors import MemspecError
from memspec.common.manifest import RangeVerifier
from memspec.common.messages import Load
from memspec.common.safetensors_layout import Layout, read_layout
from memspec.common.slotmem import TRANSPORTS, SlotWriter
from memspec.procs.loader.pacing import TokenBucket
from memspec.procs.loader.reader import RING, ColdReader, read_ahead

STORAGE_PROFILES = ("native", "edge-emulated")
WAIT_SLICE_S = 0.02  # how often a paced wait looks at the socket


class LoadError(Exception):
    """The load cannot complete; ``str(exc)`` is the LoadFailed reason."""


class Cancelled(LoadError):
    def __init__(self, reason: str = "cancelled") -> None:
        super().__init__(reason)


@dataclass
class Result:
    nbytes: int
    seconds: float
    checksum: str
    io_mode: str


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def validate(load: Load) -> Layout:
    """Check the request and the file's header before any byte of the slot is touched."""
    if load.slot < 0 or load.generation < 0:
        raise LoadError(f"bad slot {load.slot} / generation {load.generation}")
    if load.transport not in TRANSPORTS:
        raise LoadError(f"unknown transport {load.transport!r}")
    if load.storage not in STORAGE_PROFILES:
        raise LoadError(f"unknown storage profile {load.storage!r}")
    if not load.bandwidth_bytes_s >= 0:  # also rejects NaN
        raise LoadError(f"bad bandwidth {load.bandwidth_bytes_s}")
    if load.capacity <= 0:
        raise LoadError(f"bad slot capacity {load.capacity}")
    if load.expected_sha256 and len(load.expected_sha256) != 64:
        raise LoadError("expected_sha256 is not a sha256 hex digest")
    if load.header_sha256 and len(load.header_sha256) != 64:
        raise LoadError("header_sha256 is not a sha256 hex digest")
    try:
        layout = read_layout(Path(load.path))
        size = os.stat(load.path).st_size
    except MemspecError as exc:
        raise LoadError(exc.problem) from None
    except OSError as exc:
        raise LoadError(f"cannot read {load.path}: {exc.strerror}") from None
    if size != layout.file_size:
        raise LoadError(f"{load.path} has {size - layout.file_size} bytes after its data section")
    if layout.data_size > load.capacity:
        raise LoadError(f"draft '{load.draft}' needs {layout.data_size} bytes but the slot "
                        f"holds {load.capacity}")
    _check_manifest(load, layout)
    return layout


def _check_manifest(load: Load, layout: Layout) -> None:
    """The header is the one the manifest was made of and its ranges tile this data section;
    the bytes themselves are checked range by range while they are copied (`stream`)."""
    if load.header_sha256:
        try:
            with open(load.path, "rb") as f:
                header = f.read(layout.data_offset)
        except OSError as exc:
            raise LoadError(f"cannot read {load.path}: {exc.strerror}") from None
        if hashlib.sha256(header).hexdigest() != load.header_sha256.lower():
            raise LoadError(f"draft '{load.draft}': the header of {load.path} differs from "
                            "its manifest")
    pos = 0
    for r in load.ranges:
        if r.start != pos or r.end <= r.start:
            raise LoadError(f"draft '{load.draft}': manifest ranges do not tile the data "
                            f"section at byte {pos}")
        pos = r.end
    if load.ranges and pos != layout.data_size:
        raise LoadError(f"draft '{load.draft}': manifest covers {pos} bytes, the data section "
                        f"has {layout.data_size}")


def open_slot(load: Load) -> SlotWriter:
    try:
        return SlotWriter.open(load.transport, load.handle, load.capacity)
    except MemspecError as exc:
        raise LoadError(f"bad slot handle: {exc.problem}") from None
    except Exception as exc:  # CUDA/driver errors have many types
        raise LoadError(f"cannot open slot memory: {_one_line(exc)}") from None


def stream(load: Load, layout: Layout, writer: SlotWriter, between: Callable[[], None],
           chunk: int, io_mode: str, buffer: mmap.mmap | None = None) -> Result:
    """Copy the data section to slot offset 0, hashing what was written: each manifest
    range is checked as soon as its last byte is in the slot."""
    t0 = time.perf_counter()
    bucket = (TokenBucket(load.bandwidth_bytes_s, burst=chunk)
              if load.bandwidth_bytes_s > 0 else None)
    # the manifest's ranges cover the section (checked above), so hashing it whole as
    # well would hash every byte twice on the decoder's cores: only when a whole-file
    # digest is asked for, or there are no ranges
    digest = hashlib.sha256() if load.expected_sha256 or not load.ranges else None
    ranges = RangeVerifier(load.ranges, f"draft '{load.draft}'")
    done = 0
    reader = ColdReader(layout.path, layout.data_offset, layout.data_size, chunk, io_mode,
                        ring=RING, buffer=buffer)
    # a paced load sleeps between chunks anyway, so reading ahead in a thread only adds
    # the thread's CPU (~2 ms a 7 MB head, beside the decoder's prefill)
    chunks = read_ahead(reader) if bucket is None else iter(reader)
    try:
        for part in chunks:
            writer.write(done, part)
            if digest is not None:
                digest.update(part)
            ranges.update(done, part)
            done += part.nbytes
            between()
            if bucket is not None:
                _wait(bucket.reserve(part.nbytes), between)
    except LoadError:
        raise
    except MemspecError as exc:
        raise LoadError(exc.problem) from None
    except EOFError as exc:
        raise LoadError(f"{load.path} is truncated: {exc}") from None
    except OSError as exc:
        raise LoadError(f"read error on {load.path}: {exc.strerror or exc}") from None
    finally:
        chunks.close()  # closes the file now, also when cancelled mid-way
        reader.close()
        writer.flush()  # no copy may still be in flight once we reply
    if done != layout.data_size:
        raise LoadError(f"{load.path} is truncated ({done} of {layout.data_size} data bytes)")
    checksum = digest.hexdigest() if digest is not None else ""
    if load.expected_sha256 and checksum != load.expected_sha256.lower():
        raise LoadError(f"checksum mismatch for '{load.draft}': expected "
                        f"{load.expected_sha256[:12]}…, got {checksum[:12]}…")
    return Result(done, time.perf_counter() - t0, checksum, reader.mode)


def _wait(seconds: float, between: Callable[[], None]) -> None:
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(left, WAIT_SLICE_S))
        between()
