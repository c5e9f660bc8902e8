"""Slot memory shared between the decoder (owner) and the loader (writer).

The decoder allocates each slot once and hands the loader a *handle*; the loader writes a
draft's bytes straight into that memory, so weights never travel over a socket. Two
transports:

``shm``
    A POSIX shared-memory file ``/dev/shm/memspec-<run-token>-slot<i>`` (created with
    ``O_CREAT|O_EXCL``, mode 0600), mapped by both sides. We do not use
    ``multiprocessing.shared_memory``: its resource tracker unlinks segments when an
    *opener* exits (Python 3.11), which would delete a live slot when the loader restarts.
    Used on CPU and on Jetson/Tegra, where CUDA IPC is unsupported (pytorch#60401).
``cuda-ipc``
    A device tensor owned by the decoder, exported with ``_share_cuda_()`` (what
    ``torch.multiprocessing`` does) and serialised as JSON with base64 bytes — never pickle.
    The loader reopens it with ``UntypedStorage._new_shared_cuda`` and fills it from pinned
    staging buffers.

Handles are untrusted input on the loader side: shm names must carry the ``memspec-``
prefix and no path separator, so a malformed ``Load`` cannot open arbitrary files.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import mmap
import os
import re
import secrets
import stat
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from memspec.common.shmclean import (  # noqa: F401 - re-exported
    PREFIX,
    SHM_DIR,
    SlotMemoryError,
    cleanup_shm,
)

if TYPE_CHECKING:  # imported where a tensor is made: the loader streams bytes without it
    import torch

SHM = "shm"
CUDA_IPC = "cuda-ipc"
TRANSPORTS = (SHM, CUDA_IPC)
ENV_TRANSPORT = "MEMSPEC_SLOT_TRANSPORT"
TEGRA_RELEASE = Path("/etc/nv_tegra_release")
STAGING_BYTES = 4 << 20  # per pinned staging buffer (cuda-ipc); two alternate
_SHM_NAME = re.compile(r"memspec-[A-Za-z0-9_.-]{1,200}")
_IPC_FIELDS = ("device", "handle", "size", "offset", "ref_handle", "ref_offset",
               "event_handle", "event_sync")


def new_run_token() -> str:
    """A short random token that makes this run's shm names unique."""
    return secrets.token_hex(4)


def shm_name(run_token: str, slot: int) -> str:
    return f"{PREFIX}{run_token}-slot{slot}"


def shm_path(name: str) -> Path:
    """The /dev/shm path of a validated segment name; anything else is a SlotMemoryError."""
    if not isinstance(name, str) or not _SHM_NAME.fullmatch(name) or name in (".", ".."):
        raise SlotMemoryError(f"bad shm handle {name!r}",
                              f"names must match {_SHM_NAME.pattern} (no path separators)")
    return SHM_DIR / name


def choose_transport(device: str | torch.device = "cpu") -> str:
    """``cuda-ipc`` on a discrete CUDA GPU, ``shm`` on CPU and on Tegra; env var overrides."""
    import torch

    forced = os.environ.get(ENV_TRANSPORT, "").strip()
    if forced:
        if forced not in TRANSPORTS:
            raise SlotMemoryError(f"{ENV_TRANSPORT}={forced!r} is not a slot transport",
                                  f"use one of {', '.join(TRANSPORTS)}")
        return forced
    dev = torch.device(device)
    if dev.type != "cuda":
        return SHM
    if TEGRA_RELEASE.exists():
        return SHM
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if getattr(torch.cuda.get_device_properties(index), "is_integrated", False):
        return SHM
    return CUDA_IPC


def shm_identity(name: str) -> tuple[int, int] | None:
    """(device, inode) of a segment, None when it is gone: a segment recreated under the
    same name (a restarted decoder) is a different file."""
    try:
        st = os.stat(shm_path(name), follow_symlinks=False)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _map_shm(name: str, capacity: int, create: bool,
             identity: list[tuple[int, int]] | None = None) -> mmap.mmap:
    path = shm_path(name)
    if capacity <= 0:
        raise SlotMemoryError(f"slot capacity must be positive, got {capacity}")
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    if create:
        flags |= os.O_CREAT | os.O_EXCL
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise SlotMemoryError(f"shm segment {name} already exists",
                              "another run uses this token; call cleanup_shm") from None
    except OSError as exc:
        raise SlotMemoryError(f"cannot open shm segment {name}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if identity is not None:
            identity.append((st.st_dev, st.st_ino))
        if not stat.S_ISREG(st.st_mode):
            raise SlotMemoryError(f"shm handle {name} is not a regular file")
        if create:
            try:  # reserve tmpfs pages now: a full /dev/shm is an error here, not a SIGBUS later
                os.posix_fallocate(fd, 0, capacity)
            except OSError as exc:
                os.unlink(path)
                raise SlotMemoryError(f"cannot reserve {capacity} bytes in {SHM_DIR}: "
                                      f"{exc.strerror}", "free /dev/shm or lower K") from None
        elif st.st_size < capacity:
            raise SlotMemoryError(f"shm segment {name} holds {st.st_size} bytes, "
                                  f"the load claims {capacity}")
        return mmap.mmap(fd, capacity)
    finally:
        os.close(fd)


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode("ascii")


def _unb64(value: object, field: str) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise SlotMemoryError(f"cuda-ipc handle field {field} must be base64 text")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise SlotMemoryError(f"cuda-ipc handle field {field} is not base64") from None


def export_cuda_handle(tensor: torch.Tensor) -> str:
    """JSON text of ``_share_cuda_()`` for the tensor's storage (the tensor must start it)."""
    if tensor.device.type != "cuda" or tensor.storage_offset() != 0:
        raise SlotMemoryError("cuda-ipc slots must be whole CUDA tensors")
    (device, handle, size, offset, ref_handle, ref_offset, event_handle,
     event_sync) = tensor.untyped_storage()._share_cuda_()
    return json.dumps({
        "device": int(device), "handle": _b64(handle), "size": int(size),
        "offset": int(offset), "ref_handle": _b64(ref_handle), "ref_offset": int(ref_offset),
        "event_handle": _b64(event_handle), "event_sync": bool(event_sync)})


def parse_cuda_handle(text: str) -> tuple:
    """Validate a serialised handle into ``_new_shared_cuda``'s positional arguments."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        raise SlotMemoryError("cuda-ipc handle is not JSON") from None
    if not isinstance(obj, dict) or set(obj) != set(_IPC_FIELDS):
        raise SlotMemoryError(f"cuda-ipc handle must have exactly the fields {_IPC_FIELDS}")
    for key in ("device", "size", "offset", "ref_offset"):
        if type(obj[key]) is not int or obj[key] < 0:
            raise SlotMemoryError(f"cuda-ipc handle field {key} must be a non-negative int")
    if type(obj["event_sync"]) is not bool:
        raise SlotMemoryError("cuda-ipc handle field event_sync must be a bool")
    handle = _unb64(obj["handle"], "handle")
    ref_handle = _unb64(obj["ref_handle"], "ref_handle")
    if not handle or not ref_handle or obj["size"] == 0:
        raise SlotMemoryError("cuda-ipc handle has no memory handle (empty storage)")
    return (obj["device"], handle, obj["size"], obj["offset"], ref_handle, obj["ref_offset"],
            _unb64(obj["event_handle"], "event_handle"), obj["event_sync"])


class SlotMemory:
    """Decoder side: one slot's memory, allocated once; ``tensor`` is flat uint8."""

    def __init__(self, name: str, transport: str, tensor: torch.Tensor, handle: str,
                 path: Path | None = None, registered: bool = False) -> None:
        self.name = name
        self.transport = transport
        self.tensor: torch.Tensor | None = tensor
        self.handle = handle
        self.capacity = tensor.numel()
        self.path = path
        self._registered = registered

    @classmethod
    def create(cls, name: str, capacity: int, transport: str,
               device: str | torch.device = "cpu") -> SlotMemory:
        """Allocate a slot. ``name`` is the shm segment name (see :func:`shm_name`)."""
        import torch

        if transport == SHM:
            mm = _map_shm(name, capacity, create=True)
            tensor = torch.frombuffer(mm, dtype=torch.uint8)  # keeps ``mm`` alive
            registered = torch.device(device).type == "cuda" and _host_register(tensor)
            return cls(name, SHM, tensor, name, shm_path(name), registered)
        if transport == CUDA_IPC:
            dev = torch.device(device)
            if dev.type != "cuda":
                raise SlotMemoryError(f"cuda-ipc slots need a CUDA device, got {dev}")
            tensor = torch.empty(capacity, dtype=torch.uint8, device=dev)
            return cls(name, CUDA_IPC, tensor, export_cuda_handle(tensor))
        raise SlotMemoryError(f"unknown slot transport {transport!r}",
                              f"use one of {', '.join(TRANSPORTS)}")

    def close(self) -> None:
        """Drop our reference; an shm mapping is unmapped once no tensor view remains."""
        import torch

        if self.tensor is not None and self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._registered = False
        self.tensor = None

    def unlink(self) -> None:
        """Remove the shm name (memory lives on until every mapping is gone)."""
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> SlotMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self.unlink()


def _host_register(tensor: torch.Tensor) -> bool:
    """Tegra: page-lock the shared pages so the GPU reads them without staging copies."""
    import torch

    try:
        err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
    except Exception as exc:  # no CUDA runtime: the slot still works as plain host memory
        logging.getLogger(__name__).warning(f"cudaHostRegister unavailable ({exc}); "
                                            "using pageable memory")
        return False
    return int(err) == 0


class SlotWriter:
    """Loader side: write access to a slot the decoder owns."""

    capacity: int

    @staticmethod
    def open(transport: str, handle: str, capacity: int) -> SlotWriter:
        if transport == SHM:
            return ShmWriter(handle, capacity)
        if transport == CUDA_IPC:
            return CudaIpcWriter(handle, capacity)
        raise SlotMemoryError(f"unknown slot transport {transport!r}")

    def _check(self, offset: int, n: int) -> None:
        if offset < 0 or offset + n > self.capacity:
            raise SlotMemoryError(f"write [{offset}, {offset + n}) outside slot of "
                                  f"{self.capacity} bytes")

    def write(self, offset: int, data: bytes | memoryview) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Block until every write is visible to the decoder."""

    def view(self) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> SlotWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShmWriter(SlotWriter):
    def __init__(self, name: str, capacity: int) -> None:
        ident: list[tuple[int, int]] = []
        self._mm: mmap.mmap | None = _map_shm(name, capacity, create=False, identity=ident)
        self.name, self.capacity, self.identity = name, capacity, ident[0]

    def current(self, name: str, capacity: int) -> bool:
        """Still the segment a load names: a kept writer is reused only then (mapping a
        segment anew costs a page fault per 4 KiB written, ~3 ms for a 7 MB draft)."""
        return self._mm is not None and (name, capacity) == (self.name, self.capacity) \
            and shm_identity(name) == self.identity

    def write(self, offset: int, data: bytes | memoryview) -> None:
        n = len(data) if isinstance(data, bytes) else data.nbytes
        self._check(offset, n)
        self._mm[offset:offset + n] = data

    def view(self) -> torch.Tensor:
        import torch

        return torch.frombuffer(self._mm, dtype=torch.uint8)

    def close(self) -> None:
        self._mm = None  # unmapped once views are gone (frombuffer keeps it alive)


class CudaIpcWriter(SlotWriter):
    """Opens the decoder's device storage; copies via two alternating pinned buffers."""

    def __init__(self, handle: str, capacity: int) -> None:
        import torch

        args = parse_cuda_handle(handle)
        if capacity > args[2]:
            raise SlotMemoryError(f"cuda-ipc storage holds {args[2]} bytes, "
                                  f"the load claims {capacity}")
        if not torch.cuda.is_available():
            raise SlotMemoryError("cuda-ipc handle received but this loader has no CUDA")
        torch.cuda._lazy_init()
        dev = torch.device("cuda", args[0])
        self._dev: torch.Tensor | None = None
        storage = torch.UntypedStorage._new_shared_cuda(*args)  # waits on the owner's event
        self._dev = torch.empty(0, dtype=torch.uint8, device=dev).set_(
            storage, 0, (args[2],), (1,))
        self.capacity = capacity
        self._stream = torch.cuda.Stream(device=dev)
        self._stream.wait_stream(torch.cuda.current_stream(dev))  # ...on the current stream
        self._staging = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
                         for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)]
        self._used = [False, False]
        self._turn = 0

    def write(self, offset: int, data: bytes | memoryview) -> None:
        import torch

        src = np.frombuffer(data, dtype=np.uint8)
        self._check(offset, src.size)
        done = 0
        while done < src.size:
            n = min(STAGING_BYTES, src.size - done)
            i = self._turn
            if self._used[i]:
                self._events[i].synchronize()  # its previous copy must finish before reuse
            self._staging[i][:n].numpy()[:] = src[done:done + n]
            with torch.cuda.stream(self._stream):
                dst = self._dev[offset + done:offset + done + n]
                dst.copy_(self._staging[i][:n], non_blocking=True)
                self._events[i].record(self._stream)
            self._used[i] = True
            self._turn = 1 - i
            done += n

    def flush(self) -> None:
        self._stream.synchronize()

    def view(self) -> torch.Tensor:
        return self._dev[:self.capacity]

    def close(self) -> None:
        if self._dev is not None:
            self.flush()
        self._dev = None  # releases the IPC mapping and its ref counter
        self._staging = []
