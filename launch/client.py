"""Clients of a running supervisor: `memspec submit` and `memspec status`."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from memspec.common.errors import MemspecError
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
)
from memspec.common.sockets import configure, recv, send

NO_SERVER = "start one with `memspec up --endpoint E`"


def _connect(endpoint: str) -> tuple[zmq.Context, zmq.Socket]:
    if endpoint.startswith("ipc://") and not Path(endpoint[6:]).exists():
        raise MemspecError(f"no memspec server at {endpoint}", NO_SERVER)
    ctx = zmq.Context()
    sock = configure(ctx.socket(zmq.DEALER))
    sock.connect(endpoint)
    return ctx, sock


def _request(endpoint: str, msg: Message, on_msg: Callable[[Message], bool],
             timeout_s: float) -> None:
    ctx, sock = _connect(endpoint)
    try:
        try:
            send(sock, msg, flags=0 if endpoint.startswith("tcp://") else zmq.NOBLOCK)
        except zmq.Again:
            raise MemspecError(f"no memspec server at {endpoint}", NO_SERVER) from None
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(min(left, 1.0) * 1000)):
                if left <= 0:
                    raise MemspecError(f"no reply from {endpoint} in {timeout_s:.0f}s",
                                       "check `memspec status` or " + NO_SERVER)
                continue
            _, reply = recv(sock, CLIENT_REPLIES)
            if isinstance(reply, ProtocolError):
                raise MemspecError(f"malformed reply from server: {reply}", "check the versions")
            if on_msg(reply):
                return
    finally:
        ctx.destroy(linger=0)


def submit(endpoint: str, prompt: str, on_tokens: Callable[[Tokens], None] | None = None,
           timeout_s: float = 3600, **kw) -> Done:
    req = Submit(req_id=secrets.token_hex(6), prompt=prompt, **kw)
    result: list[Message] = []

    def on_msg(m: Message) -> bool:
        if isinstance(m, Tokens) and on_tokens:
            on_tokens(m)
        if isinstance(m, (Done, Error)):
            result.append(m)
            return True
        return False

    _request(endpoint, req, on_msg, timeout_s)
    if isinstance(result[0], Error):
        raise MemspecError(f"request failed: {result[0].message}", "see the server's log")
    return result[0]  # type: ignore[return-value]


def status(endpoint: str, timeout_s: float = 10) -> Status:
    out: list[Status] = []

    def on_msg(m: Message) -> bool:
        if isinstance(m, Status):
            out.append(m)
            return True
        if isinstance(m, Error):
            raise MemspecError(f"status failed: {m.message}", "check the server")
        return False

    _request(endpoint, StatusRequest(), on_msg, timeout_s)
    return out[0]
