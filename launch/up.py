"""`memspec up`, and `memspec generate` through the same three processes."""

from __future__ import annotations

import os
import secrets
import select
import signal
from collections import deque
from typing import Any

from memspec.common.errors import MemspecError
from memspec.common.messages import Done, Error, Message, Submit, Tokens
from memspec.common.metrics import as_json
from memspec.launch.endpoint import default_endpoint
from memspec.launch.supervisor import MAX_QUEUE, Supervisor
from memspec.launch.terminal import CONSOLE, Interrupted, StopSignals, check_utf8

MAX_LINE = 1 << 20  # a longer stdin line is dropped with an error


class StdinPrompts:
    """Prompts from stdin, one per line, read as bytes without ever blocking the loop.

    A line that is not UTF-8 gets a one-line error and the server goes on. Reading pauses
    while the request queue is full (piped prompts wait instead of being refused), and at
    end of input the server says so once and keeps serving its endpoint.
    """

    def __init__(self, sup: Supervisor, endpoint: str, fd: int = 0) -> None:
        self.sup, self.endpoint, self.fd = sup, endpoint, fd
        self.buf = b""
        self.lines: deque[tuple[int, bytes]] = deque()
        self.lineno = 0
        self.open = True
        self.too_long = False

    def poll(self) -> None:
        self._submit()
        if not self.open or self.lines or not select.select([self.fd], [], [], 0)[0]:
            return
        try:
            chunk = os.read(self.fd, 1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            chunk = b""
            CONSOLE.error(f"cannot read stdin ({exc.strerror})")
        if chunk:
            self._split(chunk)
        else:
            self.open = False
            if self.buf:
                self._line(self.buf)
            CONSOLE.note(f"stdin closed; still serving {self.endpoint} (Ctrl-C to stop)")
        self._submit()

    def _split(self, chunk: bytes) -> None:
        *whole, self.buf = (self.buf + chunk).split(b"\n")
        for raw in whole:
            self._line(raw)
        if len(self.buf) > MAX_LINE:
            self.buf, self.too_long = b"", True

    def _line(self, raw: bytes) -> None:
        self.lineno += 1
        if self.too_long:
            self.too_long = False
            CONSOLE.error(f"stdin line {self.lineno} is longer than {MAX_LINE} bytes; "
                          "line skipped, send shorter prompts")
        else:
            self.lines.append((self.lineno, raw))

    def _submit(self) -> None:
        while self.lines and len(self.sup.queue) < self.sup.max_queue:
            lineno, raw = self.lines.popleft()
            try:
                prompt = raw.decode("utf-8").strip()
            except UnicodeDecodeError as exc:
                CONSOLE.error(f"stdin line {lineno} is not UTF-8 (byte 0x{raw[exc.start]:02x} "
                              f"at offset {exc.start}); line skipped, send UTF-8 text")
                continue
            if prompt:
                try:
                    self.sup.submit(Submit(req_id=secrets.token_hex(6), prompt=prompt),
                                    _stdout_reply)
                except MemspecError as exc:
                    CONSOLE.error(str(exc))


def serve(pool: str | None, endpoint: str | None, read_stdin: bool = True,
          cold_start: bool = False, tcp: bool = False, max_queue: int = MAX_QUEUE) -> int:
    """Serve until SIGINT (exit code 130), SIGTERM or SIGHUP (0)."""
    stop = StopSignals()
    endpoint = endpoint or default_endpoint()
    sup = Supervisor(pool, client_endpoint=endpoint, cold_start=cold_start, tcp=tcp,
                     max_queue=max_queue)
    try:
        CONSOLE.note(f"starting decoder, loader, predictor (logs: {sup.run_dir})")
        if sup.start(stop=stop):
            CONSOLE.note(f"ready on {endpoint}" + ("; reading prompts from stdin"
                                                   if read_stdin else ""))
            stdin = StdinPrompts(sup, endpoint) if read_stdin else None
            while not stop():
                if stdin is not None:
                    stdin.poll()
                sup.tick(50)
    finally:
        sup.shutdown()
    CONSOLE.note(f"stopped ({signal.Signals(stop.signum).name})")
    return 130 if stop.signum == signal.SIGINT else 0


def _stdout_reply(msg: Message) -> None:
    if isinstance(msg, Tokens):
        CONSOLE.text(msg.text)
    elif isinstance(msg, Done):
        s = msg.stats
        CONSOLE.end_text()
        CONSOLE.note(f"{s.generated_tokens} tokens, {s.tokens_per_s_steady:.1f} tok/s "
                     f"steady, mean acceptance length {s.mean_acceptance_length:.2f}, "
                     f"drafts {s.drafts_used}")
    elif isinstance(msg, Error):
        CONSOLE.error(msg.message)


def generate(pool: str | None, prompt: str, stream: bool, cold_start: bool = True,
             **kw: Any) -> dict[str, Any]:
    """One request through a private pipeline; returns the `--json` object."""
    check_utf8(prompt, "the prompt")
    stop = StopSignals()
    sup = Supervisor(pool, cold_start=cold_start)

    def show(msg: Message) -> None:
        if isinstance(msg, Tokens) and stream:
            CONSOLE.text(msg.text)

    done = None
    try:
        if sup.start(stop=stop):
            done = sup.run(Submit(req_id=secrets.token_hex(6), prompt=prompt, **kw), show,
                           stop)
    finally:
        sup.shutdown()
    if stop.signum or done is None:
        raise Interrupted(stop.signum or signal.SIGINT)
    if isinstance(done, Error):
        raise MemspecError(f"request failed: {done.message}")
    return {"text": done.text, "token_ids": done.token_ids, "stats": as_json(done.stats)}
