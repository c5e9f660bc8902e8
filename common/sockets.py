"""ZeroMQ plumbing: private run directory, endpoints, and typed send/receive.

Sockets bind to ``ipc://`` inside a 0700 run directory by default (nothing else on the
machine can connect), or to loopback TCP when asked. Receiving never raises on bad input:
it returns the :class:`ProtocolError` so the caller can reply with an error and go on.
"""

from __future__ import annotations

import os
import secrets
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import zmq

from memspec.common.messages import Codec, Message, ProtocolError, encode

NAMES = ("control", "decoder", "loader", "predictor", "client")
M = TypeVar("M", bound=Message)
REJECT_LOG_LIMIT = 50


class RejectLog:
    """Logs the first rejected messages, then one line saying it goes quiet: a flood of
    garbage on a socket must not fill a disk (the count keeps going up)."""

    def __init__(self, log: Callable[[str], None], limit: int = REJECT_LOG_LIMIT) -> None:
        self.log, self.limit = log, limit
        self.count = 0

    def __call__(self, reason: str) -> None:
        self.count += 1
        if self.count <= self.limit:
            self.log(f"rejected message: {reason}")
        elif self.count == self.limit + 1:
            self.log("further rejected messages are not logged")


def make_run_dir(base: str | os.PathLike | None = None) -> Path:
    """A fresh private (0700) directory for this run's ipc sockets."""
    root = Path(base) if base else Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
    path = root / f"memspec-{os.getuid()}-{os.getpid()}-{secrets.token_hex(3)}"
    path.mkdir(mode=0o700, parents=True)
    os.chmod(path, 0o700)
    return path


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


def send(sock: zmq.Socket, msg: Message, ident: bytes | None = None,
         flags: int = zmq.NOBLOCK) -> None:
    """Non-blocking by default: a peer that is down or backed up raises zmq.Again, so no
    process ever hangs on another (callers decide whether to drop or retry)."""
    frames = encode(msg)
    sock.send_multipart(([ident] if ident is not None else []) + frames, flags=flags, copy=False)


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
