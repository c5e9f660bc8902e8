"""`memspec up --http` against a real server, with the official OpenAI client: the same tokens
as `memspec generate`, every error case as an OpenAI error body, 200 malformed requests
that leave the server serving, a disconnect that frees the decoder, /metrics that
Prometheus's own parser reads and whose counters move, and the Python API on the same
server. One server serves the whole module (its start costs a target load)."""

from __future__ import annotations

import http.client
import json
import random
import re
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jsonschema
import openai
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families
from test_faults import MEMSPEC, Proc
from test_pipeline import _ready_pool

from memspec import Runtime
from memspec.common import limits as L
from memspec.common.config import load_pool
from memspec.common.errors import RequestError
from memspec.common.messages import CLIENT_REPLIES, ChatTurn, Done, Error, Submit, encode
from memspec.launch.client import status
from memspec.launch.openai_api import MAX_BODY_BYTES

PROMPT = "What is 2+2? Answer in one sentence."
MAX_NEW = 24
KEY = "x"  # the server's --api-key: the OpenAI client sends it as `Bearer x`
LONG = "Write a very long story about a lighthouse keeper and his dog."


@dataclass
class Server:
    up: Proc
    url: str  # http://127.0.0.1:PORT
    endpoint: str  # the ZeroMQ endpoint beside it
    model: str
    reference: dict[str, Any]  # `memspec generate --json` of PROMPT
    health_while_starting: int

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0,
                             timeout=120)


def _get(url: str, path: str) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    _ready_pool()
    tmp = tmp_path_factory.mktemp("http")
    ep = f"ipc://{tmp}/m.sock"
    up = Proc("up", "--endpoint", ep, "--no-stdin", "--http", "127.0.0.1:0", "--api-key", KEY,
              "--max-queue", "1")
    # the reference decodes in its own three processes while the server starts
    gen = subprocess.Popen([*MEMSPEC, "generate", "--json", "--max-new-tokens", str(MAX_NEW),
                            PROMPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        up.wait_for(lambda: b"HTTP on" in up.err, 120, "no HTTP line")
        url = re.search(rb"HTTP on (http://\S+)/v1", up.err).group(1).decode()
        first = _get(url, "/health")[0]
        up.wait_for(lambda: b"ready on" in up.err, 300, "not ready")
        out, err = gen.communicate(timeout=300)
        assert gen.returncode == 0, err.decode()[-2000:]
        yield Server(up, url, ep, load_pool(None).target.name, json.loads(out), first)
    finally:
        if gen.poll() is None:
            gen.kill()
        if up.p.poll() is None:
            code, _ = up.stopped_within(signal.SIGINT, 30)
            assert code == 130, up.err.decode()[-2000:]


def _metrics(server: Server) -> dict[str, float]:
    code, headers, body = _get(server.url, "/metrics")
    assert code == 200 and headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _wait_until(cond, bound: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < bound, what
        time.sleep(0.01)
    return time.monotonic() - t0


def _raw_stream(server: Server, content: str, max_tokens: int = 2000,
                stream: bool = True) -> socket.socket:
    """A request on a bare socket, so the test decides when the client goes away."""
    body = json.dumps({"model": server.model, "max_tokens": max_tokens, "stream": stream,
                       "messages": [{"role": "user", "content": content}]}).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: memspec\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
              + body)
    return s


def _read_events(s: socket.socket, n: int) -> bytes:
    got = b""
    while got.count(b"data:") < n:
        part = s.recv(65536)
        assert part, got
        got += part
    return got


def test_up_http_command_line_errors_are_one_line(tmp_path):
    _ready_pool()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    cases = {f"127.0.0.1:{port}": "is in use", "nohost:port": "is not HOST:PORT",
             "256.1.1.1:80": "cannot resolve"}
    try:
        for address, what in cases.items():
            r = subprocess.run([*MEMSPEC, "up", "--no-stdin", "--endpoint",
                                f"ipc://{tmp_path}/e.sock", "--http", address],
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 2 and r.stderr.startswith("memspec: error: "), r.stderr
            assert what in r.stderr and r.stderr.count("\n") == 1, r.stderr
        r = subprocess.run([*MEMSPEC, "up", "--api-key", "k"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and "--api-key needs --http" in r.stderr
    finally:
        taken.close()


# ---- the same tokens as `memspec generate` ------------------------------------------------
def test_chat_stream_matches_generate(server):
    ref = server.reference
    chunks = list(server.client().chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": PROMPT}], stream=True,
        max_tokens=MAX_NEW, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    end = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(end) == 1
    ext = end[0].model_extra["memspec"]
    assert ext["token_ids"] == ref["token_ids"]
    assert text == ref["text"]
    assert ext["stats"]["generated_tokens"] == len(ref["token_ids"])
    usage = chunks[-1].usage  # stream_options.include_usage: a last chunk with no choices
    assert chunks[-1].choices == [] and usage.completion_tokens == len(ref["token_ids"])
    assert usage.prompt_tokens == ref["stats"]["prompt_tokens"]


def test_chat_and_completions_unstreamed_match_generate(server):
    ref, client = server.reference, server.client()
    r = client.chat.completions.create(model=server.model, max_tokens=MAX_NEW,
                                       messages=[{"role": "user", "content": PROMPT}])
    assert r.choices[0].message.content == ref["text"]
    assert r.model_extra["memspec"]["token_ids"] == ref["token_ids"]
    assert r.choices[0].finish_reason == ("stop" if len(ref["token_ids"]) < MAX_NEW
                                          else "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + len(ref["token_ids"])
    assert r.model_extra["memspec"]["policy"] == ref["stats"]["policy"]
    c = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=MAX_NEW)
    assert c.choices[0].text == ref["text"]
    assert c.model_extra["memspec"]["token_ids"] == ref["token_ids"]
    pieces = list(client.completions.create(model=server.model, prompt=PROMPT,
                                            max_tokens=MAX_NEW, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == ref["text"]


def test_stop_string_cuts_the_reply(server):
    ref, client = server.reference, server.client()
    words = ref["text"].split()
    assert len(words) > 2, ref["text"]
    stop = " " + words[2]  # the reply is cut right before its third word
    want = ref["text"][:ref["text"].index(stop)]
    r = client.chat.completions.create(model=server.model, max_tokens=MAX_NEW, stop=[stop],
                                       messages=[{"role": "user", "content": PROMPT}])
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(
        model=server.model, max_tokens=MAX_NEW, stop=stop, stream=True,
        messages=[{"role": "user", "content": PROMPT}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_openai_clients_extra_fields_are_served_and_top_k_1_is_greedy(server):
    """What client libraries and agent frameworks send beside the core fields: vLLM's
    sampling extensions honoured (top_k = 1 at any temperature: greedy's tokens), fields
    that change nothing ignored with one server log line each, `n` > 1 still a 400."""
    client = server.client()
    for _ in range(2):
        r = client.chat.completions.create(
            model=server.model, max_tokens=MAX_NEW, temperature=0.8,
            messages=[{"role": "user", "content": PROMPT}], parallel_tool_calls=False,
            metadata={"app": "test"}, store=False, extra_body={"top_k": 1, "min_p": 0.05})
        assert r.model_extra["memspec"]["token_ids"] == server.reference["token_ids"]
    said = [f"ignoring the OpenAI field `{f}`".encode() for f in
            ("metadata", "store", "parallel_tool_calls")]
    server.up.wait_for(lambda: all(x in server.up.err for x in said), 10, "no log lines")
    assert all(server.up.err.count(x) == 1 for x in said)  # once each, not per request
    assert re.search(rb"WARNING supervisor\[\d+\]: ignoring the OpenAI field `store`",
                     server.up.err)
    r = client.chat.completions.create(
        model=server.model, max_tokens=4, temperature=1.0, seed=3,
        messages=[{"role": "user", "content": PROMPT}], extra_body={"top_k": 3, "min_p": 0.1})
    assert len(r.model_extra["memspec"]["token_ids"]) == 4
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, n=2, max_tokens=2,
                                       messages=[{"role": "user", "content": PROMPT}])
    assert e.value.body["param"] == "n" and "`n`" in e.value.body["message"]


def test_short_max_tokens_ends_with_length(server):
    r = server.client().chat.completions.create(
        model=server.model, max_tokens=3, messages=[{"role": "user", "content": PROMPT}])
    assert r.choices[0].finish_reason == "length"
    assert r.model_extra["memspec"]["token_ids"] == server.reference["token_ids"][:3]


# ---- models, health, errors -----------------------------------------------------------------
def test_models_health_and_startup(server):
    assert server.health_while_starting == 503  # not ready while the models load
    models = server.client().models.list().data
    assert [m.id for m in models] == [server.model]
    pool = load_pool(None)
    assert models[0].model_extra["memspec"]["drafts"] == [d.name for d in pool.drafts]
    assert server.client().models.retrieve(server.model).id == server.model
    code, _, body = _get(server.url, "/health")
    assert code == 200 and json.loads(body)["status"] == "ready"


def test_error_cases_are_openai_errors(server):
    client = server.client()
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", **chat)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, n=2, **chat)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").chat.completions.create(model=server.model, **chat)
    code, headers, body = _get(server.url, "/v1/models")  # no key at all
    assert code == 401 and headers["www-authenticate"] == "Bearer"
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nothing")
    code, _, body = _get(server.url, "/v2/nowhere")
    assert code == 404 and json.loads(body)["error"]["message"]


def _malformed(model: str, rng: random.Random) -> Iterator[tuple[str, str, bytes, dict, int]]:
    """(kind, path, body, extra headers, expected status): 200 requests, each wrong."""
    good = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    wrong_types = [("model", 1), ("messages", "hi"), ("messages", [1]), ("messages", []),
                   ("messages", [{"role": "robot", "content": "x"}]),
                   ("messages", [{"role": "user", "content": 5}]),
                   ("messages", [{"role": "user"}]),
                   ("messages", [{"role": "user", "content": [{"type": "image_url"}]}]),
                   ("max_tokens", "10"), ("max_tokens", -1), ("max_tokens", 0),
                   ("max_tokens", 1.5), ("temperature", "hot"), ("temperature", 9),
                   ("top_p", 0), ("top_p", 2), ("seed", "x"), ("seed", 2**70),
                   ("stop", [1]), ("stop", ["a"] * 5), ("stop", ""), ("stream", "yes"),
                   ("n", 2), ("n", "1"), ("logit_bias", {"1": 5}), ("tools", [{}]),
                   ("presence_penalty", 1), ("policy", "fastest"),
                   ("stream_options", {"include_usage": True}),
                   ("response_format", {"type": "xml"}), ("top_logprobs", 3)]
    unknown = [{"frobnicate": 1}, {"messages": [{"role": "user", "content": "x", "extra": 1}]},
               {"stream": True, "stream_options": {"include_usage": True, "x": 1}},
               {"functions": []}, {"Model": model}]
    for i in range(200):
        kind = ("json", "types", "unknown", "huge", "model")[i % 5]
        path = "/v1/completions" if i % 7 == 0 and kind != "unknown" else "/v1/chat/completions"
        body = dict(good)
        if path == "/v1/completions":
            body.pop("messages")
            body["prompt"] = "hi"
        headers: dict[str, str] = {}
        if kind == "json":
            raw = json.dumps(body).encode()
            bad = rng.choice([raw[:rng.randrange(len(raw))], raw + b"}", b"\xff\xfe" + raw,
                              bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))),
                              b"[" + raw + b"]", b"null", b"", b"42", raw.replace(b":", b"=")])
            yield kind, path, bad, headers, 400
        elif kind == "types":
            field, value = wrong_types[rng.randrange(len(wrong_types))]
            if path == "/v1/completions" and field == "messages":
                field, value = "prompt", rng.choice([1, [], ["a", "b"], {"x": 1}, None])
            body[field] = value
            yield kind, path, json.dumps(body).encode(), headers, 400
        elif kind == "unknown":
            body.update(rng.choice(unknown))
            yield kind, path, json.dumps(body).encode(), headers, 400
        elif kind == "huge":
            how = i % 3
            if how == 0:  # a body just over the limit
                body["messages" if "messages" in body else "prompt"] = (
                    [{"role": "user", "content": "a" * MAX_BODY_BYTES}] if "messages" in body
                    else "a" * MAX_BODY_BYTES)
                yield kind, path, json.dumps(body).encode(), headers, 413
            elif how == 1:  # a declared length far over it (nothing read)
                yield kind, path, b"", {"Content-Length": str(50 << 20)}, 413
            else:  # chunked, no length given
                yield kind, path, b"x" * (MAX_BODY_BYTES + 10), {"chunked": "1"}, 413
        else:
            body["model"] = rng.choice(["gpt-4o", "", "smollm2", model.upper()])
            yield kind, path, json.dumps(body).encode(), headers, 404


def _send(server: Server, path: str, body: bytes, headers: dict) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        hdrs = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        if headers.pop("chunked", None):
            conn.putrequest("POST", path)
            for k, v in hdrs.items():
                conn.putheader(k, v)
            conn.putheader("Transfer-Encoding", "chunked")
            conn.endheaders()
            try:
                for i in range(0, len(body), 1 << 16):
                    part = body[i:i + (1 << 16)]
                    conn.send(b"%x\r\n%s\r\n" % (len(part), part))
                conn.send(b"0\r\n\r\n")
            except OSError:
                pass  # the server answered and closed before reading it all: allowed
        elif "Content-Length" in headers:
            conn.putrequest("POST", path)
            for k, v in {**hdrs, **headers}.items():
                conn.putheader(k, v)
            conn.endheaders()
        else:
            conn.request("POST", path, body=body, headers=hdrs)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def test_200_malformed_requests_each_get_a_4xx_json_error_and_the_server_keeps_serving(server):
    before = _metrics(server)
    counts: dict[str, int] = {}
    t0 = time.monotonic()
    for kind, path, body, headers, want in _malformed(server.model, random.Random(14)):
        code, hdrs, raw = _send(server, path, body, dict(headers))
        assert code == want, (kind, body[:200], raw[:300])
        assert hdrs["content-type"] == "application/json", (kind, hdrs)
        err = json.loads(raw)["error"]
        assert isinstance(err["message"], str) and err["message"], raw
        counts[kind] = counts.get(kind, 0) + 1
    dt = time.monotonic() - t0
    assert sum(counts.values()) == 200
    print(f"\n200 malformed requests ({counts}) answered in {dt:.2f}s, "
          f"{1000 * dt / 200:.1f} ms each")
    r = server.client().chat.completions.create(
        model=server.model, max_tokens=MAX_NEW, messages=[{"role": "user", "content": PROMPT}])
    assert r.model_extra["memspec"]["token_ids"] == server.reference["token_ids"]
    after = _metrics(server)
    for proc in ("decoder", "loader", "predictor"):
        key = f"memspec_process_restarts_total{{proc={proc}}}"
        assert after[key] == before[key], proc
        assert after[f"memspec_process_up{{proc={proc}}}"] == 1.0


# ---- disconnects, a full queue ---------------------------------------------------------------
def _running(server: Server) -> float:
    return _metrics(server)["memspec_num_requests_running"]


@pytest.mark.parametrize("stream", [True, False])
def test_a_disconnect_frees_the_server_within_a_second(server, stream):
    cancelled = _metrics(server)["memspec_requests_total{outcome=cancelled}"]
    s = _raw_stream(server, LONG, stream=stream)
    if stream:
        _read_events(s, 4)  # decoding for sure
    else:
        _wait_until(lambda: _running(server) == 1, 30, "the request never ran")
        time.sleep(0.3)
    t0 = time.monotonic()
    s.close()
    freed = _wait_until(lambda: _running(server) == 0, 5, "the request kept running")
    assert freed < 1.0, freed
    assert _metrics(server)["memspec_requests_total{outcome=cancelled}"] == cancelled + 1
    chunks = server.client().chat.completions.create(
        model=server.model, max_tokens=4, stream=True,
        messages=[{"role": "user", "content": PROMPT}])
    next(iter(chunks))
    first = time.monotonic() - t0
    rest = list(chunks)
    assert rest[-1].model_extra["memspec"]["token_ids"] == server.reference["token_ids"][:4]
    print(f"\ndisconnect (stream={stream}): server free after {freed * 1000:.0f} ms, the next "
          f"request's first event {first * 1000:.0f} ms after the disconnect")


def test_a_full_queue_is_429_with_retry_after(server):
    running = _raw_stream(server, LONG)
    _read_events(running, 2)
    waiting = _raw_stream(server, LONG)  # --max-queue 1: this one waits, the next is refused
    try:
        _wait_until(lambda: _metrics(server)["memspec_num_requests_waiting"] == 1, 10,
                    "the second request was not queued")
        with pytest.raises(openai.RateLimitError) as e:
            server.client().chat.completions.create(
                model=server.model, max_tokens=2, messages=[{"role": "user", "content": "x"}])
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert e.value.body["code"] == "server_busy"
    finally:
        waiting.close()
        running.close()
    _wait_until(lambda: _running(server) == 0 and _metrics(server)["memspec_num_requests_waiting"]
                == 0, 5, "the abandoned requests kept the server")


# ---- metrics ------------------------------------------------------------------------------
def test_metrics_parse_and_move_as_requests_complete(server):
    before = _metrics(server)
    names = {f.name for f in text_string_to_metric_families(_get(server.url, "/metrics")[2]
                                                            .decode())}
    for name in ("memspec_spec_decode_num_drafts", "memspec_spec_decode_num_draft_tokens",
                 "memspec_spec_decode_num_accepted_tokens", "memspec_generation_tokens",
                 "memspec_prompt_tokens", "memspec_requests",
                 "memspec_spec_decode_mean_acceptance_length", "memspec_draft_loads",
                 "memspec_draft_evictions", "memspec_draft_switches", "memspec_fallback_seconds",
                 "memspec_load_wait_seconds", "memspec_draft_resident",
                 "memspec_draft_iterations", "memspec_process_restarts",
                 "memspec_process_resident_memory_bytes"):
        assert name in names, name
    r = server.client().chat.completions.create(
        model=server.model, max_tokens=MAX_NEW, messages=[{"role": "user", "content": PROMPT}])
    st = r.model_extra["memspec"]["stats"]
    after = _metrics(server)

    def delta(key: str) -> float:
        return after[key] - before[key]

    assert delta("memspec_requests_total{outcome=done}") == 1
    assert delta("memspec_generation_tokens_total") == r.usage.completion_tokens
    assert delta("memspec_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("memspec_spec_decode_num_drafts_total") == st["num_drafts"]
    assert delta("memspec_spec_decode_num_draft_tokens_total") == st["num_draft_tokens"]
    assert delta("memspec_spec_decode_num_accepted_tokens_total") == st["num_accepted_tokens"]
    assert delta("memspec_draft_loads_total") == st["loads"]
    for draft, n in st["drafts_used"].items():
        assert delta(f"memspec_draft_iterations_total{{draft={draft}}}") == n
    assert sum(v for k, v in after.items() if k.startswith("memspec_draft_resident")) >= 1
    assert after["memspec_process_resident_memory_bytes{proc=decoder}"] > 50 << 20
    # the latency histograms, by vLLM's names: one observation per served request
    served = after["memspec_requests_total{outcome=done}"]
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_time_per_output_token_seconds"):
        assert after[f"memspec_{name}_count"] == served > 0, name
        assert delta(f"memspec_{name}_count") == 1, name
        assert after[f"memspec_{name}_bucket{{le=+Inf}}"] == served, name
    assert delta("memspec_inter_token_latency_seconds_count") >= 1
    assert 0 < delta("memspec_time_to_first_token_seconds_sum") <= delta(
        "memspec_e2e_request_latency_seconds_sum")
    key = ("memspec_spec_decode_accepted_tokens_per_iteration_count"
           f"{{policy={r.model_extra['memspec']['policy']}}}")
    assert after.get(key, 0) - before.get(key, 0) == st["num_drafts"]
    assert after["memspec_num_requests_running"] == after["memspec_requests_running"] == 0
    assert after["memspec_num_requests_waiting"] == 0


# ---- the Python API on the same server -------------------------------------------------------
def test_runtime_on_a_running_server(server):
    ref = server.reference
    with Runtime(server.endpoint) as rt:
        res = rt.generate(PROMPT, max_new_tokens=MAX_NEW)
        assert res.token_ids == ref["token_ids"] and res.text == ref["text"]
        chat = rt.generate([{"role": "user", "content": PROMPT}], max_new_tokens=MAX_NEW)
        assert chat.token_ids == ref["token_ids"]
        stream = rt.stream(PROMPT, max_new_tokens=MAX_NEW)
        assert "".join(stream) == ref["text"]
        assert stream.result is not None and stream.result.token_ids == ref["token_ids"]
        cancelled = _metrics(server)["memspec_requests_total{outcome=cancelled}"]
        long = rt.stream(LONG, max_new_tokens=2000)
        next(long)
        long.close()  # leaving early cancels the request
        _wait_until(lambda: _running(server) == 0, 2, "a closed stream kept running")
        assert _metrics(server)["memspec_requests_total{outcome=cancelled}"] == cancelled + 1
        assert rt.status().totals.requests["done"] >= 1


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                         "country": {"type": "string", "maxLength": 24}},
        "required": ["city", "country"], "additionalProperties": False}
CITY_PROMPT = "Give a city and its country as JSON."


def test_json_schema_and_logprobs_through_the_openai_client_and_the_python_api(server):
    """The official client's `response_format` and `logprobs`, streamed and not, and the
    same request through `Runtime`: valid JSON, one log-probability per token, the same
    tokens and numbers every way."""
    client = server.client()
    kw = {"model": server.model, "max_tokens": 96, "logprobs": True, "top_logprobs": 2,
          "messages": [{"role": "user", "content": CITY_PROMPT}],
          "response_format": {"type": "json_schema", "json_schema": {
              "name": "city", "schema": CITY, "strict": True}}}
    r = client.chat.completions.create(**kw)
    text, ids = r.choices[0].message.content, r.model_extra["memspec"]["token_ids"]
    jsonschema.validate(json.loads(text), CITY)
    # on a CPU a drafting policy runs as lookup-only under a grammar, and says so
    assert r.model_extra["memspec"]["policy"] == "lookup-only"
    lp = r.choices[0].logprobs.content
    assert len(lp) == len(ids) and all(len(t.top_logprobs) == 2 for t in lp)
    assert all(t.logprob <= 0 and t.bytes == list(t.token.encode()) for t in lp)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [
        (t.token, round(t.logprob, 4)) for t in lp]
    c = client.completions.create(model=server.model, prompt=CITY_PROMPT, max_tokens=96,
                                  logprobs=1, extra_body={"response_format": {
                                      "type": "json_object"}})
    json.loads(c.choices[0].text)
    legacy = c.choices[0].logprobs
    assert len(legacy.tokens) == len(c.model_extra["memspec"]["token_ids"])
    assert len(legacy.text_offset) == len(legacy.tokens) and legacy.text_offset[0] == 0
    with Runtime(server.endpoint) as rt:
        res = rt.generate([{"role": "user", "content": CITY_PROMPT}], max_new_tokens=96,
                          json_schema=CITY, logprobs=2)
        assert res.token_ids == ids and res.text == text
        assert [round(t.logprob, 4) for t in res.logprobs] == [round(t.logprob, 4) for t in lp]
        plain = rt.generate([{"role": "user", "content": CITY_PROMPT}], max_new_tokens=96,
                            json_schema=CITY, policy="target-only")
        assert plain.token_ids == ids  # constrained target-only: the same tokens
    bad = {**kw, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/no"}}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**bad)
    assert "schema" in str(e.value)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as e:  # the demo's template renders no tools
        client.chat.completions.create(model=server.model, messages=kw["messages"],
                                       tools=[tool])
    assert "takes no tools" in str(e.value)


# ---- request limits through every front door (common/limits.py) -----------------------------
CONTEXT = "exceeds the target's context"  # what a prompt inside the size limits still meets
SMALL = 4096  # bytes: no error reply is larger


def _zmq_request(endpoint: str, req: Submit) -> tuple[Done | Error, int]:
    """A Submit on a bare DEALER: its Done or Error and the size of that frame."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        sock.send_multipart(encode(req))
        while sock.poll(60_000):
            raw = sock.recv_multipart()
            msg = CLIENT_REPLIES.decode(raw)
            if isinstance(msg, (Done, Error)):
                return msg, len(raw[0])
        raise AssertionError("no Done or Error in 60 s")
    finally:
        ctx.destroy(linger=0)


def _http_request(server: Server, body: dict) -> tuple[int, dict]:
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    code, _, raw = _send(server, path, json.dumps({"model": server.model, "max_tokens": 1,
                                                   **body}).encode(), {})
    assert code == 200 or len(raw) < SMALL, (code, len(raw))
    return code, json.loads(raw)


def _chat(n: int, content: str = "t") -> list[dict[str, str]]:
    return [{"role": "user", "content": content}] * n


# (limit, request just inside, just outside, what the inside one meets: "" served, else the
# error it gets past the limit, and the words of the outside one's error)
FRONT_DOOR_CASES = [
    ("roles", {"messages": [{"role": "system", "content": "Be brief."},
                            {"role": "assistant", "content": "OK."},
                            {"role": "user", "content": PROMPT}]},
     {"messages": [{"role": "user", "content": PROMPT}, {"role": "robot", "content": "x"}]},
     "", "messages[1].role"),
    ("stop strings", {"messages": _chat(1, PROMPT), "stop": ["\u2603" * L.MAX_STOP_CHARS] * 4},
     {"messages": _chat(1, PROMPT), "stop": ["a"] * 5}, "", "5 stop strings"),
    ("prompt size", {"prompt": "p " * (L.MAX_PROMPT_CHARS // 2)},
     {"prompt": "p " * (L.MAX_PROMPT_CHARS // 2) + "p"}, CONTEXT, "over the limit of 262144"),
    ("chat turns", {"messages": _chat(L.MAX_MESSAGES)},
     {"messages": _chat(L.MAX_MESSAGES + 1)}, CONTEXT, "over the limit of 1024"),
]


def _door_submit(body: dict, **extra) -> Submit:
    """A FRONT_DOOR_CASES body as the Submit a ZeroMQ client sends."""
    turns = [ChatTurn(role=m["role"], content=m["content"]) for m in body.get("messages", [])]
    return Submit(req_id=extra.pop("req_id", secrets.token_hex(4)),
                  prompt=body.get("prompt", ""), messages=turns, stop=body.get("stop", []),
                  max_new_tokens=1, **extra)


@pytest.mark.parametrize("name, inside, outside, meets, refusal", FRONT_DOOR_CASES,
                         ids=[c[0] for c in FRONT_DOOR_CASES])
def test_each_limit_inside_is_served_and_outside_refused_small_through_every_front_door(
        server, name, inside, outside, meets, refusal):
    # HTTP
    code, body = _http_request(server, inside)
    assert (code == 200) if not meets else (code == 400 and meets in body["error"]["message"])
    code, body = _http_request(server, outside)
    assert code == 400 and refusal in body["error"]["message"], body
    # ZeroMQ client socket
    msg, size = _zmq_request(server.endpoint, _door_submit(inside))
    assert isinstance(msg, Done) if not meets else meets in msg.message, msg
    msg, size = _zmq_request(server.endpoint, _door_submit(outside))
    assert isinstance(msg, Error) and msg.kind == "request" and refusal in msg.message
    assert size < SMALL
    # the Python API over the same server
    prompt = inside.get("prompt") or inside["messages"]
    with Runtime(server.endpoint) as rt:
        if meets:
            with pytest.raises(RequestError, match=re.escape(meets)):
                rt.generate(prompt, max_new_tokens=1, stop=inside.get("stop"))
        else:
            assert rt.generate(prompt, max_new_tokens=1, stop=inside.get("stop")).token_ids
        with pytest.raises(RequestError, match=re.escape(refusal)):
            rt.generate(outside.get("prompt") or outside["messages"], max_new_tokens=1,
                        stop=outside.get("stop"))


def test_zeromq_only_limits_req_id_and_the_predictor_text_beside_a_chat(server):
    """The two fields only a ZeroMQ client sets (HTTP and the API make them)."""
    chat = {"messages": _chat(1, PROMPT)}
    done, _ = _zmq_request(server.endpoint, _door_submit(chat, req_id="i" * L.MAX_REQ_ID_CHARS))
    assert isinstance(done, Done) and done.req_id == "i" * L.MAX_REQ_ID_CHARS
    for req_id in ("i" * (L.MAX_REQ_ID_CHARS + 1), "i" * (1 << 20), "a b"):
        err, size = _zmq_request(server.endpoint, _door_submit(chat, req_id=req_id))
        assert isinstance(err, Error) and err.req_id == "" and "req_id" in err.message
        assert size < SMALL
    done, _ = _zmq_request(server.endpoint, _door_submit(
        {**chat, "prompt": "r" * L.MAX_RANK_CHARS}))
    assert isinstance(done, Done)
    err, size = _zmq_request(server.endpoint, _door_submit(
        {**chat, "prompt": "r" * (1 << 20)}))
    assert isinstance(err, Error) and "beside messages" in err.message and size < SMALL
    assert all(p.restarts == 0 for p in status(server.endpoint).procs.values())


# ---- last: a process restart -----------------------------------------------------------------
def test_a_restarting_decoder_is_503_with_retry_after(server):
    decoder = status(server.endpoint).procs["decoder"].pid
    subprocess.run(["kill", "-9", str(decoder)], check=True)
    _wait_until(lambda: _get(server.url, "/health")[0] == 503, 10, "/health stayed 200")
    code, headers, body = _get(server.url, "/health")
    assert code == 503 and int(headers["retry-after"]) >= 1
    assert json.loads(body)["status"] in ("restarting", "starting")
    with pytest.raises(openai.InternalServerError) as e:
        server.client().chat.completions.create(
            model=server.model, max_tokens=2, messages=[{"role": "user", "content": PROMPT}])
    assert e.value.status_code == 503 and int(e.value.response.headers["retry-after"]) >= 1
    _wait_until(lambda: _get(server.url, "/health")[0] == 200, 120, "the decoder never came back")
    r = server.client().chat.completions.create(
        model=server.model, max_tokens=MAX_NEW, messages=[{"role": "user", "content": PROMPT}])
    assert r.model_extra["memspec"]["token_ids"] == server.reference["token_ids"]
    assert _metrics(server)["memspec_process_restarts_total{proc=decoder}"] == 1
