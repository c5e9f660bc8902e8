"""`memspec generate` answered by a running `memspec up`, as `ollama run` uses its server.

A fresh `memspec generate` spends seconds starting three processes for one request; when a
`memspec up` already serves the default endpoint with the same pool (the same file, the same
bytes: paths.pool_identity), the request goes there and the command costs its own start
plus the request. This module is the command's first stop, so it imports only the client
side (no supervisor, no torch): ~0.1 s of the reused path's wall is Python and these imports.
"""

from __future__ import annotations

from typing import Any

from memspec.common.errors import MemspecError
from memspec.common.messages import Message, Tokens
from memspec.common.paths import pool_identity
from memspec.launch.client import Timeouts, done_json, status, submit
from memspec.launch.endpoint import default_endpoint, ipc_listening, ipc_path
from memspec.launch.terminal import CONSOLE

PROBE = Timeouts(connect=1.0, first=2.0)  # a server that is there answers a Status in ms


def running_server(pool: str | None) -> str | None:
    """The default endpoint when a `memspec up` serves it with this very pool, else None;
    a server that is there but not usable is said on stderr. ~1 ms when none runs (one
    connect on a unix socket)."""
    ep = default_endpoint(create=False)
    path = ipc_path(ep)
    if path is None or not path.exists() or not ipc_listening(path):
        return None
    try:
        st = status(ep, PROBE)
    except MemspecError as exc:
        CONSOLE.message(f"[memspec] the server at {ep} did not answer ({exc}); "
                        "starting a private one")
        return None
    if st.pool_id != pool_identity(pool):
        CONSOLE.message(f"[memspec] the server at {ep} runs another pool; starting a private "
                        "one (`memspec up --pool` the same file to reuse it)")
        return None
    return ep


def generate_on_server(pool: str | None, prompt: str, stream: bool, **kw: Any
                       ) -> dict[str, Any] | None:
    """The `--json` object of one request through the running server, or None when there
    is none to use (the caller starts its own)."""
    ep = running_server(pool)
    if ep is None:
        return None
    CONSOLE.message(f"[memspec] using the server at {ep} (same pool); --fresh starts a "
                    "private one")

    def show(msg: Message) -> None:
        if isinstance(msg, Tokens) and stream:
            CONSOLE.text(msg.text)

    return done_json(submit(ep, prompt, show, **kw))
