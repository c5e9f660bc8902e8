"""A standby decoder: a decoder process that has done its slow start-up work ahead of time
and waits to take over when the running decoder dies.

A restarted decoder spends most of its start on the interpreter, torch's import and the
tokenizer (transformers' import and the tokenizer file): about 3 s of a 3.2 s restart on a
2-core CPU, while the target itself comes back from its prepared cache in 0.2 s. None of
that depends on the run, so the supervisor keeps one process that has done it and blocks on
its stdin; a crashed decoder's successor is that process, told to go on. It holds no
weights, no slots and no sockets until then: what it costs is an idle interpreter with torch
imported (measured by `memspec bench faults`). The supervisor starts it only while the
server is idle, so its imports do not slow a request, and `memspec up --no-standby` turns it
off where even that memory is too much.

The go line is JSON: ``{"at": <the supervisor's time.monotonic() when it sent it>}``; end
of input (the supervisor retired it, or died) ends the process quietly.
"""

from __future__ import annotations

import json
import os
import sys
from typing import IO

from memspec.common.child import SPAWNED_ENV


def prepare(pool_path: str | None, device: str) -> None:
    """The start-up work that does not depend on the run: the pool file, the tokenizer
    (load_serving_tokenizer keeps it for the run), the native extension's module. The
    imports are here, not at the top: the supervisor imports this module for `go_message`
    and must not pay torch's import for it (`memspec up` would start seconds later)."""
    from memspec.common.config import load_pool
    from memspec.procs.decoder.forward.native import extension
    from memspec.procs.decoder.models import load_serving_tokenizer

    pool = load_pool(pool_path)
    load_serving_tokenizer(pool.target, chat=True)
    if device == "cpu":
        extension()


def announce(control: str) -> None:
    """Tell the supervisor this standby is prepared (a Heartbeat in state "standby"): it
    shows the standby in `memspec status`, and `memspec bench faults` waits for it."""
    import zmq

    from memspec.common.messages import Heartbeat
    from memspec.common.sockets import configure, send

    sock = configure(zmq.Context.instance().socket(zmq.PUSH))
    sock.setsockopt(zmq.SNDTIMEO, 5000)
    sock.connect(control)
    try:
        send(sock, Heartbeat(proc="decoder", pid=os.getpid(), state="standby"), flags=0)
    except zmq.Again:
        pass  # the supervisor is gone or stuck: the standby waits all the same
    finally:
        sock.close(linger=1000)


def go_message(at: float) -> bytes:
    return (json.dumps({"at": at}) + "\n").encode()


def wait_for_go(stream: IO[str] | None = None) -> bool:
    """Block until the supervisor says go (True) or retires the standby (False). The go
    time becomes the start the decoder's start-up clock counts from (startup.py)."""
    line = (stream or sys.stdin).readline()
    if not line.strip():
        return False
    try:
        at = float(json.loads(line)["at"])
    except (ValueError, KeyError, TypeError):
        return False  # not the supervisor's go: a standby never runs on a guess
    os.environ[SPAWNED_ENV] = repr(at)
    return True
