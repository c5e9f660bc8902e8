"""The loader process: serves ``Load`` / ``Cancel`` from the decoder, one load at a time.

``python -m memspec.procs.loader.main --endpoint E --control C`` binds a ROUTER at ``E``
(the decoder connects a DEALER; only ``Load`` and ``Cancel`` are accepted there) and
connects a PUSH to the supervisor's control PULL at ``C``: ``Ready`` once, then
``Heartbeat`` every 0.5 s, also in the middle of a long load. Loads are served FIFO;
between chunks the socket is polled without blocking, so a ``Cancel`` aborts the in-flight
load or drops a queued one. The loader holds no authoritative state (the decoder owns the
slots), so it can be killed and restarted at any time; SIGTERM stops it. Bad input is
answered with ``Error``/``LoadFailed`` and never ends the process.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from collections import deque

import zmq

from memspec.common import child, sockets
from memspec.common.messages import (
    LOADER_REQUESTS,
    Cancel,
    Error,
    Heartbeat,
    Load,
    Loaded,
    LoaderInfo,
    LoadFailed,
    Message,
    ProtocolError,
    Ready,
    type_name,
)
from memspec.common.procexit import fast_exit
from memspec.common.slotmem import CUDA_IPC, SHM, TRANSPORTS, ShmWriter, SlotWriter
from memspec.procs.loader.job import Cancelled, LoadError, open_slot, stream, validate
from memspec.procs.loader.reader import IO_MODES, RING, ring_buffer

PROC = "loader"
HEARTBEAT_S = 0.5
CHUNK = 1 << 20


LOG = logging.getLogger(f"memspec.{PROC}")  # not __name__: run as __main__
log = LOG.info


class LoaderProcess:
    def __init__(self, endpoint: str, control: str, chunk: int = CHUNK,
                 io_mode: str = "auto") -> None:
        self.chunk = chunk
        self.io_mode = io_mode
        self.ctx = zmq.Context()
        self.router = sockets.configure(self.ctx.socket(zmq.ROUTER))
        self.router.bind(endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self.router, zmq.POLLIN)
        self._wake = child.SignalWake()  # a SIGTERM ends a wait at once
        self._poller.register(self._wake.fd, zmq.POLLIN)
        self.control = sockets.configure(self.ctx.socket(zmq.PUSH))
        self.control.setsockopt(zmq.SNDHWM, 64)
        self.control.connect(control)
        self.queue: deque[tuple[bytes, Load]] = deque()
        self.writers: dict[int, tuple[str, int, SlotWriter]] = {}  # slot -> its open writer
        self.buffer = ring_buffer(chunk, RING)  # every load reads through it (reader.py)
        self.current: tuple[bytes, Load] | None = None
        self.stopping = False
        self.loads = 0
        self.failures = 0
        self.rejected = sockets.RejectLog(LOG.warning)
        self.failed = sockets.RejectLog(LOG.warning, what="failed load")  # hostile Loads fail fast
        self._next_beat = 0.0

    # --- control plane -------------------------------------------------------------------
    def _push(self, msg: Message) -> None:
        try:  # a missing supervisor must never stall the loader
            sockets.send(self.control, msg)
        except zmq.Again:
            pass

    def _reply(self, ident: bytes, msg: Message) -> None:
        try:
            sockets.send(self.router, msg, ident=ident)
        except zmq.ZMQError as exc:
            LOG.warning(f"reply {type_name(msg)} dropped: {exc}")

    def _beat(self) -> None:
        now = time.monotonic()
        if now >= self._next_beat:
            state = f"loading {self.current[1].draft}" if self.current else "idle"
            self._push(Heartbeat(proc=PROC, pid=os.getpid(), state=state))
            self._next_beat = now + HEARTBEAT_S

    def _readable(self, timeout_ms: int) -> bool:
        """Whether a request waits, within ``timeout_ms``; a signal ends the wait at once."""
        events = dict(self._poller.poll(timeout_ms))
        if self._wake.fd in events:
            self._wake.drain()
        return self.router in events

    def _receive(self, timeout_ms: int) -> None:
        """Handle every message that arrives within ``timeout_ms`` (0: only what is queued)."""
        while not self.stopping and self._readable(timeout_ms):
            timeout_ms = 0
            try:
                ident, msg = sockets.recv(self.router, LOADER_REQUESTS, router=True,
                                          flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:  # a frame list without an identity cannot be answered
                LOG.warning("dropped a message without a routing identity")
                continue
            self._handle(ident, msg)

    def _handle(self, ident: bytes, msg: Load | Cancel | ProtocolError) -> None:
        if isinstance(msg, ProtocolError):
            self.rejected(str(msg))
            self._reply(ident, Error(req_id="", message=f"malformed message: {msg}"))
        elif isinstance(msg, Load):
            self.queue.append((ident, msg))
        else:
            self._cancel(ident, msg)

    def _cancel(self, ident: bytes, msg: Cancel) -> None:
        if self.current and _matches(self.current[1], msg):
            raise Cancelled()
        for item in list(self.queue):
            if _matches(item[1], msg):
                self.queue.remove(item)
                self._fail(item, "cancelled")

    def _between_chunks(self) -> None:
        self._beat()
        self._receive(0)
        if self.stopping:
            raise Cancelled("loader shutting down")

    # --- loads ---------------------------------------------------------------------------
    def _fail(self, item: tuple[bytes, Load], reason: str) -> None:
        ident, load = item
        self.failures += 1
        self.failed(f"'{load.draft}' into slot {load.slot} (gen {load.generation}): {reason}")
        self._reply(ident, LoadFailed(slot=load.slot, generation=load.generation,
                                      draft=load.draft, reason=reason))

    def _serve(self, item: tuple[bytes, Load]) -> None:
        ident, load = item
        self.current = item
        try:
            layout = validate(load)
            writer = self._writer(load)
            res = stream(load, layout, writer, self._between_chunks, self.chunk,
                         self.io_mode, self.buffer)
        except LoadError as exc:
            self._fail(item, str(exc))
            return
        except Exception as exc:  # a bug or driver error must not end the process
            self._fail(item, f"internal error: {type(exc).__name__}: {exc}")
            return
        finally:
            self.current = None
        self.loads += 1
        mbps = res.nbytes / max(res.seconds, 1e-9) / 1e6
        log(f"loaded '{load.draft}' into slot {load.slot} (gen {load.generation}): "
            f"{res.nbytes} B in {res.seconds:.3f} s ({mbps:.0f} MB/s, {res.io_mode}, "
            f"{load.storage})")
        self._reply(ident, Loaded(slot=load.slot, generation=load.generation,
                                  draft=load.draft, nbytes=res.nbytes, seconds=res.seconds,
                                  checksum=res.checksum))

    def _writer(self, load: Load) -> SlotWriter:
        """Kept open per slot. shm: a fresh mapping per load would fault in every page it
        writes (more CPU than the read), so the mapping is reused while the segment under
        the load's name is the same file (a restarted decoder recreates it under the same
        name). cuda-ipc: each exported handle is opened (and its ref counter released) once.
        A new handle for a slot replaces the old writer, which bounds the mappings of a dead
        decoder's memory to one per slot."""
        cached = self.writers.get(load.slot)
        if cached is not None:
            handle, capacity, writer = cached
            if isinstance(writer, ShmWriter):
                if load.transport == SHM and writer.current(load.handle, load.capacity):
                    return writer
            elif (load.transport, load.handle, load.capacity) == (CUDA_IPC, handle, capacity):
                return writer
            del self.writers[load.slot]
            writer.close()
        writer = open_slot(load)
        self.writers[load.slot] = (load.handle, load.capacity, writer)
        return writer

    def run(self) -> None:
        child.freeze_heap()
        info = LoaderInfo(transports=list(TRANSPORTS), io=self.io_mode, chunk=self.chunk)
        self._push(Ready(proc=PROC, pid=os.getpid(), info=info))
        log(f"ready (pid {os.getpid()}, io={self.io_mode}, chunk={self.chunk})")
        while not self.stopping:
            self._beat()
            if self.queue:
                self._serve(self.queue.popleft())
                continue
            wait = max(0.0, self._next_beat - time.monotonic())
            self._receive(int(wait * 1000) + 1)
        for item in self.queue:
            self._fail(item, "loader shutting down")
        self.queue.clear()

    def close(self) -> None:
        self._wake.close()
        for _handle, _cap, writer in self.writers.values():
            writer.close()
        self.writers.clear()
        self.router.close(0)
        self.control.close(0)
        self.ctx.term()


def _matches(load: Load, cancel: Cancel) -> bool:
    return load.slot == cancel.slot and load.generation == cancel.generation


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="memspec.procs.loader.main", description=__doc__)
    ap.add_argument("--endpoint", required=True, help="ROUTER endpoint to bind (decoder)")
    ap.add_argument("--control", required=True, help="supervisor control PULL to connect")
    ap.add_argument("--chunk", type=int, default=CHUNK, help="bytes per read (4 KiB multiple)")
    ap.add_argument("--io", choices=IO_MODES, default="auto",
                    help="auto/direct: O_DIRECT when the filesystem allows; buffered: fadvise")
    args = ap.parse_args(argv)
    child.start(PROC)
    proc = LoaderProcess(args.endpoint, args.control, args.chunk, args.io)

    def on_signal(signum: int, _frame: object) -> None:
        proc.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        proc.run()
    finally:
        proc.close()
    log("stopped")
    return 0


if __name__ == "__main__":
    fast_exit(main())  # cleanup is done in main; skip the slow torch teardown
