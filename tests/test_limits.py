"""Every request limit (common/limits.py), just inside and just outside, through each front
door without models: the shared check itself, the ZeroMQ client socket of a supervisor
whose processes never start, the HTTP body parser and the Python API's request builder;
and the predictor bounding its own input. The same limits against a real server (served
inside, refused outside): tests/test_http.py."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import zmq

from memspec.common import limits as L
from memspec.common.errors import RequestError
from memspec.common.messages import (
    CLIENT_REPLIES,
    CLIENT_REQUESTS,
    PROTOCOL_VERSION,
    ChatTurn,
    Error,
    ProtocolError,
    Queued,
    Snapshot,
    Submit,
    encode,
)
from memspec.common.sockets import configure
from memspec.launch.api import _submit as api_submit
from memspec.launch.openai_api import ApiError, parse_chat, parse_completion
from memspec.launch.supervisor import Supervisor
from memspec.procs.decoder.models import check_template_roles
from memspec.procs.predictor import main as predictor_main

SMALL_REPLY = 4096  # bytes: no error reply is larger, whatever the request held
N = L.MAX_PROMPT_CHARS


def _chat(*turns: tuple[str, str]) -> list[ChatTurn]:
    return [ChatTurn(role=r, content=c) for r, c in turns]


# (limit, field the error names, Submit fields just inside, just outside)
CASES = [
    ("req_id length", "req_id", {"req_id": "a" * L.MAX_REQ_ID_CHARS},
     {"req_id": "a" * (L.MAX_REQ_ID_CHARS + 1)}),
    ("req_id alphabet", "req_id", {"req_id": "Az09._:-"}, {"req_id": "a b"}),
    ("req_id empty", "req_id", {"req_id": "x"}, {"req_id": ""}),
    ("roles", "messages[1].role",
     {"prompt": "", "messages": _chat(("system", "s"), ("assistant", "a"), ("user", "u"))},
     {"prompt": "", "messages": _chat(("user", "u"), ("robot", "r"))}),
    ("stop count", "stop", {"stop": ["a"] * L.MAX_STOPS}, {"stop": ["a"] * (L.MAX_STOPS + 1)}),
    ("stop length", "stop[0]", {"stop": ["s" * L.MAX_STOP_CHARS]},
     {"stop": ["s" * (L.MAX_STOP_CHARS + 1)]}),
    ("stop empty", "stop[0]", {"stop": ["x"]}, {"stop": [""]}),
    ("prompt size", "prompt", {"prompt": "p" * N}, {"prompt": "p" * (N + 1)}),
    ("chat size", "messages", {"prompt": "", "messages": _chat(("user", "c" * N))},
     {"prompt": "", "messages": _chat(("user", "c" * (N - 1)), ("user", "cc"))}),
    ("chat turns", "messages", {"prompt": "", "messages": _chat(*[("user", "t")] * L.MAX_MESSAGES)},
     {"prompt": "", "messages": _chat(*[("user", "t")] * (L.MAX_MESSAGES + 1))}),
    ("predictor text beside a chat", "prompt",
     {"prompt": "r" * L.MAX_RANK_CHARS, "messages": _chat(("user", "hi"))},
     {"prompt": "r" * (L.MAX_RANK_CHARS + 1), "messages": _chat(("user", "hi"))}),
    ("max_new_tokens", "max_new_tokens", {"max_new_tokens": L.MAX_NEW_TOKENS},
     {"max_new_tokens": L.MAX_NEW_TOKENS + 1}),
    ("rank_horizon", "rank_horizon", {"rank_horizon": 0}, {"rank_horizon": -1}),
    ("threads", "threads", {"threads": 1}, {"threads": 0}),
    ("threads many", "threads", {"threads": L.MAX_THREADS}, {"threads": L.MAX_THREADS + 1}),
]
IDS = [c[0] for c in CASES]


def _req(fields: dict) -> Submit:
    return Submit(**{"req_id": "r1", "prompt": "hi", **fields})


@pytest.mark.parametrize("name, field, inside, outside", CASES, ids=IDS)
def test_each_limit_just_inside_passes_and_just_outside_names_field_limit_and_fix(
        name, field, inside, outside):
    L.check_request(_req(inside))
    with pytest.raises(L.LimitError) as e:
        L.check_request(_req(outside))
    msg = str(e.value)
    assert e.value.field == field and "\n" not in msg and len(msg) < 400, msg
    assert e.value.fix  # every refusal says what to send instead


def test_a_huge_value_is_never_quoted_whole():
    for req in (_req({"req_id": "a b" * 300_000}), _req({"policy": "p" * 300_000}),
                _req({"messages": _chat(("r" * 300_000, "x"))})):
        with pytest.raises(RequestError) as e:
            L.check_request(req)
        assert len(str(e.value)) < 400
    assert L.echo_id("a" * 129) == "" and L.echo_id("ok-1") == "ok-1"


def test_rank_text_is_the_encoders_own_cut_and_idempotent():
    encoder = pytest.importorskip("memspec.procs.predictor.encoder")
    for n in (10, L.RANK_TEXT_CHARS, L.RANK_TEXT_CHARS + 1, 50_000):
        text = "".join(chr(97 + i % 26) for i in range(n))
        cut = L.rank_text(text)
        assert cut == encoder._trim_chars(text, keep_end=False)
        assert L.rank_text(cut) == cut == encoder._trim_chars(cut, keep_end=False)
        assert len(cut) <= L.RANK_TEXT_CHARS + 1 <= L.MAX_RANK_CHARS
    assert L.recent_window(list(range(100)), 32) == list(range(68, 100))
    assert L.recent_window([1, 2], 0) == []


def test_protocol_error_reasons_stay_small():
    frame = bytes([PROTOCOL_VERSION]) + msgspec.msgpack.encode(["A" * 200_000, "x"])
    with pytest.raises(ProtocolError) as e:
        CLIENT_REQUESTS.decode([frame])
    assert len(str(e.value)) <= 300


# ---- the ZeroMQ client socket --------------------------------------------------------------
@pytest.fixture
def idle_sup(tmp_path, monkeypatch) -> Iterator[Supervisor]:
    """A supervisor whose processes never start: requests queue, nothing is dispatched."""
    (tmp_path / "run").mkdir()
    s = Supervisor(client_endpoint=f"ipc://{tmp_path}/c.sock", run_dir=tmp_path / "run",
                   max_queue=64)
    s._next_keepalive = float("inf")  # only the replies to each request
    yield s
    s.shutdown()


def _ask(sup: Supervisor, dealer: zmq.Socket, frames: list[bytes]) -> bytes:
    dealer.send_multipart(frames)
    for _ in range(500):
        sup.tick(10)
        if dealer.poll(0):
            return dealer.recv_multipart()[0]
    raise AssertionError("no reply")


@pytest.mark.parametrize("name, field, inside, outside", CASES, ids=IDS)
def test_zeromq_front_door_queues_inside_and_answers_outside_with_a_small_error(
        idle_sup, name, field, inside, outside):
    ctx = zmq.Context()
    try:
        dealer = configure(ctx.socket(zmq.DEALER))
        dealer.connect(idle_sup.client_endpoint)
        ok = CLIENT_REPLIES.decode([_ask(idle_sup, dealer, encode(_req(inside)))])
        assert isinstance(ok, Queued), ok
        raw = _ask(idle_sup, dealer, encode(_req({**outside, "req_id": "r2"}
                                                  if field != "req_id" else outside)))
        err = CLIENT_REPLIES.decode([raw])
        assert isinstance(err, Error) and err.kind == "request", err
        assert field.split("[")[0] in err.message and len(raw) < SMALL_REPLY
        assert err.req_id in ("r2", "")  # an id outside the limits is never echoed
        assert idle_sup.totals.requests.get("invalid") == 1
    finally:
        ctx.destroy(linger=0)


def test_a_megabyte_req_id_costs_a_small_reply(idle_sup):
    ctx = zmq.Context()
    try:
        dealer = configure(ctx.socket(zmq.DEALER))
        dealer.connect(idle_sup.client_endpoint)
        raw = _ask(idle_sup, dealer, encode(Submit(req_id="i" * (1 << 20), prompt="hi")))
        err = CLIENT_REPLIES.decode([raw])
        assert isinstance(err, Error) and err.req_id == "" and len(raw) < SMALL_REPLY
        assert not idle_sup.queue
    finally:
        ctx.destroy(linger=0)


# ---- HTTP bodies ---------------------------------------------------------------------------
def _body(**fields) -> bytes:
    return msgspec.json.encode({"model": "m", **fields})


HTTP_CASES = [  # (param, body just inside, body just outside)
    ("messages[1].role", {"messages": [{"role": "developer", "content": "s"},
                                       {"role": "user", "content": "u"}]},
     {"messages": [{"role": "user", "content": "u"}, {"role": "robot", "content": "r"}]}),
    ("stop", {"stop": ["s" * L.MAX_STOP_CHARS] * L.MAX_STOPS},
     {"stop": ["s"] * (L.MAX_STOPS + 1)}),
    ("stop", {"stop": "s" * L.MAX_STOP_CHARS}, {"stop": "s" * (L.MAX_STOP_CHARS + 1)}),
    ("messages", {"messages": [{"role": "user", "content": "c" * N}]},
     {"messages": [{"role": "user", "content": "c" * (N + 1)}]}),
    ("messages", {"messages": [{"role": "user", "content": "t"}] * L.MAX_MESSAGES},
     {"messages": [{"role": "user", "content": "t"}] * (L.MAX_MESSAGES + 1)}),
    ("prompt", {"prompt": "p" * N}, {"prompt": "p" * (N + 1)}),
    ("policy", {"policy": "memspec"}, {"policy": "fastest"}),
]


@pytest.mark.parametrize("param, inside, outside", HTTP_CASES)
def test_http_bodies_inside_parse_and_outside_are_a_400_naming_the_field(param, inside,
                                                                         outside):
    parse = parse_completion if "prompt" in inside else parse_chat
    base = {} if "prompt" in inside or "messages" in inside else {
        "messages": [{"role": "user", "content": "hi"}]}
    call = parse(_body(**base, **inside))
    L.check_request(call.submit)
    if call.chat:  # beside a chat, the prompt is only what the predictor reads
        assert len(call.submit.prompt) <= L.RANK_TEXT_CHARS + 1
    with pytest.raises(ApiError) as e:
        parse(_body(**base, **outside))
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert len(e.value.message) < 400


# ---- the Python API ------------------------------------------------------------------------
API_CASES = [  # (field, kwargs just inside, just outside)
    ("messages[0].role", {"prompt": [{"role": "system", "content": "s"},
                                     {"role": "user", "content": "u"}]},
     {"prompt": [{"role": "robot", "content": "r"}]}),
    ("stop", {"stop": ["a"] * L.MAX_STOPS}, {"stop": ["a"] * (L.MAX_STOPS + 1)}),
    ("stop[0]", {"stop": "s" * L.MAX_STOP_CHARS}, {"stop": "s" * (L.MAX_STOP_CHARS + 1)}),
    ("prompt", {"prompt": "p" * N}, {"prompt": "p" * (N + 1)}),
    ("messages", {"prompt": [{"role": "user", "content": "c" * N}]},
     {"prompt": [{"role": "user", "content": "c" * (N + 1)}]}),
    ("messages", {"prompt": [{"role": "user", "content": "t"}] * L.MAX_MESSAGES},
     {"prompt": [{"role": "user", "content": "t"}] * (L.MAX_MESSAGES + 1)}),
    ("max_new_tokens", {"max_new_tokens": L.MAX_NEW_TOKENS},
     {"max_new_tokens": L.MAX_NEW_TOKENS + 1}),
]


@pytest.mark.parametrize("field, inside, outside", API_CASES)
def test_python_api_builds_inside_and_raises_outside_before_sending(field, inside, outside):
    req = api_submit(**{"prompt": "hi", **inside})
    assert L.valid_req_id(req.req_id) and len(req.prompt) <= L.MAX_PROMPT_CHARS
    with pytest.raises(L.LimitError) as e:
        api_submit(**{"prompt": "hi", **outside})
    assert e.value.field == field and "\n" not in str(e.value)


def test_a_long_chat_sends_the_predictor_only_what_it_reads():
    req = api_submit([{"role": "user", "content": "x" * 100_000}])
    assert req.prompt == L.rank_text("x" * 100_000) and len(req.messages[0].content) == 100_000


# ---- the decoder and the predictor ---------------------------------------------------------
class _Tok:
    def __init__(self, template: str) -> None:
        self.chat_template = template


def test_tool_turns_only_where_the_template_renders_them():
    turns = _chat(("user", "u"), ("tool", "42"))
    with pytest.raises(L.LimitError, match="messages\\[1\\].role 'tool'"):
        check_template_roles(_Tok("{{ message['role'] }}"), turns)
    check_template_roles(_Tok("{% if message['role'] == 'tool' %}{% endif %}"), turns)
    check_template_roles(_Tok(""), _chat(("user", "u")))


class _Ranker:
    names = ["a", "b"]
    T = 32
    vocab_size = 1000

    def __init__(self) -> None:
        self.seen: list[tuple[str, list[int]]] = []

    def bad_ids(self, ids: list[int]) -> bool:
        return any(not 0 <= i < self.vocab_size for i in ids)

    def rank(self, prompts, recents):
        self.seen += list(zip(prompts, recents))
        return [[0.5, 0.5] for _ in prompts], 0.0


def test_the_predictor_bounds_its_input_whatever_the_decoder_sends(monkeypatch):
    sent: list[tuple[object, bytes]] = []
    monkeypatch.setattr(predictor_main, "send",
                        lambda sock, msg, ident=None: sent.append((msg, len(encode(msg)[0]))))
    ranker = _Ranker()
    server = predictor_main.Server(None, None, ranker)  # type: ignore[arg-type]
    huge = "w" * (1 << 20)
    ids = [10**9] * 100_000 + list(range(40))  # out-of-vocabulary ids before the window
    server.answer([(b"p", Snapshot("r1", 1, huge, ids)),
                   (b"q", Snapshot("i" * (1 << 20), 2, "x", []))])
    assert ranker.seen == [(L.rank_text(huge), list(range(8, 40)))]
    kinds = sorted((type(m).__name__, getattr(m, "req_id", None), size) for m, size in sent)
    assert [k[:2] for k in kinds] == [("Error", ""), ("Ranking", "r1")]
    assert all(size < SMALL_REPLY for *_, size in kinds)
