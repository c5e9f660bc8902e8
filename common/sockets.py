"""ZeroMQ plumbing: private run directory, endpoints, and typed send/receive.

Sockets bind to ``ipc://`` inside a 0700 run directory by default (nothing else on the
machine can connect), or to loopback TCP when asked. Receiving never raises on bad input:
it returns the :class:`ProtocolError` so the caller can reply with an error and go on.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import zmq

from memspec.common.messages import Codec, Message, ProtocolError, encode
from memspec.common.shmclean import pid_alive

NAMES = ("control", "decoder", "loader", "predictor", "client")
M = TypeVar("M", bound=Message)
REJECT_LOG_BURST = 20
SUPERVISOR_ID_ENV = "MEMSPEC_SUPERVISOR_ID"  # the supervisor's routing id at the decoder
REJECT_LOG_WINDOW_S = 60.0
RUN_DIR = re.compile(r"memspec-(\d+)-(\d+)-[0-9a-f]{6}")


class RejectLog:
    """Logs at most `burst` rejected messages per `window_s`, then one line saying it goes
    quiet, and at the next window how many it left out: a flood of garbage on a socket must
    not fill a disk, and a problem that starts later still shows (`count` keeps the total)."""

    def __init__(self, log: Callable[[str], None], burst: int = REJECT_LOG_BURST,
                 window_s: float = REJECT_LOG_WINDOW_S, what: str = "rejected message",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.burst, self.window_s, self.what, self.clock = (
            log, burst, window_s, what, clock)
        self.count = 0
        self._start = clock()
        self._logged = self._skipped = 0

    def __call__(self, reason: str) -> None:
        self.count += 1
        now = self.clock()
        if now - self._start >= self.window_s:
            if self._skipped:
                self.log(f"{self._skipped} more {self.what}s were not logged")
            self._start, self._logged, self._skipped = now, 0, 0
        if self._logged < self.burst:
            self._logged += 1
            self.log(f"{self.what}: {reason}")
            return
        if not self._skipped:
            left = self.window_s - (now - self._start)
            self.log(f"further {self.what}s are not logged for {left:.0f}s")
        self._skipped += 1


def run_root() -> Path:
    return Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())


def make_run_dir(base: str | os.PathLike | None = None) -> Path:
    """A fresh private (0700) directory for this run's ipc sockets and logs."""
    root = Path(base) if base else run_root()
    path = root / f"memspec-{os.getuid()}-{os.getpid()}-{secrets.token_hex(3)}"
    path.mkdir(mode=0o700, parents=True)
    os.chmod(path, 0o700)
    return path


def sweep_run_dirs(base: str | os.PathLike | None = None) -> list[Path]:
    """Remove this user's run directories whose supervisor is gone (it was SIGKILLed)."""
    root = Path(base) if base else run_root()
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = RUN_DIR.fullmatch(entry.name)
        if m and int(m.group(1)) == os.getuid() and not pid_alive(int(m.group(2))):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def endpoint(run_dir: Path, name: str, tcp: bool = False) -> str:
    if tcp:
        return f"tcp://127.0.0.1:{free_tcp_port()}"
    return f"ipc://{run_dir / (name + '.sock')}"


def configure(sock: zmq.Socket) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 16 << 20)  # oversized frames are dropped by ZeroMQ itself
    return sock


def send(sock: zmq.Socket, msg: Message, ident: bytes | list[bytes] | None = None,
         flags: int = zmq.NOBLOCK) -> None:
    """Non-blocking by default: a peer that is down or backed up raises zmq.Again, so no
    process ever hangs on another (callers decide whether to drop or retry). `ident` is a
    ROUTER's routing identity, or a whole envelope from `recv_routed`."""
    head = [] if ident is None else [ident] if isinstance(ident, bytes) else ident
    sock.send_multipart(head + encode(msg), flags=flags, copy=False)


def recv(sock: zmq.Socket, codec: Codec[M], router: bool = False, flags: int = 0
         ) -> tuple[bytes | None, M | ProtocolError]:
    """(identity, the message, or the reason it was rejected by this socket's codec).

    Raises ValueError for a ROUTER frame list without an identity (it cannot be answered).
    """
    frames = sock.recv_multipart(flags)
    ident = None
    if router:
        if not frames:
            raise ValueError("no routing identity")
        ident, frames = frames[0], frames[1:]
    try:
        return ident, codec.decode(frames)
    except ProtocolError as exc:
        return ident, exc


def recv_routed(sock: zmq.Socket, codec: Codec[M], flags: int = 0
                ) -> tuple[list[bytes], M | ProtocolError]:
    """A ROUTER's (reply envelope, message). A REQ peer puts an empty delimiter frame before
    its message and drops replies without one, so the delimiter stays in the envelope.

    Raises ValueError for a frame list without an identity (it cannot be answered).
    """
    frames = sock.recv_multipart(flags)
    if len(frames) < 2:
        raise ValueError("no routing identity")
    n = 2 if frames[1] == b"" and len(frames) > 2 else 1
    try:
        return frames[:n], codec.decode(frames[n:])
    except ProtocolError as exc:
        return frames[:n], exc
