"""Clients of a running supervisor: `memspec submit` and `memspec status`.

No wait is unbounded. Connecting ends at the ZeroMQ handshake, or at once when nothing
listens (a missing or stale socket file, a refused port), or after `connect` seconds. The
server acknowledges a request with `Queued` within `first` seconds and repeats it every
few seconds while the request waits, so a silence of `idle` seconds means it is stuck. A
server that goes away mid-request is seen at once, through the socket's monitor.
"""

from __future__ import annotations

import secrets
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import zmq

from memspec.common.errors import MemspecError
from memspec.common.limits import check_request
from memspec.common.messages import (
    CLIENT_REPLIES,
    Done,
    Error,
    Message,
    ProtocolError,
    Status,
    StatusRequest,
    Submit,
    Tokens,
    logprobs_json,
)
from memspec.common.metrics import as_json
from memspec.common.sockets import configure, send
from memspec.launch.endpoint import check_endpoint, default_endpoint, ipc_path

PROC_NAMES = ("loader", "predictor", "decoder")
SLOT_STATES = ("free", "loading", "resident")


@dataclass(frozen=True)
class Timeouts:
    connect: float = 5.0  # until the ZeroMQ handshake
    first: float = 10.0  # until the server's first reply (Queued, or a Status)
    idle: float = 30.0  # between two replies; the server sends one every 2 s


def _start_hint(endpoint: str) -> str:
    flag = "" if endpoint == default_endpoint(create=False) else f" --endpoint {endpoint}"
    return f"start one with `memspec up{flag}`"


def monitor_event(sock: zmq.Socket) -> int:
    """The event number of one socket-monitor message (its first frame starts with it, a
    native-order uint16, as pyzmq's parser reads it). That parser's module imports
    asyncio: ~40 ms of every command that talks to a server."""
    frames = sock.recv_multipart()
    return struct.unpack_from("=H", frames[0])[0]


class Connection:
    """A DEALER connected to a memspec server, with a monitor that reports a lost peer."""

    def __init__(self, endpoint: str, timeouts: Timeouts) -> None:
        self.endpoint, self.timeouts = check_endpoint(endpoint), timeouts
        path = ipc_path(endpoint)
        if path is not None and not path.exists():
            raise MemspecError(f"no memspec server at {endpoint} (no socket file)",
                               _start_hint(endpoint))
        self.ctx = zmq.Context()
        self.sock = configure(self.ctx.socket(zmq.DEALER))
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED)
        try:
            self.sock.connect(endpoint)
            self._handshake()
        except BaseException:
            self.close()
            raise

    def _handshake(self) -> None:
        deadline = time.monotonic() + self.timeouts.connect
        while (left := deadline - time.monotonic()) > 0:
            if not self.monitor.poll(int(left * 1000) + 1):
                break
            event = monitor_event(self.monitor)
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return
            if event == zmq.EVENT_CONNECT_RETRIED:  # refused: nothing listens there
                what = "stale socket file" if self.endpoint.startswith("ipc://") \
                    else "connection refused"
                raise MemspecError(f"no memspec server at {self.endpoint} ({what})",
                                   _start_hint(self.endpoint))
        raise MemspecError(f"{self.endpoint} did not complete a ZeroMQ handshake in "
                           f"{self.timeouts.connect:g}s", "check that it is a memspec server")

    def request(self, msg: Message, on_msg: Callable[[Message], bool]) -> None:
        """Send `msg`, then hand every reply to `on_msg` until it returns True."""
        for reply in self.replies(msg):
            if on_msg(reply):
                return

    def replies(self, msg: Message) -> Iterator[Message]:
        """Send `msg`, then yield every reply, each within its timeout (the caller stops)."""
        send(self.sock, msg)
        wait, what = self.timeouts.first, "answered"
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        deadline = time.monotonic() + wait
        while True:
            left = deadline - time.monotonic()
            events = dict(poller.poll(max(0, int(left * 1000)) + 1)) if left > 0 else {}
            if self.sock in events:
                yield _checked(_decode(self.sock.recv_multipart()))
                wait, what = self.timeouts.idle, "sent anything"
                deadline = time.monotonic() + wait
            elif self.monitor in events:
                if monitor_event(self.monitor) == zmq.EVENT_DISCONNECTED:
                    if self.sock.poll(0):  # its last words (a final Error) first
                        continue
                    raise MemspecError(f"the server at {self.endpoint} went away during the "
                                       "request (stopped or killed)",
                                       f"{_start_hint(self.endpoint)} and resubmit")
            elif time.monotonic() >= deadline:
                raise MemspecError(f"the server at {self.endpoint} has not {what} for "
                                   f"{wait:g}s", "it may be stuck or overloaded: see its "
                                   "log, or wait longer (--timeout, --idle-timeout)")

    def close(self) -> None:
        self.sock.disable_monitor()
        self.ctx.destroy(linger=0)


def _checked(reply: Message | ProtocolError) -> Message:
    if isinstance(reply, ProtocolError):
        raise MemspecError(f"malformed reply from the server: {reply}",
                           "use the same memspec version for client and server")
    return reply


def _decode(frames: list[bytes]) -> Message | ProtocolError:
    try:
        return CLIENT_REPLIES.decode(frames)
    except ProtocolError as exc:
        return exc


def _request(endpoint: str, msg: Message, on_msg: Callable[[Message], bool],
             timeouts: Timeouts) -> None:
    conn = Connection(endpoint, timeouts)
    try:
        conn.request(msg, on_msg)
    finally:
        conn.close()


def submit(endpoint: str | None, prompt: str, on_tokens: Callable[[Tokens], None] | None = None,
           timeouts: Timeouts = Timeouts(), **kw) -> Done:
    """One request to the server at `endpoint`; `kw` are Submit's fields (policy,
    max_new_tokens, sampling, stop, gate: the speculation gate for this request)."""
    endpoint = endpoint or default_endpoint(create=False)
    req = Submit(req_id=secrets.token_hex(6), prompt=prompt, **kw)
    check_request(req)  # the server's own limits, before anything is sent
    result: list[Done | Error] = []

    def on_msg(m: Message) -> bool:
        if isinstance(m, Tokens) and m.req_id == req.req_id and on_tokens:
            on_tokens(m)
        if isinstance(m, (Done, Error)) and m.req_id in (req.req_id, ""):
            result.append(m)
            return True
        return False

    _request(endpoint, req, on_msg, timeouts)
    if isinstance(result[0], Error):
        raise MemspecError(f"request failed: {result[0].message}")
    return result[0]


def done_json(done: Done) -> dict[str, Any]:
    """`memspec generate --json`'s object: text, token ids, stats (and logprobs, where the
    request asked for them)."""
    out: dict[str, Any] = {"text": done.text, "token_ids": done.token_ids,
                           "stats": as_json(done.stats)}
    if done.logprobs:
        out["logprobs"] = logprobs_json(done.logprobs)
    return out


def status(endpoint: str | None, timeouts: Timeouts = Timeouts()) -> Status:
    endpoint = endpoint or default_endpoint(create=False)
    out: list[Status] = []

    def on_msg(m: Message) -> bool:
        if isinstance(m, Status):
            out.append(validated(m))
            return True
        if isinstance(m, Error):
            raise MemspecError(f"status failed: {m.message}", "check the server's log")
        return False

    _request(endpoint, StatusRequest(), on_msg, timeouts)
    return out[0]


def validated(st: Status) -> Status:
    """A Status fit to print: the three processes, known slot states, printable names."""
    if set(st.procs) != set(PROC_NAMES):
        raise MemspecError(f"the server's status names processes {sorted(st.procs)}",
                           "use the same memspec version for client and server")
    for slot in st.slots:
        if slot.state not in SLOT_STATES or not (slot.draft or "").isprintable():
            raise MemspecError(f"the server's status has a bad slot {slot.slot}",
                               "see the server's log")
    return st
