"""The OpenAI-compatible HTTP front end of `memspec up --http HOST:PORT`.

Starlette on uvicorn (uvloop where installed; the HTTP parsing is uvicorn's) runs in its own
thread of the supervisor's process, on its own event loop. It never touches the supervisor:
requests go through `launch/bridge.py` to the thread that ticks it, replies come back through
`call_soon_threadsafe` into one asyncio queue per request. Keeping the supervisor in-process
(instead of a ZeroMQ client of it) makes /health exactly the supervisor's view and a
disconnect an immediate `cancel`: a watcher task waits for the client's `http.disconnect`
and cancels the request, which the decoder drops at its next scheduling point.

Routes: POST /v1/chat/completions and /v1/completions (stream or not), GET /v1/models,
GET /health (200 only while the three processes are ready, else 503), GET /metrics
(Prometheus text). Errors are OpenAI error objects: 400 for a malformed body or field, 401
for a wrong API key, 404 for an unknown model or route, 413 for a body over
MAX_BODY_BYTES, 429 when the queue is full, 503 with Retry-After while a process is
(re)starting or the server is stopping.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import ipaddress
import logging
import math
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from memspec.common.errors import MemspecError, RequestError
from memspec.common.messages import Done, Error, Message, Tokens
from memspec.common.toolcalls import reads_calls
from memspec.launch import prometheus
from memspec.launch.bridge import Bridge
from memspec.launch.openai_api import (
    MAX_BODY_BYTES,
    ApiError,
    Call,
    chunk,
    parse_chat,
    parse_completion,
    response,
    usage_chunk,
)
from memspec.launch.supervisor import ServerBusy

DEFAULT_HOST = "127.0.0.1"
RETRY_BUSY_S = 1  # Retry-After of a 429 (the queue drains one request at a time)
RETRY_UNAVAILABLE_S = 5  # Retry-After of a 503 (a restarting decoder takes seconds)
MAX_CONNECTIONS = 256  # more concurrent connections get uvicorn's 503
DRAIN_BYTES = 16 << 20  # a too-large body is read (and dropped) up to here, so the client
#                         gets its 413 instead of a reset; beyond it the connection closes
GONE = object()  # queued by the disconnect watcher
API_KEY_ENV = "MEMSPEC_API_KEY"
LOG = logging.getLogger(__name__)


def parse_address(value: str) -> tuple[str, int]:
    """`HOST:PORT`, `[V6]:PORT` or `PORT` (loopback); port 0 takes any free port (the
    start-up line names it)."""
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = DEFAULT_HOST, value
    host = host.strip("[]") or DEFAULT_HOST
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise MemspecError(f"--http {value!r} is not HOST:PORT with a port 0-65535",
                           "use e.g. --http 127.0.0.1:8000")
    return host, int(port)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything starts: a port in use is one line."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise MemspecError(f"cannot resolve --http host {host!r} ({exc.strerror})",
                           "use an IP address such as 127.0.0.1") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise MemspecError(f"HTTP port {host}:{port} is in use by another process",
                               "stop it or pick another --http port") from None
        raise MemspecError(f"cannot serve HTTP on {host}:{port} ({exc.strerror})",
                           "pick another --http address") from None
    sock.set_inheritable(False)
    return sock


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, headers=headers,
                    media_type="application/json")


def _error(exc: ApiError) -> Response:
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    if exc.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return _json(exc.body(), exc.status, headers)


def refused(exc: MemspecError) -> ApiError:
    """A submit the supervisor refused, as the HTTP answer."""
    if isinstance(exc, ServerBusy):
        return ApiError(429, str(exc), "rate_limit_error", code="server_busy",
                        retry_after=RETRY_BUSY_S)
    if isinstance(exc, RequestError):
        return ApiError(400, str(exc))
    return ApiError(503, str(exc), "server_error", code="unavailable",
                    retry_after=RETRY_UNAVAILABLE_S)


def failed(err: Error) -> ApiError:
    """A request that ended in an Error, as the HTTP answer (by `Error.kind`)."""
    if err.kind == "request":
        return ApiError(400, err.message)
    if err.kind == "busy":
        return ApiError(429, err.message, "rate_limit_error", code="server_busy",
                        retry_after=RETRY_BUSY_S)
    if err.kind == "unavailable":
        return ApiError(503, err.message, "server_error", code="unavailable",
                        retry_after=RETRY_UNAVAILABLE_S)
    return ApiError(500, err.message, "server_error")


class Relay:
    """One request's replies, from the supervisor's thread into this event loop, and its
    end: a client that disconnects (or a response that is abandoned) cancels it."""

    def __init__(self, bridge: Bridge, call: Call, receive: Callable[[], Any]) -> None:
        self.bridge, self.call = bridge, call
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.ended = False
        self.watcher = asyncio.ensure_future(self._watch(receive))

    def sink(self, item: Message | MemspecError) -> None:  # the supervisor's thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the loop has closed: the HTTP server stopped first

    async def _watch(self, receive: Callable[[], Any]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.abandon()
        self.queue.put_nowait(GONE)

    def start(self) -> None:
        self.bridge.submit(self.call.submit, self.sink)

    async def next(self) -> Any:
        """The next reply that matters: Tokens, Done, Error, a refusal, or GONE."""
        while True:
            item = await self.queue.get()
            if isinstance(item, (Done, Error)):
                self.ended = True
            if isinstance(item, (Tokens, Done, Error, MemspecError)) or item is GONE:
                return item

    def abandon(self) -> None:
        """Cancel the request unless it ended (idempotent)."""
        if not self.ended:
            self.ended = True
            self.bridge.cancel(self.call.id, "the HTTP client went away")

    def close(self) -> None:
        self.watcher.cancel()
        self.abandon()


def _sse(event: Any) -> bytes:
    return b"data: " + msgspec.json.encode(event) + b"\n\n"


async def _stream(relay: Relay, first: Any) -> AsyncIterator[bytes]:
    call = relay.call
    try:
        if call.chat:
            yield _sse(chunk(call, text="", first=True))
        item = first
        sent = 0  # characters streamed (the completions API's `text_offset`)
        # with tools the reply is held to its end: a call's text must not stream as content
        held = reads_calls(call.submit.tools, call.submit.tool_choice)
        logprobs: list = []
        while True:
            if isinstance(item, Tokens) and held:
                logprobs += item.logprobs
            elif isinstance(item, Tokens):
                if item.text or item.logprobs:
                    yield _sse(chunk(call, text=item.text, logprobs=item.logprobs,
                                     offset=sent))
                    sent += len(item.text)
            elif isinstance(item, Done):
                if held and (item.text or item.tool_calls or logprobs):
                    yield _sse(chunk(call, text=item.text or None, logprobs=logprobs,
                                     calls=item if item.tool_calls else None))
                yield _sse(chunk(call, done=item))
                if call.include_usage:
                    yield _sse(usage_chunk(call, item))
                yield b"data: [DONE]\n\n"
                return
            elif isinstance(item, (Error, MemspecError)):
                exc = failed(item) if isinstance(item, Error) else refused(item)
                yield _sse(exc.body())
                return
            else:  # GONE
                return
            item = await relay.next()
    finally:
        relay.close()


class App:
    """The routes, over a bridge to the supervisor."""

    def __init__(self, bridge: Bridge, model: str, drafts: list[str],
                 api_key: str | None = None, info: dict[str, Any] | None = None) -> None:
        self.bridge, self.model, self.drafts = bridge, model, drafts
        self.api_key = api_key.encode() if api_key else None
        self.info = info or {}
        self.created = int(time.time())
        self._ignored: set[str] = set()  # OpenAI fields already logged as ignored

    def starlette(self) -> Starlette:
        routes = [Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self.one_model, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.metrics, methods=["GET"])]
        return Starlette(routes=routes, exception_handlers={
            ApiError: lambda req, exc: _error(exc),
            HTTPException: lambda req, exc: _error(ApiError(
                exc.status_code, f"{req.method} {req.url.path}: {exc.detail}",
                code="not_found" if exc.status_code == 404 else None)),
            Exception: lambda req, exc: _error(ApiError(
                500, f"internal error ({type(exc).__name__})", "server_error")),
        })

    # ---- checks ------------------------------------------------------------------------
    def _auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 self.api_key):
            raise ApiError(401, "missing or wrong API key; send `Authorization: Bearer KEY`",
                           "authentication_error", code="invalid_api_key")

    @staticmethod
    async def _body(request: Request) -> bytes:
        size = request.headers.get("content-length", "")
        too_big = ApiError(413, f"request body over {MAX_BODY_BYTES} bytes; send a shorter "
                                "prompt", code="body_too_large")
        if size.isdigit() and int(size) > DRAIN_BYTES:
            raise too_big
        parts, n = [], 0
        async for part in request.stream():
            n += len(part)
            if n > DRAIN_BYTES:
                break
            if n <= MAX_BODY_BYTES:
                parts.append(part)
        if n > MAX_BODY_BYTES:
            raise too_big
        return b"".join(parts)

    def _model(self, name: str) -> None:
        if name != self.model:
            raise ApiError(404, f"the model `{name}` does not exist; this server serves "
                                f"`{self.model}`", param="model", code="model_not_found")

    # ---- routes ------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, parse_chat)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion)

    async def _generate(self, request: Request, parse: Callable[[bytes], Call]) -> Response:
        self._auth(request)
        call = parse(await self._body(request))
        self._model(call.model)
        for name in call.ignored:
            if name not in self._ignored:  # one line per field, not per request
                self._ignored.add(name)
                LOG.warning(f"ignoring the OpenAI field `{name}` (it changes nothing memspec "
                            "does); said once")
        health = self.bridge.health
        if not health.ready:
            raise ApiError(503, f"the server is {health.status} ({_states(health.states)}); "
                                "retry shortly", "server_error", code="unavailable",
                           retry_after=RETRY_UNAVAILABLE_S)
        relay = Relay(self.bridge, call, request.receive)
        try:
            relay.start()
        except MemspecError as exc:  # the bridge closed: stopping
            relay.close()
            raise refused(exc) from None
        streaming = False
        try:
            item = await relay.next()
            if _gone(item):
                return Response(status_code=499)  # nobody reads it
            if call.stream:
                streaming = True
                return StreamingResponse(_stream(relay, item), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache",
                                                  "X-Accel-Buffering": "no"})
            while not isinstance(item, Done):
                item = await relay.next()
                if _gone(item):
                    return Response(status_code=499)
            return _json(response(call, item))
        finally:
            if not streaming:
                relay.close()

    async def models(self, request: Request) -> Response:
        self._auth(request)
        return _json({"object": "list", "data": [self._model_card()]})

    async def one_model(self, request: Request) -> Response:
        self._auth(request)
        self._model(request.path_params["model"])
        return _json(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model, "object": "model", "created": self.created,
                "owned_by": "memspec", "memspec": {"drafts": self.drafts, **self.info}}

    async def health(self, request: Request) -> Response:
        h = self.bridge.health
        body: dict[str, Any] = {"status": h.status, "procs": h.states}
        if h.crash_loop:  # a process that keeps crashing: how often, and when it is retried
            body["crash_loop"] = {n: {"crashes": c, "backoff_s": round(b, 1)}
                                  for n, (c, b) in h.crash_loop.items()}
        retry = max([RETRY_UNAVAILABLE_S, *(math.ceil(b) for _, b in h.crash_loop.values())])
        return _json(body, 200 if h.ready else 503,
                     None if h.ready else {"Retry-After": str(retry)})

    async def metrics(self, request: Request) -> Response:
        try:
            st = await asyncio.wrap_future(self.bridge.ask(lambda sup: sup.status()))
        except MemspecError as exc:
            raise refused(exc) from None
        return Response(prometheus.render(st, self.drafts), media_type=prometheus.CONTENT_TYPE)


def _gone(item: Any) -> bool:
    """True when the client has gone; a refusal or an Error raises its HTTP answer."""
    if isinstance(item, MemspecError):
        raise refused(item)
    if isinstance(item, Error):
        raise failed(item)
    return item is GONE


def _states(states: dict[str, str]) -> str:
    return ", ".join(f"{n} {s}" for n, s in states.items()) or "no processes yet"


class HttpServer:
    """uvicorn in a thread of this process, on a socket bound at construction."""

    def __init__(self, app: App, address: str) -> None:
        self.app = app
        self.host, self.port = parse_address(address)
        self.sock = bind(self.host, self.port)
        self.port = self.sock.getsockname()[1]
        try:
            import uvloop  # noqa: F401

            loop = "uvloop"
        except ImportError:
            loop = "asyncio"
        config = uvicorn.Config(app.starlette(), loop=loop, http="auto", lifespan="off",
                                access_log=False, log_config=None, log_level="warning",
                                server_header=False, timeout_graceful_shutdown=1,
                                limit_concurrency=MAX_CONNECTIONS, timeout_keep_alive=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, name="memspec-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException as exc:  # noqa: BLE001 - the server thread must not die silently
            os.write(2, f"memspec: error: the HTTP server stopped ({exc})\n".encode())

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 1.5) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout)
        self.sock.close()
