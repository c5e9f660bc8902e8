"""`memspec up`, and `memspec generate` through the same three processes."""

from __future__ import annotations

import os
import secrets
import select
import signal
import sys
from typing import Any

from memspec.common.errors import MemspecError
from memspec.common.messages import Done, Error, Message, Submit, Tokens
from memspec.common.metrics import as_json
from memspec.launch.supervisor import Supervisor


def default_endpoint() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    folder = os.path.join(base, f"memspec-{os.getuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return f"ipc://{folder}/memspec.sock"


class _Stop:
    """SIGINT/SIGTERM flip a flag; the loop then shuts every process down."""

    def __init__(self) -> None:
        self.flag = False
        signal.signal(signal.SIGINT, self._set)
        signal.signal(signal.SIGTERM, self._set)

    def _set(self, signum, frame) -> None:  # noqa: ANN001
        self.flag = True


def serve(pool: str | None, endpoint: str | None, read_stdin: bool = True,
          cold_start: bool = False, tcp: bool = False) -> int:
    stop = _Stop()
    endpoint = endpoint or default_endpoint()
    sup = Supervisor(pool, client_endpoint=endpoint, cold_start=cold_start, tcp=tcp)
    try:
        print(f"[memspec] starting decoder, loader, predictor (logs: {sup.run_dir})",
              file=sys.stderr, flush=True)
        sup.start()
        print(f"[memspec] ready on {endpoint}" + ("; reading prompts from stdin" if read_stdin
                                                  else ""), file=sys.stderr, flush=True)
        stdin_open = read_stdin
        while not stop.flag:
            if stdin_open and select.select([sys.stdin], [], [], 0)[0]:
                line = sys.stdin.readline()
                if not line:
                    stdin_open = False
                elif line.strip():
                    sup.submit(Submit(req_id=secrets.token_hex(6), prompt=line.strip()),
                               _stdout_reply)
            sup.tick(50)
            if read_stdin and not stdin_open and sup.idle:
                break  # stdin closed and its prompts answered
    finally:
        sup.shutdown()
    return 0


def _stdout_reply(msg: Message) -> None:
    if isinstance(msg, Tokens):
        sys.stdout.write(msg.text)
    elif isinstance(msg, Done):
        s = msg.stats
        sys.stdout.write("\n")
        print(f"[memspec] {s.generated_tokens} tokens, {s.tokens_per_s_steady:.1f} tok/s "
              f"steady, mean acceptance length {s.mean_acceptance_length:.2f}, "
              f"drafts {s.drafts_used}", file=sys.stderr)
    elif isinstance(msg, Error):
        print(f"\nmemspec: error: {msg.message}", file=sys.stderr)
    sys.stdout.flush()


def generate(pool: str | None, prompt: str, stream: bool, cold_start: bool = True,
             **kw: Any) -> dict[str, Any]:
    """One request through a private pipeline; returns the `--json` object."""
    stop = _Stop()
    sup = Supervisor(pool, cold_start=cold_start)

    def show(msg: Message) -> None:
        if isinstance(msg, Tokens) and stream:
            sys.stdout.write(msg.text)
            sys.stdout.flush()

    try:
        sup.start()
        done = sup.run(Submit(req_id=secrets.token_hex(6), prompt=prompt, **kw), show,
                       lambda: stop.flag)
    finally:
        sup.shutdown()
    if done is None:
        raise MemspecError("interrupted", "run the command again")
    if isinstance(done, Error):
        raise MemspecError(done.message, "see the message above")
    return {"text": done.text, "token_ids": done.token_ids, "stats": as_json(done.stats)}
