"""memspec from Python: `from memspec import Runtime`.

    with Runtime() as rt:                      # starts decoder, loader and predictor
        print(rt.generate("What is 2+2?").text)
        for piece in rt.stream("Write a haiku about the sea."):
            print(piece, end="", flush=True)

`Runtime()` runs its own supervisor in a background thread of this process (the thread
that ticks it is the only one that touches it; calls from any thread go through
`launch/bridge.py`, as the HTTP server's do). `Runtime("ipc:///path.sock")` or
`Runtime("tcp://127.0.0.1:5555")` connects to a running `memspec up` instead, over its
ZeroMQ endpoint. Either way a prompt is a string (one user turn, as `memspec generate`) or
a chat (a list of {"role", "content"} dicts rendered by the target's template), options
are `max_new_tokens`, `policy`, `temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`,
`json_schema` (a dict, or True for any JSON object: the output follows it), `logprobs`
(each token's log-probability and this many alternatives, in `Result.logprobs`), `tools`
and `tool_choice` (OpenAI's tool list; "auto", "none", "required" or a tool's name: the
calls in `Result.tool_calls`, where the target's template takes tools) and `gate`
(the speculation gate on or off for this request; None: the pool's), with
`threads`, `trace` and `ucb_c` for measurements (the benchmarks run through this API), and
an error is a `MemspecError` with a one-line message. Leaving a `stream` early cancels its request.
"""

from __future__ import annotations

import atexit
import json
import queue
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from memspec.common.errors import MemspecError, RequestError
from memspec.common.limits import check_request, rank_text
from memspec.common.messages import (
    ChatTurn,
    Done,
    Error,
    Message,
    Status,
    Submit,
    TokenLogprob,
    Tokens,
    ToolCall,
    chat_text,
)
from memspec.common.metrics import Summary
from memspec.common.toolcalls import submit_choice
from memspec.launch.bridge import Bridge, serve_forever
from memspec.launch.client import Connection, Timeouts
from memspec.launch.supervisor import MAX_QUEUE, START_TIMEOUT_S, ServerBusy, Supervisor

Prompt = str | list[dict[str, str]]
POLL_S = 0.25  # how often a waiting caller checks that the runtime is still running


@dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end of sequence or a stop string) | "length"
    stats: Summary  # as `memspec generate --json` prints it (`as_json(stats)` for a dict)
    logprobs: list[TokenLogprob] | None = None  # one per token, where asked for
    tool_calls: list[ToolCall] | None = None  # with tools: the calls the reply made

    @classmethod
    def of(cls, done: Done) -> Result:
        return cls(done.text, done.token_ids, done.finish_reason, done.stats,
                   done.logprobs or None, done.tool_calls or None)

    @property
    def policy(self) -> str:
        return self.stats.policy


def _submit(prompt: Prompt, *, max_new_tokens: int = 0, policy: str = "",
            temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
            stop: str | list[str] | None = None, top_k: int = 0, min_p: float = 0.0,
            gate: bool | None = None, threads: int | None = None,
            trace: bool = False, ucb_c: float | None = None,
            json_schema: dict[str, Any] | str | bool | None = None,
            logprobs: int | None = None, tools: list[dict[str, Any]] | None = None,
            tool_choice: str | None = None) -> Submit:
    """The request, checked here against the limits every front door shares
    (common/limits.py): a bad one raises before anything is sent, local or remote."""
    if isinstance(prompt, str):
        text, turns = prompt, []
    elif isinstance(prompt, list):
        turns = []
        for i, m in enumerate(prompt):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str):
                raise RequestError(f"chat message {i} is not a {{'role': str, 'content': str}} "
                                   "dict", "pass a string or such dicts")
            calls = m.get("tool_calls") or ""  # (an assistant turn's earlier calls)
            turns.append(ChatTurn(role=m["role"], content=m["content"], tool_calls=calls
                                  if isinstance(calls, str) else json.dumps(calls)))
        if not turns:
            raise RequestError("empty chat", "pass at least one message")
        text = rank_text(chat_text(turns))  # what the predictor reads of the chat
    else:
        raise RequestError(f"a prompt of type {type(prompt).__name__}",
                           "pass a string or a list of {'role', 'content'} dicts")
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        raise RequestError("stop holds a value that is not a string", "pass strings")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise RequestError(f"max_new_tokens {max_new_tokens!r} is not an integer",
                           "pass a number of tokens (0: the pool's default)")
    if not isinstance(policy, str):
        raise RequestError(f"policy {policy!r} is not a string", "pass a policy's name")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    fmt, schema = response_format(json_schema)
    req = Submit(req_id=secrets.token_hex(8), prompt=text, max_new_tokens=max_new_tokens,
                 policy=policy, temperature=temperature, top_p=top_p, seed=seed,
                 messages=turns, stop=stops, top_k=top_k, min_p=min_p, gate=gate,
                 threads=threads, trace=bool(trace), ucb_c=ucb_c,
                 response_format=fmt, json_schema=schema, logprobs=logprobs,
                 tools=json.dumps(tools) if tools else "",
                 tool_choice=submit_choice(tool_choice))
    check_request(req)
    return req


def response_format(json_schema: dict[str, Any] | str | bool | None) -> tuple[str, str]:
    """Submit's (response_format, json_schema) for a schema given as a dict or JSON text,
    True (any JSON object) or None / False (free text)."""
    if json_schema is None or json_schema is False:
        return "", ""
    if json_schema is True:
        return "json_object", ""
    if isinstance(json_schema, dict):
        return "json_schema", json.dumps(json_schema)
    if isinstance(json_schema, str):
        return "json_schema", json_schema
    raise RequestError(f"json_schema of type {type(json_schema).__name__}",
                       "pass a dict, JSON text, or True for any JSON object")


def _raise(err: Error) -> None:
    kinds = {"busy": ServerBusy, "request": RequestError}
    raise kinds.get(err.kind, MemspecError)(f"request failed: {err.message}")


class Stream:
    """The text of one request as it decodes; `result` once it has ended. Closing it (or
    leaving a `for` loop over it early) cancels the request."""

    def __init__(self, replies: Iterator[Message], cancel: Any) -> None:
        self._replies, self._cancel = replies, cancel
        self.result: Result | None = None

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> str:
        if self.result is not None:
            raise StopIteration
        for msg in self._replies:
            if isinstance(msg, Tokens) and msg.text:
                return msg.text
            if isinstance(msg, Done):
                self.result = Result.of(msg)
                raise StopIteration
            if isinstance(msg, Error):
                self.result = None
                self._cancel = None
                _raise(msg)
        raise StopIteration

    def close(self) -> None:
        if self.result is None and self._cancel is not None:
            self._cancel()
            self._cancel = None

    def __del__(self) -> None:
        self.close()


class _Local:
    """A supervisor in a thread of this process."""

    def __init__(self, pool: str | None, cold_start: bool, max_queue: int,
                 start_timeout: float, standby: bool | str) -> None:
        self.bridge = Bridge()
        self.stopping = threading.Event()
        self.started = threading.Event()
        self.error: BaseException | None = None
        self.args = (pool, cold_start, max_queue, start_timeout, standby)
        self.thread = threading.Thread(target=self._run, name="memspec-supervisor",
                                       daemon=True)

    def _run(self) -> None:
        pool, cold_start, max_queue, start_timeout, standby = self.args
        sup = None
        try:
            sup = Supervisor(pool, cold_start=cold_start, max_queue=max_queue, standby=standby)

            def starting() -> bool:
                self.bridge.pump(sup)
                return self.stopping.is_set()

            if sup.start(start_timeout, stop=starting):
                self.started.set()
                serve_forever(sup, self.bridge, self.stopping.is_set)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            self.error = exc
        finally:
            if sup is not None:
                sup.shutdown()
            self.bridge.close(sup)
            self.started.set()

    def start(self) -> None:
        self.thread.start()
        while not self.started.wait(POLL_S):
            pass
        if self.error is not None:
            raise self.error
        if not self.thread.is_alive():
            raise MemspecError("the runtime stopped while starting")

    def replies(self, req: Submit) -> Iterator[Message]:
        got: queue.Queue[Message | MemspecError] = queue.Queue()
        self.bridge.submit(req, got.put)
        ended = False
        try:
            while True:
                try:
                    item = got.get(timeout=POLL_S)
                except queue.Empty:
                    if not self.thread.is_alive():
                        raise MemspecError("the runtime stopped during the request",
                                           "start a new Runtime") from None
                    continue
                if isinstance(item, MemspecError):
                    ended = True
                    raise item
                ended = isinstance(item, (Done, Error))
                yield item
                if ended:
                    return
        finally:
            if not ended:  # the caller left (an exception, Ctrl-C, a closed stream)
                self.bridge.cancel(req.req_id, "the caller stopped reading")

    def cancel(self, req_id: str) -> None:
        self.bridge.cancel(req_id)

    def status(self) -> Status:
        return self.bridge.ask(lambda sup: sup.status()).result(timeout=30)

    def close(self) -> None:
        self.stopping.set()
        self.thread.join()


class _Remote:
    """A running `memspec up`, over its ZeroMQ endpoint."""

    def __init__(self, endpoint: str, timeouts: Timeouts) -> None:
        self.endpoint, self.timeouts = endpoint, timeouts

    def start(self) -> None:
        self.status()  # fails at once, in one line, when nothing serves the endpoint

    def replies(self, req: Submit) -> Iterator[Message]:
        conn = Connection(self.endpoint, self.timeouts)
        try:  # closing the connection early makes the server cancel the request
            for msg in conn.replies(req):
                if isinstance(msg, (Tokens, Done, Error)) and msg.req_id in (req.req_id, ""):
                    yield msg
                    if isinstance(msg, (Done, Error)):
                        return
        finally:
            conn.close()

    def status(self) -> Status:
        from memspec.launch.client import status

        return status(self.endpoint, self.timeouts)

    def close(self) -> None:
        pass


class Runtime:
    """memspec's three processes, started here or reached at `endpoint`. Started here:
    `pool` (None: the default), `cold_start` (drafts' slots emptied before each request,
    as the paper measures), `standby` (a prepared spare decoder kept while idle, so a
    crashed decoder is replaced in a fraction of a cold start: True always, False never,
    "auto" only where the decoder's cold start took over RESTART_BUDGET_S)."""

    def __init__(self, endpoint: str | None = None, *, pool: str | None = None,
                 cold_start: bool = False, max_queue: int = MAX_QUEUE,
                 start_timeout: float = START_TIMEOUT_S, standby: bool | str = "auto",
                 timeouts: Timeouts | None = None) -> None:
        if endpoint is not None and pool is not None:
            raise MemspecError("a Runtime takes an endpoint or a pool, not both",
                               "the server at the endpoint has its own pool")
        self._backend: _Local | _Remote = (_Remote(endpoint, timeouts or Timeouts()) if endpoint
                                           else _Local(pool, cold_start, max_queue,
                                                       start_timeout, standby))
        self._open = False

    def __enter__(self) -> Runtime:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Runtime:
        """Start the processes (a few seconds) or check the endpoint; idempotent."""
        if not self._open:
            self._backend.start()
            self._open = True
            atexit.register(self.close)
        return self

    def close(self) -> None:
        """Stop the processes this Runtime started (a remote server keeps running)."""
        if self._open:
            self._open = False
            atexit.unregister(self.close)
            self._backend.close()

    def _replies(self, prompt: Prompt, opts: dict[str, Any]) -> tuple[Submit, Iterator[Message]]:
        if not self._open:
            raise MemspecError("the Runtime is not started", "use `with Runtime() as rt:`")
        req = _submit(prompt, **opts)
        return req, self._backend.replies(req)

    def generate(self, prompt: Prompt, **opts: Any) -> Result:
        """Decode `prompt` to the end; options: max_new_tokens, policy, temperature, top_p,
        top_k, min_p, seed, stop (a string or a list), gate (True / False: the speculation
        gate on or off for this request, e.g. to compare a policy with and without it;
        None: the pool's spec_gate), threads (at most this many decoder threads), trace
        (stats["trace"]: a timeline of iterations, loads and rankings), ucb_c (the mab-*
        policies' exploration constant for this request; None: the pool's)."""
        _, replies = self._replies(prompt, opts)
        for msg in replies:
            if isinstance(msg, Done):
                return Result.of(msg)
            if isinstance(msg, Error):
                _raise(msg)
        raise MemspecError("the request ended without a result")

    def stream(self, prompt: Prompt, **opts: Any) -> Stream:
        """The generated text piece by piece (same options as `generate`); the Stream's
        `result` holds the token ids and stats once it is exhausted."""
        _, replies = self._replies(prompt, opts)
        return Stream(replies, replies.close)  # type: ignore[attr-defined]

    def status(self) -> Status:
        """The processes, the slots and the request totals (`memspec status --json`)."""
        return self._backend.status()
