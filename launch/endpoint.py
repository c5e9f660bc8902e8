"""The client endpoint: its syntax, its default, and one server per endpoint.

An ipc endpoint gets a lock file beside its socket (`<socket>.lock`, flock held for the
server's life, holding its pid). A second `memspec up` on the same endpoint finds the lock
held and refuses, naming the pid; a socket file whose lock is free was left by a server
that died (SIGKILL) and is removed. The lock file itself stays: unlinking it would let two
servers lock two different files of the same name. A TCP endpoint needs no lock: the
kernel refuses a second bind on a port.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

from memspec.common.errors import MemspecError

IPC_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL
EXAMPLE = "ipc:///tmp/memspec.sock or tcp://127.0.0.1:5555"


def default_endpoint(create: bool = True) -> str:
    """`ipc://$XDG_RUNTIME_DIR/memspec-UID/memspec.sock` (/tmp without XDG_RUNTIME_DIR)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    folder = os.path.join(base, f"memspec-{os.getuid()}")
    if create:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    return f"ipc://{folder}/memspec.sock"


def check_endpoint(ep: str, serving: bool = False) -> str:
    """`ep` if ZeroMQ can use it as a memspec endpoint, else a one-line MemspecError
    (`serving`: also that an ipc socket can be made there)."""
    if ep.startswith("ipc://"):
        path = ep[len("ipc://"):]
        if not path or path.endswith("/"):
            raise MemspecError(f"endpoint {ep!r} names no socket file", f"use e.g. {EXAMPLE}")
        if len(os.fsencode(path)) > IPC_PATH_MAX:
            raise MemspecError(f"ipc path of {ep!r} is longer than {IPC_PATH_MAX} bytes",
                               "use a shorter path")
        folder = Path(path).parent
        if serving and not folder.is_dir():
            raise MemspecError(f"folder {folder} of endpoint {ep} does not exist",
                               "create it or pick another path")
        return ep
    if ep.startswith("tcp://"):
        host, sep, port = ep[len("tcp://"):].rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise MemspecError(f"endpoint {ep!r} is not tcp://HOST:PORT with a port 1-65535",
                               f"use e.g. {EXAMPLE}")
        return ep
    raise MemspecError(f"endpoint {ep!r} is neither ipc://PATH nor tcp://HOST:PORT",
                       f"use e.g. {EXAMPLE}")


def ipc_path(ep: str) -> Path | None:
    return Path(ep[len("ipc://"):]) if ep.startswith("ipc://") else None


def ipc_listening(path: Path) -> bool:
    """Whether a process accepts connections on this unix socket (a stale file refuses)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(os.fspath(path))
        except OSError:
            return False
        return True


class EndpointLock:
    """Held by the server that serves an ipc endpoint; a no-op for TCP."""

    def __init__(self, ep: str) -> None:
        self.ep = ep
        self.fd: int | None = None
        path = ipc_path(ep)
        if path is None:
            return
        lock = path.with_name(path.name + ".lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise MemspecError(f"cannot lock {lock} ({exc.strerror})",
                                   "check the folder's permissions") from None
            raise MemspecError(f"a memspec server (pid {holder}) already serves {ep}",
                               f"stop it first (kill -INT {holder}) or pick another "
                               "--endpoint") from None
        if path.exists():
            if ipc_listening(path):  # a server that takes no lock (another program)
                os.close(fd)
                raise MemspecError(f"another process listens on {path}",
                                   "stop it or pick another --endpoint")
            path.unlink()  # stale: its server died without removing it
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        """Remove the socket file while the lock is still held, then unlock."""
        if self.fd is None:
            return
        path = ipc_path(self.ep)
        if path is not None:
            path.unlink(missing_ok=True)
        os.ftruncate(self.fd, 0)
        os.close(self.fd)
        self.fd = None
