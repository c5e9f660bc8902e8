"""The HTTP front end's pure parts: request bodies into Submits, stop strings on streamed
pieces, the Prometheus text (read back with prometheus_client's own parser)."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from memspec.common.errors import MemspecError, RequestError
from memspec.common.messages import ProcStatus, SlotStatus, Status, encode
from memspec.common.metrics import Totals
from memspec.launch import prometheus
from memspec.launch.http import parse_address
from memspec.launch.openai_api import ApiError, parse_chat, parse_completion
from memspec.procs.decoder.stops import StopMatcher


def _body(**fields) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def test_a_one_turn_chat_and_a_completion_submit_the_same_prompt():
    chat = parse_chat(_body(messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                            stop="x", seed=3))
    comp = parse_completion(_body(prompt="hi", max_tokens=5, stop="x", seed=3))
    assert chat.submit.prompt == comp.submit.prompt == "hi"
    assert [(t.role, t.content) for t in chat.submit.messages] == [("user", "hi")]
    assert chat.submit.stop == comp.submit.stop == ["x"]
    assert chat.submit.max_new_tokens == 5 and chat.submit.temperature == 0.0
    assert chat.chat and not comp.chat
    encode(chat.submit)  # a valid message on the wire


def test_chat_parts_roles_and_max_completion_tokens():
    call = parse_chat(_body(messages=[{"role": "developer", "content": "be brief"},
                                      {"role": "user", "content": [{"type": "text",
                                                                    "text": "a"},
                                                                   {"type": "text",
                                                                    "text": "b"}]}],
                            max_completion_tokens=7, stream=True,
                            stream_options={"include_usage": True}))
    assert [(t.role, t.content) for t in call.submit.messages] == [("system", "be brief"),
                                                                   ("user", "ab")]
    assert call.submit.max_new_tokens == 7 and call.stream and call.include_usage


@pytest.mark.parametrize("body, param", [
    (_body(messages=[{"role": "user", "content": "x"}], n=3), "n"),
    (_body(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
    (_body(messages=[{"role": "user", "content": None}]), "messages[0].content"),
    (_body(messages=[{"role": "user", "content": "x"}], max_tokens=2,
           max_completion_tokens=3), "max_completion_tokens"),
    (_body(prompt="x", echo=True), "echo"),
])
def test_unsupported_values_name_their_field(body, param):
    parse = parse_completion if b'"prompt"' in body else parse_chat
    with pytest.raises(ApiError) as e:
        parse(body)
    assert e.value.status == 400 and e.value.body()["error"]["param"] == param


def test_stop_strings_split_across_pieces_are_never_streamed():
    m = StopMatcher(["</end>", "STOP"])
    out = [m.push(p) for p in ["Hello </", "en", "d> more"]]
    assert out == ["Hello ", "", ""] and m.hit
    m = StopMatcher(["STOP"])
    assert m.push("aST") == "a" and m.push("x") == "STx" and m.flush() == ""
    m = StopMatcher(["STOP"])
    assert m.push("abS") == "ab" and m.flush() == "S" and not m.hit
    with pytest.raises(RequestError):
        StopMatcher(["a", "b", "c", "d", "e"])


def test_http_addresses():
    assert parse_address("8000") == ("127.0.0.1", 8000)
    assert parse_address("0.0.0.0:80") == ("0.0.0.0", 80)
    assert parse_address("[::1]:8000") == ("::1", 8000)
    assert parse_address("127.0.0.1:0") == ("127.0.0.1", 0)  # any free port
    for bad in ("host:http", "1:70000", ""):
        with pytest.raises(MemspecError):
            parse_address(bad)


def test_metrics_text_parses_and_keeps_every_draft_and_process():
    totals = Totals(requests={"done": 2, "cancelled": 1}, num_drafts=4, num_accepted_tokens=6,
                    draft_iterations={"code": 4})
    st = Status(procs={"decoder": ProcStatus(pid=1, state="ready", restarts=2, rss_mb=10),
                       "loader": ProcStatus(pid=None, state="restarting")},
                slots=[SlotStatus(slot=0, generation=1, state="resident", draft="code"),
                       SlotStatus(slot=1, generation=0, state="free", draft=None)],
                totals=totals, quarantined={"general": "bad checksum"})
    samples = {}
    for family in text_string_to_metric_families(prometheus.render(st, ["general", "code"])):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert samples[("memspec_requests_total", (("outcome", "done"),))] == 2
    assert samples[("memspec_requests_total", (("outcome", "busy"),))] == 0
    assert samples[("memspec_spec_decode_mean_acceptance_length", ())] == 2.5
    assert samples[("memspec_draft_iterations_total", (("draft", "general"),))] == 0
    assert samples[("memspec_draft_resident", (("draft", "code"),))] == 1
    assert samples[("memspec_draft_quarantined", (("draft", "general"),))] == 1
    assert samples[("memspec_draft_quarantined", (("draft", "code"),))] == 0
    assert samples[("memspec_process_restarts_total", (("proc", "decoder"),))] == 2
    assert samples[("memspec_process_up", (("proc", "loader"),))] == 0
    assert samples[("memspec_process_resident_memory_bytes", (("proc", "decoder"),))] == 10 << 20
    # a Status without totals (an old decoder's) still renders
    assert "memspec_requests_total" in prometheus.render(Status(procs={}, slots=[]), [])
