"""The limits of a request, stated once.

Every front door checks a request with :func:`check_request` before it is queued: the
supervisor (so the ZeroMQ client socket, stdin and `memspec generate`), the HTTP server
(`launch/openai_api.py`, before its body becomes a Submit is queued) and the Python API
(before anything is sent); the decoder checks again. So they cannot drift apart, and a
value out of bounds is one `LimitError` naming the field, the limit and the fix, which the
server answers with a small `Error` (kind "request") without doing any work on it.

Nothing is cut silently except the predictor's text, by design: the predictor reads at
most the first RANK_HEAD_CHARS and the last RANK_TAIL_CHARS characters of the prompt
(`rank_text`, the same cut its encoder makes) and the last `T` recent token ids.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from memspec.common.config import POLICIES, check_sampling
from memspec.common.errors import RequestError
from memspec.common.toolcalls import CHOICES, FUNCTION

if TYPE_CHECKING:
    from memspec.common.messages import ChatTurn, Submit

MAX_REQ_ID_CHARS = 128
REQ_ID_ALPHABET = "A-Z a-z 0-9 . _ : -"
_REQ_ID = re.compile(r"[A-Za-z0-9._:\-]+")
CHAT_ROLES = ("system", "user", "assistant")
TOOL_ROLE = "tool"  # accepted here; the decoder refuses it unless the target's template renders it
MAX_MESSAGES = 1024  # chat turns per request
MAX_PROMPT_CHARS = 1 << 18  # the prompt, or all turns' contents together (262,144)
MAX_STOPS = 4  # as the OpenAI API
MAX_STOP_CHARS = 256
MAX_NEW_TOKENS = 1 << 20  # the target's context bounds it further (checked by the engine)
MAX_THREADS = 1024  # decoder threads a request may ask for (the cores bound them further)
MAX_SCHEMA_CHARS = 1 << 16  # a response format's JSON Schema, as JSON text
MAX_TOOLS_CHARS = 1 << 17  # the tools a request offers, as JSON text
MAX_TOP_LOGPROBS = 20  # as the OpenAI API
RESPONSE_FORMATS = ("", "json_object", "json_schema")
# The text the predictor ranks from: it reads the head and the tail of the prompt (what its
# encoder's 256 word pieces can hold, at 16 characters a piece), joined by one space.
RANK_TEXT_CHARS = 4096
RANK_HEAD_CHARS = 3072
RANK_TAIL_CHARS = RANK_TEXT_CHARS - RANK_HEAD_CHARS
# Submit.prompt when `messages` is given is only the predictor's text: room for rank_text's
# output (4097 characters) with margin; "" lets the server take it from the chat.
MAX_RANK_CHARS = 8192
SHOWN_CHARS = 40  # of a bad value quoted in an error: no error reply echoes a large field


class LimitError(RequestError):
    """A request field outside its limit; `field` names it as the Submit does
    (`req_id`, `messages[3].role`, `stop[1]`, ...)."""

    def __init__(self, field: str, problem: str, fix: str) -> None:
        super().__init__(problem, fix)
        self.field = field


def shown(value: object) -> str:
    """`value` as an error message quotes it: repr, cut to SHOWN_CHARS."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def valid_req_id(req_id: object) -> bool:
    return (isinstance(req_id, str) and 0 < len(req_id) <= MAX_REQ_ID_CHARS
            and _REQ_ID.fullmatch(req_id) is not None)


def echo_id(req_id: str) -> str:
    """The id an error reply may carry: the request's own when it is valid, else "" (a
    client takes an Error with an empty id as its answer), never a large field."""
    return req_id if valid_req_id(req_id) else ""


def check_req_id(req_id: str) -> None:
    fix = f"send an id of 1 to {MAX_REQ_ID_CHARS} characters from {REQ_ID_ALPHABET}"
    if not req_id:
        raise LimitError("req_id", "req_id is empty", fix)
    if len(req_id) > MAX_REQ_ID_CHARS:
        raise LimitError("req_id", f"req_id of {len(req_id)} characters is over the limit of "
                                   f"{MAX_REQ_ID_CHARS}", fix)
    if _REQ_ID.fullmatch(req_id) is None:
        bad = next(c for c in req_id if _REQ_ID.fullmatch(c) is None)
        raise LimitError("req_id", f"req_id {shown(req_id)} holds {shown(bad)}, outside "
                                   f"{REQ_ID_ALPHABET}", fix)


def check_roles(turns: Sequence[ChatTurn]) -> None:
    for i, t in enumerate(turns):
        if t.role not in CHAT_ROLES and t.role != TOOL_ROLE:
            raise LimitError(f"messages[{i}].role", f"messages[{i}].role {shown(t.role)} is "
                                                    "not a chat role",
                             f"use {', '.join(CHAT_ROLES)} (or {TOOL_ROLE} where the "
                             "target's chat template renders it)")


def check_sizes(req: Submit) -> None:
    """Prompt and chat sizes, before any text is tokenised."""
    if len(req.messages) > MAX_MESSAGES:
        raise LimitError("messages", f"{len(req.messages)} chat messages are over the limit "
                                     f"of {MAX_MESSAGES}", "send a shorter chat")
    if req.messages:
        total = sum(len(t.content) for t in req.messages)
        if total > MAX_PROMPT_CHARS:
            raise LimitError("messages", f"messages hold {total} characters together, over "
                                         f"the limit of {MAX_PROMPT_CHARS}",
                             "send a shorter chat")
        if len(req.prompt) > MAX_RANK_CHARS:
            raise LimitError("prompt", f"prompt of {len(req.prompt)} characters beside "
                                       f"messages is over the limit of {MAX_RANK_CHARS} (it is "
                                       "only the text the predictor ranks from)",
                             "send rank_text(chat_text(messages)) or \"\" (the server "
                             "derives it from the chat)")
    elif not req.prompt:
        raise LimitError("prompt", "empty prompt", "send some text")
    elif len(req.prompt) > MAX_PROMPT_CHARS:
        raise LimitError("prompt", f"prompt of {len(req.prompt)} characters is over the limit "
                                   f"of {MAX_PROMPT_CHARS}", "send a shorter prompt")


def check_stops(stops: Sequence[str]) -> None:
    if len(stops) > MAX_STOPS:
        raise LimitError("stop", f"{len(stops)} stop strings are over the limit of "
                                 f"{MAX_STOPS}", f"send at most {MAX_STOPS}")
    for i, s in enumerate(stops):
        if not s or len(s) > MAX_STOP_CHARS:
            raise LimitError(f"stop[{i}]", f"stop[{i}] has {len(s)} characters, outside 1 to "
                                           f"{MAX_STOP_CHARS}",
                             f"send stop strings of 1 to {MAX_STOP_CHARS} characters")


def check_request(req: Submit) -> None:
    """Every field of a request, cheapest first, before it is queued or tokenised: id,
    policy, length, sizes, roles, sampling, stop strings, gate, ucb_c, rank_horizon,
    threads."""
    check_req_id(req.req_id)
    if req.policy and req.policy not in POLICIES:
        raise LimitError("policy", f"unknown policy {shown(req.policy)}",
                         f"use one of: {', '.join(POLICIES)}")
    if req.max_new_tokens < 0:
        raise LimitError("max_new_tokens", f"max_new_tokens {req.max_new_tokens} is negative",
                         "ask for at least 1 token (0: the pool's default)")
    if req.max_new_tokens > MAX_NEW_TOKENS:
        raise LimitError("max_new_tokens", f"max_new_tokens {req.max_new_tokens} is over the "
                                           f"limit of {MAX_NEW_TOKENS}",
                         "ask for fewer tokens (the target's context bounds them too)")
    check_sizes(req)
    check_roles(req.messages)
    check_sampling(req.temperature, req.top_p, req.seed, req.top_k, req.min_p)
    check_stops(req.stop)
    check_resume(req)
    check_gate(req)
    if req.ucb_c is not None:
        if not math.isfinite(req.ucb_c):
            raise LimitError("ucb_c", f"ucb_c = {req.ucb_c!r} is not a finite number",
                             "give ucb_c a number")
        if req.ucb_c < 0:
            raise LimitError("ucb_c", f"ucb_c {req.ucb_c} is negative",
                             "use 0 or more (default 2.0)")
    if req.rank_horizon is not None and req.rank_horizon < 0:
        raise LimitError("rank_horizon", f"rank_horizon {req.rank_horizon} is negative",
                         "use 0 or more tokens (None: the pool's)")
    if req.threads is not None and not 1 <= req.threads <= MAX_THREADS:
        raise LimitError("threads", f"threads {req.threads} is outside 1 to {MAX_THREADS}",
                         "ask for 1 or more decoder threads (None: every core)")
    check_output_options(req)


def check_turn_calls(text: str, role: str, i: int) -> None:
    """An earlier assistant turn's calls: JSON text of a list, on an assistant turn."""
    field = f"messages[{i}].tool_calls"
    if role != "assistant":
        raise LimitError(field, f"{field} on a {shown(role)} turn", "only an assistant calls tools")
    try:
        calls = json.loads(text)
    except ValueError:
        calls = None
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise LimitError(field, f"{field} is not a list of calls", "send OpenAI's tool_calls")


def check_output_options(req: Submit) -> None:
    """The response format and log-probabilities a request asks for."""
    if req.response_format not in RESPONSE_FORMATS:
        raise LimitError("response_format", f"unknown response format "
                                            f"{shown(req.response_format)}",
                         "use json_object, json_schema or \"\" (free text)")
    if (req.response_format == "json_schema") != bool(req.json_schema):
        raise LimitError("json_schema", "a json_schema response format needs a schema, and "
                                        "only it takes one",
                         "send the JSON Schema with response_format json_schema")
    if len(req.json_schema) > MAX_SCHEMA_CHARS:
        raise LimitError("json_schema", f"JSON Schema of {len(req.json_schema)} characters is "
                                        f"over the limit of {MAX_SCHEMA_CHARS}",
                         "send a smaller schema")
    if len(req.tools) > MAX_TOOLS_CHARS:
        raise LimitError("tools", f"tools of {len(req.tools)} characters are over the limit "
                                  f"of {MAX_TOOLS_CHARS}", "offer fewer or smaller tools")
    if req.tool_choice and not req.tools:
        raise LimitError("tool_choice", "tool_choice without tools", "send tools, or omit it")
    if req.tool_choice not in ("", *CHOICES) and not req.tool_choice.startswith(FUNCTION):
        raise LimitError("tool_choice", f"unknown tool_choice {shown(req.tool_choice)}",
                         "use auto, none, required or a function's name")
    for i, t in enumerate(req.messages):
        if t.tool_calls:
            check_turn_calls(t.tool_calls, t.role, i)
    if req.tools and req.response_format:
        raise LimitError("response_format", "tools and a response format together",
                         "send one of them")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise LimitError("logprobs", f"top logprobs {req.logprobs} is outside 0 to "
                                     f"{MAX_TOP_LOGPROBS}", "ask for 0 to 20 alternatives")


def check_gate(req: Submit) -> None:
    """`Submit.gate` as the codec checks it on the wire, for a Submit that never crossed
    one (the Python API's local runtime, an in-process `Supervisor.submit`)."""
    if req.gate is not None and not isinstance(req.gate, bool):
        raise LimitError("gate", f"gate {shown(req.gate)} is not True, False or None",
                         "pass gate=True or False (None: the pool's spec_gate)")


def check_resume(req: Submit) -> None:
    """A continuation's fields (set by the supervisor after a decoder crash) in range; the
    decoder checks the ids against the target's vocabulary and the request's budget."""
    if len(req.resume_ids) > MAX_NEW_TOKENS:
        raise LimitError("resume_ids", f"resume_ids holds {len(req.resume_ids)} tokens, over "
                                       f"the limit of {MAX_NEW_TOKENS}", "send fewer")
    if any(t < 0 for t in req.resume_ids) or req.resume_chars < 0:
        raise LimitError("resume_ids", "resume_ids or resume_chars is negative",
                         "send token ids and a character count >= 0")


def check_fresh(req: Submit) -> None:
    """What a client sends: a new request. Only the supervisor resumes one (a decoder
    crash), so a client's `resume_ids` would only pass a forged history off as the model's."""
    if req.resume_ids or req.resume_chars:
        raise LimitError("resume_ids", "resume_ids and resume_chars are set by the server "
                                       "only (to resume a request after a decoder crash)",
                         "leave them out")


def rank_text(text: str) -> str:
    """What the predictor reads of `text`: all of it up to RANK_TEXT_CHARS, else its first
    RANK_HEAD_CHARS and last RANK_TAIL_CHARS joined by a space (the encoder's own cut, so
    cutting here first changes no ranking; cutting twice changes nothing)."""
    if len(text) <= RANK_TEXT_CHARS:
        return text
    return text[:RANK_HEAD_CHARS] + " " + text[len(text) - RANK_TAIL_CHARS:]


def recent_window(ids: Sequence[int], T: int) -> list[int]:
    """The recent token ids the predictor reads: the last `T` (none for T = 0)."""
    return list(ids[-T:]) if T > 0 else []
