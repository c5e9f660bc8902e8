"""`memspec up`, and `memspec generate` through the same three processes."""

from __future__ import annotations

import os
import secrets
import select
import signal
from collections import deque
from typing import TYPE_CHECKING, Any

from memspec.common.config import ORACLE_POLICIES
from memspec.common.errors import MemspecError
from memspec.common.limits import check_request
from memspec.common.messages import Done, Error, Message, Submit, Tokens
from memspec.launch.bridge import Bridge, serve_forever
from memspec.launch.client import done_json
from memspec.launch.endpoint import default_endpoint
from memspec.launch.supervisor import MAX_QUEUE, Supervisor
from memspec.launch.terminal import CONSOLE, Interrupted, StopSignals, check_utf8

if TYPE_CHECKING:
    from memspec.launch.http import HttpServer

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
          cold_start: bool = False, tcp: bool = False, max_queue: int = MAX_QUEUE,
          http: str | None = None, api_key: str | None = None,
          log_level: str | None = None, standby: bool | str = "auto") -> int:
    """Serve until SIGINT (exit code 130), SIGTERM or SIGHUP (0). The supervisor runs in
    this (the main) thread; `http` adds the HTTP front end in a thread of its own, which
    reaches the supervisor only through a Bridge (launch/bridge.py)."""
    stop = StopSignals()
    endpoint = endpoint or default_endpoint()
    web = _http_server(pool, http, api_key) if http else None  # a port in use: no start
    try:
        sup = Supervisor(pool, client_endpoint=endpoint, cold_start=cold_start, tcp=tcp,
                         max_queue=max_queue, log_level=log_level, standby=standby)
    except BaseException:
        if web is not None:
            web.sock.close()
        raise
    bridge = web.app.bridge if web is not None else Bridge()

    def starting() -> bool:  # /health and /metrics answer while the models load
        bridge.pump(sup)
        return stop()

    try:
        CONSOLE.note(f"starting decoder, loader, predictor (logs: {sup.run_dir})")
        if web is not None:
            web.start()
            CONSOLE.note(f"HTTP on {web.url}/v1 (model {web.app.model}; /health is 503 "
                         "until the processes are ready)")
        if sup.start(stop=starting):
            CONSOLE.note(f"ready on {endpoint}" + (f" and {web.url}" if web else "")
                         + ("; reading prompts from stdin" if read_stdin else ""))
            stdin = StdinPrompts(sup, endpoint) if read_stdin else None
            serve_forever(sup, bridge, stop, stdin.poll if stdin is not None else None)
    finally:
        if web is not None:
            web.server.should_exit = True  # no new connections while the rest stops
        sup.shutdown()  # every waiting request, HTTP ones too, gets its Error
        bridge.close(sup)
        if web is not None:
            web.stop()
    CONSOLE.note(f"stopped ({signal.Signals(stop.signum).name})")
    return 130 if stop.signum == signal.SIGINT else 0


def _http_server(pool: str | None, address: str, api_key: str | None) -> HttpServer:
    """The HTTP front end for the pool's target, its port bound (nothing started yet)."""
    from memspec.common.config import POLICIES, load_pool
    from memspec.launch.http import App, HttpServer, is_loopback  # noqa: F811

    cfg = load_pool(pool)
    app = App(Bridge(), cfg.target.name, [d.name for d in cfg.drafts], api_key,
              info={"general": cfg.general, "K": cfg.K, "policy": cfg.policy,
                    "policies": list(POLICIES)})
    web = HttpServer(app, address)
    if not api_key and not is_loopback(web.host):
        CONSOLE.note(f"warning: HTTP on {web.host} without --api-key: anyone who reaches it "
                     "can use it")
    return web


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


def _show_tokens(stream: bool) -> Any:
    def show(msg: Message) -> None:
        if isinstance(msg, Tokens) and stream:
            CONSOLE.text(msg.text)
    return show


def generate(pool: str | None, prompt: str, stream: bool, cold_start: bool = False,
             fresh: bool = False, **kw: Any) -> dict[str, Any]:
    """One request; returns the `--json` object. Through the `memspec up` serving the
    default endpoint with the same pool when there is one (launch/reuse.py), else through
    a private pipeline started for it (`fresh`: always)."""
    check_utf8(prompt, "the prompt")
    req = Submit(req_id=secrets.token_hex(6), prompt=prompt, **kw)
    check_request(req)  # the request's limits, before three processes start
    if not (fresh or cold_start):
        from memspec.launch.reuse import generate_on_server

        out = generate_on_server(pool, prompt, stream, **kw)
        if out is not None:
            return out
    stop = StopSignals()
    sup = Supervisor(pool, cold_start=cold_start,  # ("": the pool's policy, which may be one)
                     oracle_tables=not req.policy or req.policy in ORACLE_POLICIES)
    done = None
    try:
        if sup.start(stop=stop):
            done = sup.run(req, _show_tokens(stream), stop)
    finally:
        sup.shutdown()
    if stop.signum or done is None:
        raise Interrupted(stop.signum or signal.SIGINT)
    if isinstance(done, Error):
        raise MemspecError(f"request failed: {done.message}")
    return done_json(done)
