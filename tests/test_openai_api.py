"""The HTTP front end's pure parts: request bodies into Submits, stop strings on streamed
pieces, the Prometheus text (read back with prometheus_client's own parser)."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from memspec.common.errors import MemspecError, RequestError
from memspec.common.messages import ProcStatus, SlotStatus, Status, encode
from memspec.common.metrics import (
    REQUEST_LATENCY_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    RequestTimes,
    Summary,
    TimeBreakdown,
    Totals,
)
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
    (_body(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
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


def _summary(tokens: int, prefill: float, accepted: list[int], policy: str) -> Summary:
    return Summary(generated_tokens=tokens, prompt_tokens=7, iterations=len(accepted),
                   tokens_per_s_steady=1.0, tokens_per_s_e2e=1.0, num_drafts=sum(accepted),
                   num_draft_tokens=4 * sum(accepted), num_accepted_tokens=0,
                   mean_acceptance_length=1.0, acceptance_rate=0.0,
                   time=TimeBreakdown(prefill=prefill, **dict.fromkeys(
                       ("draft", "verify", "catchup", "desired", "fallback", "target_fallback",
                        "load_wait", "prediction", "decode", "e2e"), 0.0)), loads=0, evictions=0,
                   switches=0, bytes_loaded=0, drafts_used={}, policy=policy,
                   accepted_counts=accepted)


def test_latency_histograms_have_vllms_names_buckets_and_one_count_per_served_request():
    totals = Totals()
    # three served requests: arrival 0, decoder at `sent`, token messages at `toks`, done at end
    for sent, toks, end, policy in ((0.01, [0.2, 0.25, 0.3], 0.4, "memspec"),
                                    (1.5, [3.0], 3.1, "memspec"),
                                    (0.0, [0.05, 0.5], 0.6, "target-only")):
        times = RequestTimes(0.0, dispatched=sent)
        for t in toks:
            times.tokens(t)
        totals.served(_summary(len(toks) * 2, 0.02, [1, 2, 0, 1], policy), times, end)
    st = Status(procs={}, slots=[], totals=totals.snapshot(queued=2, running=1))
    fams = {f.name: f for f in text_string_to_metric_families(prometheus.render(st, []))}
    vllm_buckets = {
        "memspec_time_to_first_token_seconds": TTFT_BUCKETS,
        "memspec_inter_token_latency_seconds": TOKEN_LATENCY_BUCKETS,
        "memspec_request_time_per_output_token_seconds": TOKEN_LATENCY_BUCKETS,
        "memspec_e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
        "memspec_request_queue_time_seconds": REQUEST_LATENCY_BUCKETS,
        "memspec_request_prefill_time_seconds": REQUEST_LATENCY_BUCKETS,
    }
    for name, buckets in vllm_buckets.items():
        fam = fams[name]
        assert fam.type == "histogram"
        bucket = [s for s in fam.samples if s.name == name + "_bucket"]
        assert [float(s.labels["le"]) for s in bucket] == [*buckets, float("inf")]
        values = [s.value for s in bucket]
        assert values == sorted(values)  # cumulative
        count = next(s.value for s in fam.samples if s.name == name + "_count")
        assert values[-1] == count

    def count(name: str, **labels: str) -> float:
        return next(s.value for s in fams[name].samples
                    if s.name == name + "_count" and s.labels == labels)

    assert count("memspec_time_to_first_token_seconds") == 3  # one per served request
    assert count("memspec_inter_token_latency_seconds") == 2 + 0 + 1
    ttft = [s for s in fams["memspec_time_to_first_token_seconds"].samples
            if s.name.endswith("_bucket")]
    assert {s.labels["le"]: s.value for s in ttft}["0.25"] == 2  # 0.2 and 0.05; 3.0 above
    assert count("memspec_spec_decode_accepted_tokens_per_iteration", policy="memspec") == 8
    assert count("memspec_spec_decode_accepted_tokens_per_iteration", policy="target-only") == 4
    queue = next(s.value for s in fams["memspec_request_queue_time_seconds"].samples
                 if s.name.endswith("_sum"))
    assert queue == pytest.approx(1.51)
    gauges = {f.name: f.samples[0].value for f in fams.values() if f.type == "gauge" and f.samples
              and not f.samples[0].labels}
    assert gauges["memspec_num_requests_running"] == gauges["memspec_requests_running"] == 1
    assert gauges["memspec_num_requests_waiting"] == gauges["memspec_requests_queued"] == 2


def test_sampling_extensions_and_ignored_openai_fields():
    chat = [{"role": "user", "content": "hi"}]
    call = parse_chat(_body(messages=chat, temperature=0.7, top_k=1, min_p=0.1,
                            parallel_tool_calls=True, metadata={"app": "x"}, store=False))
    assert (call.submit.top_k, call.submit.min_p) == (1, 0.1)
    assert call.ignored == ["metadata", "store", "parallel_tool_calls"]
    assert parse_chat(_body(messages=chat, top_k=-1)).submit.top_k == 0  # vLLM's "off"
    assert parse_completion(_body(prompt="x", top_k=5, service_tier="auto")).ignored == [
        "service_tier"]
    for body, param in ((_body(messages=chat, n=2), "n"),
                        (_body(messages=chat, repetition_penalty=1.2), "repetition_penalty"),
                        (_body(messages=chat, top_logprobs=2), "top_logprobs")):
        with pytest.raises(ApiError) as e:
            parse_chat(body)
        assert e.value.status == 400 and e.value.param == param
    for body in (_body(messages=chat, min_p=1.5), _body(messages=chat, top_k=-2),
                 _body(messages=chat, frobnicate=1)):
        with pytest.raises(ApiError) as e:
            parse_chat(body)
        assert e.value.status == 400


def test_logprobs_and_response_format_reach_the_submit():
    chat = [{"role": "user", "content": "hi"}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    call = parse_chat(_body(messages=chat, logprobs=True, top_logprobs=3,
                            response_format={"type": "json_schema", "json_schema": {
                                "name": "x", "schema": schema, "strict": True}}))
    sub = call.submit
    assert (sub.logprobs, sub.response_format) == (3, "json_schema")
    assert json.loads(sub.json_schema) == schema
    assert parse_chat(_body(messages=chat, logprobs=True)).submit.logprobs == 0
    assert parse_chat(_body(messages=chat)).submit.logprobs is None
    assert parse_chat(_body(messages=chat, response_format={"type": "json_object"})
                      ).submit.response_format == "json_object"
    assert parse_chat(_body(messages=chat, response_format={"type": "text"})
                      ).submit.response_format == ""
    assert parse_completion(_body(prompt="x", logprobs=2)).submit.logprobs == 2
    for body in (_body(messages=chat, response_format={"type": "xml"}),
                 _body(messages=chat, response_format={"type": "json_schema"}),
                 _body(messages=chat, logprobs=True, top_logprobs=21),
                 _body(prompt="x", logprobs=6)):
        with pytest.raises(ApiError) as e:
            (parse_completion if b'"prompt"' in body else parse_chat)(body)
        assert e.value.status == 400


def test_logprobs_objects_follow_each_api():
    from memspec.common.messages import TokenLogprob, TopLogprob
    from memspec.launch.openai_api import logprobs_object

    entries = [TokenLogprob("He", 1, -0.5, [TopLogprob("He", 1, -0.5), TopLogprob("I", 2, -1.5)]),
               TokenLogprob("llo", 3, -0.1, [TopLogprob("llo", 3, -0.1), TopLogprob("y", 4, -3.0)])]
    chat = parse_chat(_body(messages=[{"role": "user", "content": "hi"}], logprobs=True,
                            top_logprobs=2))
    obj = logprobs_object(chat, entries)
    assert obj["content"][1] == {"token": "llo", "logprob": -0.1, "bytes": [108, 108, 111],
                                 "top_logprobs": [
                                     {"token": "llo", "logprob": -0.1, "bytes": [108, 108, 111]},
                                     {"token": "y", "logprob": -3.0, "bytes": [121]}]}
    legacy = logprobs_object(parse_completion(_body(prompt="x", logprobs=2)), entries, 5)
    assert legacy == {"tokens": ["He", "llo"], "token_logprobs": [-0.5, -0.1],
                      "top_logprobs": [{"He": -0.5, "I": -1.5}, {"llo": -0.1, "y": -3.0}],
                      "text_offset": [5, 7]}
    assert logprobs_object(parse_chat(_body(messages=[{"role": "user", "content": "hi"}])),
                           entries) is None
