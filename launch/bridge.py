"""Work for the supervisor from other threads: the HTTP server's event loop, the Python API.

The supervisor's state changes in one thread, the one that calls `tick` (it is not
thread-safe, and a lock around it would put HTTP latency into the decode relay). Other
threads never touch it: they queue a call here and write one byte to a pipe that `tick`
watches, so the supervisor thread wakes at once, runs the call (`pump`), and hands every
reply back through the caller's own `sink` (which for an event loop is
`call_soon_threadsafe`). A request's replies are the supervisor's usual ones: Queued,
Tokens, then one Done or Error; a refused submit is the MemspecError itself.

The supervisor thread also publishes an immutable `Health` after every `pump`; readers in
other threads take the reference as it is (one atomic read), never a half-updated state.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from memspec.common.errors import MemspecError
from memspec.common.messages import Message, Submit
from memspec.launch.supervisor import Supervisor

T = TypeVar("T")
Sink = Callable[[Message | MemspecError], None]


@dataclass(frozen=True)
class Health:
    ready: bool  # all three processes ready and the server not stopping
    states: dict[str, str] = field(default_factory=dict)  # process -> state
    stopping: bool = False
    # a crash loop: process -> (crashes in a row, seconds until its next start)
    crash_loop: dict[str, tuple[int, float]] = field(default_factory=dict)

    @property
    def status(self) -> str:
        if self.stopping:
            return "stopping"
        if self.ready:
            return "ready"
        return "restarting" if {"restarting", "backoff"} & set(self.states.values()) \
            else "starting"


class Bridge:
    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[Callable[[Supervisor], None]] = queue.SimpleQueue()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self.health = Health(ready=False)
        self.closed = False
        self._lock = threading.Lock()  # a closed pipe's descriptor may be reused: no late write

    @property
    def fd(self) -> int:
        """Readable when calls wait (register it with `Supervisor.add_waker`)."""
        return self._r

    # ---- any thread --------------------------------------------------------------------
    def call(self, fn: Callable[[Supervisor], None]) -> None:
        """Run `fn(supervisor)` in the supervisor's thread, soon."""
        with self._lock:
            if self.closed:
                raise MemspecError("the server is stopping", "resubmit once it is back")
            self._calls.put(fn)
            try:
                os.write(self._w, b"\0")
            except BlockingIOError:
                pass  # the pipe is full: the supervisor is being woken anyway

    def ask(self, fn: Callable[[Supervisor], T]) -> Future[T]:
        """`fn(supervisor)`'s result (or exception), from the supervisor's thread."""
        fut: Future[T] = Future()

        def run(sup: Supervisor) -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(sup))
                except Exception as exc:  # noqa: BLE001 - handed to the asking thread
                    fut.set_exception(exc)

        self.call(run)
        return fut

    def submit(self, req: Submit, sink: Sink) -> None:
        """Queue `req`; its replies, or the reason it was refused, go to `sink` (called in
        the supervisor's thread: it must only hand them on)."""

        def run(sup: Supervisor) -> None:
            try:
                sup.submit(req, sink)
            except MemspecError as exc:
                sink(exc)

        self.call(run)

    def cancel(self, req_id: str, reason: str = "cancelled") -> None:
        try:
            self.call(lambda sup: sup.cancel(req_id, reason))
        except MemspecError:
            pass  # stopping: every request ends anyway

    # ---- the supervisor's thread -------------------------------------------------------
    def pump(self, sup: Supervisor) -> None:
        """Run the calls that wait; publish the supervisor's health."""
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        while True:
            try:
                fn = self._calls.get_nowait()
            except queue.Empty:
                break
            fn(sup)
        now = time.monotonic()
        self.health = Health(ready=sup.ready and not self.closed,
                             stopping=sup.closed or self.closed,
                             states={n: p.state for n, p in sup.procs.items()},
                             crash_loop={n: (p.crashes, max(0.0, p.next_start - now)
                                             if p.state == "backoff" else 0.0)
                                         for n, p in sup.procs.items() if p.crashes > 1})

    def close(self, sup: Supervisor | None = None) -> None:
        """Refuse further calls; the ones already queued still run (against `sup`, which
        answers them as a stopping server does), so no caller waits forever."""
        with self._lock:
            self.closed = True
        self.health = Health(ready=False, stopping=True, states=dict(self.health.states))
        if sup is not None:
            self.pump(sup)
        with self._lock:
            os.close(self._r)
            os.close(self._w)


def serve_forever(sup: Supervisor, bridge: Bridge, stop: Callable[[], bool],
                  each: Callable[[], Any] | None = None, timeout_ms: int = 50) -> None:
    """The supervisor thread's loop: tick, run the bridged calls, until `stop()`."""
    sup.add_waker(bridge.fd)
    bridge.pump(sup)
    while not stop():
        if each is not None:
            each()
        sup.tick(timeout_ms)
        bridge.pump(sup)
