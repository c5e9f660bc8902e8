"""Resuming a request after a decoder crash, without processes: the supervisor's side (what
it keeps, the continuation it sends, the poison rule, the crash-loop pause and where they
show) against a fake decoder socket, and the decoder's side (the stream's text state rebuilt
at any cut, stop strings and multi-byte characters included)."""

from __future__ import annotations

import random
import time

import pytest
import zmq
from test_detok import TEXTS, _tokenizer

from memspec.bench.messages import _stats
from memspec.common.errors import RequestError
from memspec.common.messages import (
    DECODER_REQUESTS,
    Done,
    Error,
    Message,
    Submit,
    Tokens,
)
from memspec.common.sockets import configure, make_run_dir, recv, send
from memspec.launch import prometheus
from memspec.launch.bridge import Bridge
from memspec.launch.resume import (
    POISON_CRASHES,
    Progress,
    backoff_s,
    continuation,
    resume_seed,
)
from memspec.launch.supervisor import Supervisor


# ---- the supervisor --------------------------------------------------------------------------
def test_backoff_grows_from_none_to_a_cap():
    pauses = [backoff_s(n) for n in range(1, 12)]
    assert pauses[0] == 0.0 and pauses[1] > 0  # a one-off crash is restarted at once
    assert pauses == sorted(pauses) and max(pauses) == 30.0


def test_a_continuation_carries_what_the_client_has_and_a_seed_of_its_own():
    req = Submit(req_id="r", prompt="hi", max_new_tokens=20, temperature=0.7, seed=5)
    prog = Progress()
    assert continuation(req, prog) is req  # nothing streamed: the request from the start
    prog.relayed(Tokens(req_id="r", ids=[7, 8], text="ab"), 1.0)
    prog.relayed(Tokens(req_id="r", ids=[9], text="é"), 1.1)
    cont = continuation(req, prog)
    assert (cont.resume_ids, cont.resume_chars, cont.max_new_tokens) == ([7, 8, 9], 3, 20)
    assert cont.seed == resume_seed(5, 3) != 5  # never the random numbers already used
    assert resume_seed(5, 3) != resume_seed(5, 4) and resume_seed(6, 3) != resume_seed(5, 3)
    assert continuation(Submit(req_id="g", prompt="hi"), prog).seed is None  # unseeded stays


class FakeDecoder:
    """The decoder's ROUTER for a supervisor whose processes are not started: what it was
    sent, and replies as the decoder would send them."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.ctx = zmq.Context()
        self.sock = configure(self.ctx.socket(zmq.ROUTER))
        self.sock.bind(sup.ep["decoder"])
        self.ident = b""

    def received(self) -> Submit:
        deadline = time.monotonic() + 10
        while not self.sock.poll(10):
            self.sup.tick(1)
            assert time.monotonic() < deadline, "the supervisor sent nothing"
        ident, msg = recv(self.sock, DECODER_REQUESTS, router=True)
        self.ident = ident
        assert isinstance(msg, Submit), msg
        return msg

    def reply(self, msg: Message) -> None:
        send(self.sock, msg, ident=self.ident)
        for _ in range(20):
            self.sup.tick(2)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture
def sup(monkeypatch):
    s = Supervisor(run_dir=make_run_dir())  # a short path: ipc paths are limited
    spawned: list[str] = []

    def spawn(name: str) -> None:  # no processes: a restart is only bookkeeping here
        spawned.append(name)
        s.procs[name].state = "starting"

    monkeypatch.setattr(s, "spawn", spawn)
    s.spawned = spawned
    for p in s.procs.values():
        p.state = "ready"
    fake = FakeDecoder(s)
    yield s, fake
    fake.close()
    s.shutdown()


def _crash(s: Supervisor) -> None:
    s._on_crash(s.procs["decoder"], "exited with code -9")  # noqa: SLF001


def _back(s: Supervisor) -> None:
    """The restarted decoder is ready (as `_on_ready` books it; no process runs here)."""
    p = s.procs["decoder"]
    p.state, p.ready_at = "ready", time.monotonic()
    if p.crashed_at is not None:
        p.recovery_s, p.crashed_at = p.ready_at - p.crashed_at, None


def test_a_decoder_crash_resumes_the_running_request_and_fails_it_at_the_second(sup):
    s, fake = sup
    replies: dict[str, list[Message]] = {"a": [], "b": []}
    s.submit(Submit(req_id="a", prompt="hi", max_new_tokens=8, seed=3, temperature=0.5),
             replies["a"].append)
    s.submit(Submit(req_id="b", prompt="next", max_new_tokens=8), replies["b"].append)
    first = fake.received()
    assert first.req_id == "a" and not first.resume_ids
    fake.reply(Tokens(req_id="a", ids=[11, 12], text="xy"))
    _crash(s)
    assert s.in_flight is None and s.queue[0].req.req_id == "a"  # first in line again
    assert s.procs["decoder"].state == "restarting" and s.spawned == ["decoder"]
    time.sleep(0.05)
    _back(s)
    cont = fake.received()
    assert cont.req_id == "a" and cont.resume_ids == [11, 12] and cont.resume_chars == 2
    assert cont.seed == resume_seed(3, 2)
    fake.reply(Tokens(req_id="a", ids=[13], text="z"))
    _crash(s)  # the second crash in a row while it runs: it may be what kills the decoder
    err = replies["a"][-1]
    assert isinstance(err, Error) and "'a'" in err.message and "2 decoder crashes" in err.message
    assert "\n" not in err.message
    assert s.procs["decoder"].state == "backoff" and s.procs["decoder"].crashes == 2
    st = s.status().procs["decoder"]
    assert st.state == "backoff" and st.crashes == 2 and 0 < st.backoff_s <= backoff_s(2)
    text = prometheus.render(s.status(), [])
    assert 'memspec_process_crashes_in_a_row{proc="decoder"} 2.0' in text
    assert 'memspec_process_backoff_seconds{proc="decoder"} 0.' in text
    assert "memspec_requests_resumed_total 1.0" in text
    bridge = Bridge()
    bridge.pump(s)
    assert bridge.health.status == "restarting" and bridge.health.crash_loop["decoder"][0] == 2
    bridge.close()
    s.procs["decoder"].next_start = 0.0  # the pause is over: started again
    s.tick(1)
    assert s.procs["decoder"].state == "restarting" and s.spawned == ["decoder"] * 2
    _back(s)
    nxt = fake.received()
    assert nxt.req_id == "b" and not nxt.resume_ids  # the others go on
    fake.reply(Done(req_id="b", text="ok", token_ids=[1], stats=_stats(2)))
    assert isinstance(replies["b"][-1], Done) and s.procs["decoder"].crashes == 0
    assert s.totals.requests == {"failed": 1, "done": 1}


def test_a_resumed_request_s_stats_say_so(sup):
    s, fake = sup
    out: list[Message] = []
    s.submit(Submit(req_id="a", prompt="hi", max_new_tokens=8), out.append)
    fake.received()
    fake.reply(Tokens(req_id="a", ids=[5], text="q"))
    _crash(s)
    time.sleep(0.05)
    _back(s)
    assert fake.received().resume_ids == [5]
    fake.reply(Tokens(req_id="a", ids=[6], text="r"))
    fake.reply(Done(req_id="a", text="qr", token_ids=[5, 6], stats=_stats(2)))
    done = out[-1]
    assert isinstance(done, Done) and done.stats.resumed == 1
    assert done.stats.resume_wait_s >= 0.05
    assert [m.ids for m in out if isinstance(m, Tokens)] == [[5], [6]]  # no gap, no repeat
    assert s.procs["decoder"].recovery_s >= 0.05 and s.totals.resumed == 1
    assert POISON_CRASHES == 2


def test_a_client_cannot_send_a_continuation(sup):
    s, _ = sup
    with pytest.raises(RequestError, match="resume_ids"):
        s.submit(Submit(req_id="x", prompt="hi", resume_ids=[1, 2]), lambda m: None)


# ---- the decoder's stream ----------------------------------------------------------------------
def _stream(out, tokens: list[int], rng: random.Random, sent: list[tuple[list[int], str]]
            ) -> None:
    """Push `tokens` as the service does: the first commit at once (with what is owed), then
    batches per interval; every piece with stop strings."""
    i = 0
    while i < len(tokens) and not out.hit:
        n = 1 if out.kept == 0 or out.stops is not None else rng.randint(1, 6)
        ids, text = out.push(tokens[i:i + n])
        text = out.take_owed(text) if n == 1 or out.stops is not None else text
        if ids or text:
            sent.append((ids, text))
        i += n


@pytest.mark.parametrize("stops", [[], ["\n\n", "¢", "return x"]])
def test_the_stream_goes_on_at_any_cut_without_a_repeat_or_a_gap(stops):
    from memspec.procs.decoder.service import _Output

    tok = _tokenizer()
    rng = random.Random(len(stops))
    for text in TEXTS + ["price 5¢ then\n\nmore"]:
        ids = tok(text)["input_ids"] + [rng.randrange(200, 40000) for _ in range(12)]
        whole: list[tuple[list[int], str]] = []
        ref = _Output(tok, stops)
        _stream(ref, ids, random.Random(1), whole)
        whole.append(([], ref.flush()))
        want_ids = [t for p, _ in whole for t in p]
        want_text = "".join(t for _, t in whole)
        for cut in range(1, len(ids)):
            first = _Output(tok, stops)
            before: list[tuple[list[int], str]] = []
            _stream(first, ids[:cut], random.Random(1), before)  # the dead decoder's stream
            got_ids = [t for p, _ in before for t in p]
            got_text = "".join(t for _, t in before)
            if first.hit:
                continue  # the stop string came before the cut: the request was over
            second = _Output(tok, stops)
            second.prime(got_ids, len(got_text))
            after: list[tuple[list[int], str]] = []
            if not second.hit:
                _stream(second, ids[len(got_ids):], random.Random(2), after)
            after.append(([], second.flush()))
            assert got_ids + [t for p, _ in after for t in p] == want_ids, (text, cut)
            assert got_text + "".join(t for _, t in after) == want_text, (text, cut)
