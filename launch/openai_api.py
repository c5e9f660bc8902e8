"""The OpenAI API's request and response bodies, as memspec serves them (pure: no sockets).

Requests decode into typed msgspec structs, so a wrong type, a value out of range or an
unknown field is an `ApiError` (400) naming the field, never a half-read request. The
fields are the OpenAI API's that memspec honours (`max_tokens`, `temperature`, `top_p`,
`seed`, `stop`, `stream`, `stream_options.include_usage`), the sampling extensions other
OpenAI-compatible servers (vLLM) take (`top_k`, `min_p`), `logprobs` / `top_logprobs` (the
target's own distribution at each emitted token) and `response_format` (`json_object`, or
`json_schema`: the output follows the schema, procs/decoder/sched/constraint.py), `tools`
and `tool_choice` (rendered by the target's template, calls read back in the Hermes format:
common/toolcalls.py; `required` and a named function enforced by the same grammar), those
it accepts at their neutral value only (`n` = 1, no penalties: anything else is a 400 that
says so), fields that change nothing memspec does and are ignored (IGNORED:
`metadata`, `store`, `parallel_tool_calls`, ...; the server logs each once), and one
extension, `policy`.
Differences from OpenAI, on purpose:

- `temperature` defaults to 0 (greedy, as `memspec generate`), not 1;
- `max_tokens` defaults to the pool's `max_new_tokens`;
- `/v1/completions` treats `prompt` as one user turn of the chat template, exactly as
  `memspec generate PROMPT` does, so both give the same tokens.

Responses carry a `memspec` object: the policy, the generated token ids and the request's
stats as `memspec generate --json` prints them.
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from memspec.common.errors import RequestError
from memspec.common.limits import (
    MAX_NEW_TOKENS,
    MAX_TOP_LOGPROBS,
    LimitError,
    check_request,
    rank_text,
)
from memspec.common.messages import ChatTurn, Done, Submit, TokenLogprob, chat_text
from memspec.common.metrics import as_json
from memspec.common.toolcalls import submit_choice

MAX_BODY_BYTES = 1 << 20  # a request body over 1 MiB is refused (413)
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name; other roles: common/limits.py
# a Submit field a LimitError names -> the request body's field
PARAMS = {"max_new_tokens": "max_tokens", "json_schema": "response_format",
          "logprobs": "top_logprobs"}
LEGACY_MAX_LOGPROBS = 5  # /v1/completions' `logprobs`, as OpenAI limits it

# OpenAI fields clients and agent frameworks send that change nothing memspec computes (no
# storage, no tools to call in parallel, routing and caching hints): accepted, ignored
IGNORED = ("metadata", "store", "parallel_tool_calls", "service_tier", "prompt_cache_key",
           "safety_identifier", "prediction", "reasoning_effort", "verbosity")

NonNeg = Annotated[float, Meta(ge=0.0)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
MaxTokens = Annotated[int, Meta(ge=1, le=MAX_NEW_TOKENS)]
Seed = Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
TopK = Annotated[int, Meta(ge=-1)]  # -1 or 0: off (vLLM's convention), 1: greedy
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Stop = str | list[str]  # count and lengths: common/limits.py, as for every front door


class ApiError(Exception):
    """An error reply: HTTP status and the OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_
        self.param, self.code, self.retry_after = param, code, retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str = ""


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str = "{}"


class ToolCallIn(msgspec.Struct, forbid_unknown_fields=True):
    function: FunctionCall
    id: str | None = None
    type: str = "function"


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # of a `tool` turn (served where the template renders one)
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's earlier calls
    refusal: str | None = None  # (an assistant turn as OpenAI's client echoes it back)


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    function: FunctionDef


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    function: NamedFunction


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None


class _Common(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    n: int | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's
    logit_bias: dict[str, float] | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    policy: str | None = None  # memspec: which policy schedules the drafts
    metadata: Any = None  # IGNORED, each logged once by the server
    store: Any = None
    parallel_tool_calls: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class ChatRequest(_Common, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | Annotated[list[str], Meta(min_length=1, max_length=1)]
    logprobs: Annotated[int, Meta(ge=0, le=LEGACY_MAX_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None  # (vLLM takes it here too)
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


def _unsupported(field: str, why: str) -> ApiError:
    return ApiError(400, f"`{field}` {why}", param=field, code="unsupported")


def _check_common(r: _Common) -> None:
    if r.n not in (None, 1):
        raise _unsupported("n", f"= {r.n} is not supported: memspec decodes one sequence "
                                "per request (send n = 1, or several requests)")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(r, name) not in (None, 0, 0.0):
            raise _unsupported(name, "is not supported (speculative decoding here is "
                                     "lossless sampling from the target); send 0 or omit it")
    if r.repetition_penalty not in (None, 1, 1.0):
        raise _unsupported("repetition_penalty", "is not supported (speculative decoding "
                                                 "here is lossless sampling from the "
                                                 "target); send 1 or omit it")
    if r.logit_bias:
        raise _unsupported("logit_bias", "is not supported; omit it")
    if r.stream_options is not None and not r.stream:
        raise ApiError(400, "`stream_options` is only allowed with `stream` true",
                       param="stream_options")


def _text(m: ChatMessage, i: int) -> str:
    if m.content is None and m.tool_calls:  # (an assistant turn that only called tools)
        return ""
    if m.content is None:
        raise ApiError(400, f"message {i} has no content", param=f"messages[{i}].content")
    if isinstance(m.content, str):
        return m.content
    if any(p.type != "text" for p in m.content):
        raise _unsupported(f"messages[{i}].content", "may hold only text parts")
    return "".join(p.text for p in m.content)


def _decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON ({exc})") from None


class Call:
    """One validated request: what to submit and how to answer it (`ignored`: the IGNORED
    fields it carried)."""

    def __init__(self, chat: bool, req: ChatRequest | CompletionRequest, submit: Submit) -> None:
        self.chat, self.req, self.submit = chat, req, submit
        self.ignored = [f for f in IGNORED if getattr(req, f) is not None]
        self.model = req.model
        self.stream = bool(req.stream)
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.id = submit.req_id
        self.created = int(time.time())


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _format(rf: ResponseFormat | None) -> tuple[str, str]:
    """Submit's (response_format, json_schema) for the body's `response_format`."""
    if rf is None or rf.type == "text":
        return "", ""
    if rf.type == "json_object":
        return "json_object", ""
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema is None:
            raise ApiError(400, "`response_format` json_schema needs `json_schema.schema`",
                           param="response_format")
        return "json_schema", msgspec.json.encode(rf.json_schema.schema).decode()
    raise _unsupported("response_format", f"type '{rf.type[:40]}' is not one of text, "
                                          "json_object, json_schema")


def _tools(r: ChatRequest) -> tuple[str, str]:
    """Submit's (tools, tool_choice): the tools as JSON text, the choice as
    common/toolcalls.py names it."""
    choice = r.tool_choice
    if not r.tools:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "`tool_choice` needs `tools`", param="tool_choice")
        return "", ""
    if any(t.type != "function" for t in r.tools):
        raise _unsupported("tools", "other than type function are not supported")
    if isinstance(choice, NamedToolChoice):
        name = submit_choice(choice.function.name, named=True)
    elif choice in (None, "auto", "none", "required"):
        name = submit_choice(choice)
    else:
        raise ApiError(400, f"`tool_choice` '{str(choice)[:40]}' is not none, auto, required "
                            "or a named function", param="tool_choice")
    return msgspec.json.encode(r.tools).decode(), name


def _turn(m: ChatMessage, i: int) -> ChatTurn:
    calls = "" if not m.tool_calls else msgspec.json.encode(
        [{"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                                   "arguments": c.function.arguments}}
         for c in m.tool_calls]).decode()
    return ChatTurn(role=ROLE_ALIASES.get(m.role, m.role), content=_text(m, i), tool_calls=calls)


def _submit(prefix: str, r: _Common, prompt: str, max_tokens: int | None,
            messages: list[ChatTurn], rf: ResponseFormat | None = None,
            logprobs: int | None = None, tools: tuple[str, str] = ("", "")) -> Submit:
    """The Submit, checked against the request limits every front door shares (a 400 naming
    the body's field), so a refused body is never queued."""
    fmt, schema = _format(rf)
    sub = Submit(req_id=f"{prefix}-{secrets.token_hex(12)}", prompt=prompt,
                 max_new_tokens=max_tokens or 0, policy=r.policy or "",
                 temperature=0.0 if r.temperature is None else r.temperature,
                 top_p=1.0 if r.top_p is None else r.top_p, seed=r.seed,
                 messages=messages, stop=_stops(r.stop),
                 top_k=max(r.top_k or 0, 0), min_p=r.min_p or 0.0,
                 response_format=fmt, json_schema=schema, logprobs=logprobs,
                 tools=tools[0], tool_choice=tools[1])
    try:
        check_request(sub)
    except LimitError as exc:
        field = exc.field.split("[")[0] if exc.field.startswith("stop") else exc.field
        raise ApiError(400, str(exc), param=PARAMS.get(field, field)) from None
    except RequestError as exc:
        raise ApiError(400, str(exc)) from None
    return sub


def parse_chat(body: bytes) -> Call:
    r: ChatRequest = _decode(body, ChatRequest)
    _check_common(r)
    if r.top_logprobs is not None and not r.logprobs:
        raise ApiError(400, "`top_logprobs` needs `logprobs` true", param="top_logprobs")
    tools = _tools(r)
    turns = [_turn(m, i) for i, m in enumerate(r.messages)]
    prompt = rank_text(chat_text(turns))  # what the predictor reads of the chat
    if r.max_tokens and r.max_completion_tokens and r.max_tokens != r.max_completion_tokens:
        raise ApiError(400, "`max_tokens` and `max_completion_tokens` differ; send one",
                       param="max_completion_tokens")
    return Call(True, r, _submit("chatcmpl", r, prompt,
                                 r.max_completion_tokens or r.max_tokens, turns,
                                 r.response_format,
                                 (r.top_logprobs or 0) if r.logprobs else None, tools))


def parse_completion(body: bytes) -> Call:
    r: CompletionRequest = _decode(body, CompletionRequest)
    _check_common(r)
    if r.echo:
        raise _unsupported("echo", "is not supported; omit it")
    if r.best_of not in (None, 1):
        raise _unsupported("best_of", "is not supported; send 1 or omit it")
    if r.suffix:
        raise _unsupported("suffix", "is not supported; omit it")
    prompt = r.prompt if isinstance(r.prompt, str) else r.prompt[0]
    return Call(False, r, _submit("cmpl", r, prompt, r.max_tokens, [], r.response_format,
                                  r.logprobs))


# ---- responses --------------------------------------------------------------------------
def usage(done: Done) -> dict[str, int]:
    n = len(done.token_ids)
    return {"prompt_tokens": done.stats.prompt_tokens, "completion_tokens": n,
            "total_tokens": done.stats.prompt_tokens + n}


def extension(done: Done) -> dict[str, Any]:
    """The `memspec` object: what `memspec generate --json` prints, less the text."""
    return {"policy": done.stats.policy, "token_ids": done.token_ids,
            "stats": as_json(done.stats)}


def _entry(t: TokenLogprob) -> dict[str, Any]:
    return {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode()),
            "top_logprobs": [{"token": a.token, "logprob": a.logprob,
                              "bytes": list(a.token.encode())} for a in t.top]}


def logprobs_object(call: Call, entries: list[TokenLogprob], offset: int = 0
                    ) -> dict[str, Any] | None:
    """A choice's `logprobs`: the chat API's `content` list, or the completions API's
    parallel lists (`text_offset` counted from `offset`, the characters before them)."""
    if call.submit.logprobs is None:
        return None
    if call.chat:
        return {"content": [_entry(t) for t in entries], "refusal": None}
    offsets = []
    for t in entries:
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": [t.token for t in entries],
            "token_logprobs": [t.logprob for t in entries],
            "top_logprobs": [{a.token: a.logprob for a in t.top} for t in entries],
            "text_offset": offsets}


def response(call: Call, done: Done) -> dict[str, Any]:
    """The whole reply of a non-streamed request."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": done.finish_reason or "stop",
                              "logprobs": logprobs_object(call, done.logprobs)}
    if call.chat:
        choice["message"] = {"role": "assistant", "content": done.text}
        if done.tool_calls:
            choice["message"].update(content=done.text or None,
                                     tool_calls=tool_calls_json(done))
    else:
        choice["text"] = done.text
    return {"id": call.id, "object": "chat.completion" if call.chat else "text_completion",
            "created": call.created, "model": call.model, "choices": [choice],
            "usage": usage(done), "memspec": extension(done)}


def tool_calls_json(done: Done, index: bool = False) -> list[dict[str, Any]]:
    """A reply's calls as OpenAI writes them (`index`: a streamed delta's)."""
    return [{**({"index": i} if index else {}), "id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(done.tool_calls)]


def chunk(call: Call, text: str | None = None, done: Done | None = None,
          first: bool = False, logprobs: list[TokenLogprob] | None = None, offset: int = 0,
          calls: Done | None = None) -> dict[str, Any]:
    """One streamed event: the role (first), a piece of text (with its tokens'
    `logprobs`), a reply's tool calls (`calls`: its Done), or the end (`done`)."""
    lp = logprobs_object(call, logprobs, offset) if logprobs else None
    finish = (done.finish_reason or "stop") if done is not None else None
    if call.chat:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if calls is not None:
            delta["tool_calls"] = tool_calls_json(calls, index=True)
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish,
                                  "logprobs": lp}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": lp}
    out = {"id": call.id, "object": "chat.completion.chunk" if call.chat else "text_completion",
           "created": call.created, "model": call.model, "choices": [choice]}
    if done is not None:
        out["memspec"] = extension(done)
    return out


def usage_chunk(call: Call, done: Done) -> dict[str, Any]:
    """The last event with `stream_options.include_usage`: no choices, the usage."""
    return {"id": call.id, "object": "chat.completion.chunk" if call.chat else "text_completion",
            "created": call.created, "model": call.model, "choices": [],
            "usage": usage(done)}
