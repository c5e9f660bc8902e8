"""`memspec bench http`: what a long-lived `memspec up --http` saves over `memspec generate`,
measured side by side in one run.

Per prompt, interleaved: `memspec generate PROMPT` (three processes started for one request)
against the same prompt as a streamed chat completion to a warm `memspec up --http`, and
through the Python API over the same server's ZeroMQ endpoint (what HTTP adds to it): the
time to the first streamed text and to the end, and whether all gave the same text. Then
a client that disconnects mid-stream: how long until the server's /metrics shows nothing
running, and until the next request's first token arrives.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from memspec.bench.floor import UpProcess, settle
from memspec.bench.pipeline import dev_prompts
from memspec.common.config import load_pool
from memspec.common.errors import MemspecError
from memspec.common.provenance import result_provenance
from memspec.launch.api import Runtime

MEMSPEC = [sys.executable, "-m", "memspec"]
LONG = "Write a very long story about a lighthouse keeper and his dog."


class _Up(UpProcess):
    """`memspec up --http 127.0.0.1:0`; its HTTP port read from its stderr."""

    def __init__(self, pool: str | None, run_dir: str) -> None:
        super().__init__(["--endpoint", f"ipc://{run_dir}/m.sock", "--http", "127.0.0.1:0"]
                         + (["--pool", pool] if pool else []))
        self.port = int(re.search(rb"HTTP on http://[^:]+:(\d+)/v1", self.err).group(1))


def _log(msg: str) -> None:
    print(f"[bench http] {msg}", file=sys.stderr, flush=True)


def _generate(prompt: str, max_new: int, pool: str | None) -> dict[str, Any]:
    """`memspec generate`, timed from its start to its first byte of text and to its exit."""
    t0 = time.monotonic()
    p = subprocess.Popen([*MEMSPEC, "generate", "--fresh", "--max-new-tokens", str(max_new), prompt,
                          *(["--pool", pool] if pool else [])],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    first = p.stdout.read1(1)
    ttft = time.monotonic() - t0
    rest = p.stdout.read()
    p.wait()
    if p.returncode:
        raise MemspecError(f"memspec generate failed (exit {p.returncode})")
    return {"ttft_s": ttft, "total_s": time.monotonic() - t0,
            "text": (first + rest).decode().strip()}


def _post(port: int, body: dict[str, Any]) -> tuple[http.client.HTTPConnection, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise MemspecError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    return conn, resp


def _chat(port: int, model: str, prompt: str, max_new: int) -> dict[str, Any]:
    """A streamed chat completion, timed to its first piece of text and to `[DONE]`."""
    t0 = time.monotonic()
    conn, resp = _post(port, {"model": model, "stream": True, "max_tokens": max_new,
                              "messages": [{"role": "user", "content": prompt}]})
    ttft, text, ids = None, "", []
    try:
        while line := resp.readline():
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            piece = event["choices"][0]["delta"].get("content") or ""
            if piece and ttft is None:
                ttft = time.monotonic() - t0
            text += piece
            ids = event.get("memspec", {}).get("token_ids", ids)
    finally:
        conn.close()
    return {"ttft_s": ttft, "total_s": time.monotonic() - t0, "text": text.strip(),
            "tokens": len(ids)}


def _zmq(rt: Runtime, prompt: str, max_new: int) -> dict[str, Any]:
    """The same request through the Python API, over the server's ZeroMQ endpoint."""
    t0 = time.monotonic()
    stream = rt.stream(prompt, max_new_tokens=max_new)
    first = next(stream, "")
    ttft = time.monotonic() - t0
    text = first + "".join(stream)
    return {"ttft_s": ttft, "total_s": time.monotonic() - t0, "text": text.strip()}


def _running(port: int) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        body = conn.getresponse().read().decode()
    finally:
        conn.close()
    return float(re.search(r"^memspec_num_requests_running (\S+)$", body, re.M).group(1))


def _disconnect(port: int, model: str, prompt: str) -> dict[str, float]:
    """Stream a long reply, hang up after a few events; time until the server is free."""
    body = json.dumps({"model": model, "stream": True, "max_tokens": 2000,
                       "messages": [{"role": "user", "content": LONG}]}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: memspec\r\nContent-Type: "
              b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    got = b""
    while got.count(b"data:") < 4:
        got += s.recv(65536)
    t0 = time.monotonic()
    s.close()
    while _running(port):
        time.sleep(0.005)
    freed = time.monotonic() - t0
    nxt = _chat(port, model, prompt, 4)
    return {"freed_s": freed, "next_first_token_s": freed + nxt["ttft_s"]}


def run(pool: str | None, n_prompts: int, max_new: int) -> dict[str, Any]:
    model = load_pool(pool).target.name
    prompts = dev_prompts(n_prompts)
    with tempfile.TemporaryDirectory(prefix="memspec-bench-http-") as tmp:
        _log("starting memspec up --http")
        up = _Up(pool, tmp)
        try:
            _chat(up.port, model, prompts[0], 2)  # warm: first draft loads, first ranking
            rows = []
            with Runtime(f"ipc://{tmp}/m.sock") as rt:
                settle(rt, "memspec up")
                for i, prompt in enumerate(prompts):
                    _log(f"prompt {i + 1}/{len(prompts)}")
                    gen = _generate(prompt, max_new, pool)
                    web = _chat(up.port, model, prompt, max_new)
                    api = _zmq(rt, prompt, max_new)
                    rows.append({"generate": gen, "http": web, "zmq": api,
                                 "same_text": gen["text"] == web["text"] == api["text"]})
            _log("disconnects")
            disc = [_disconnect(up.port, model, prompts[0]) for _ in range(3)]
        finally:
            up.stop()
    for r in rows:
        for way in ("generate", "http", "zmq"):
            r[way].pop("text")
    med = statistics.median
    return {"prompts": len(prompts), "max_new_tokens": max_new, "rows": rows,
            "generate_ttft_s": med(r["generate"]["ttft_s"] for r in rows),
            "http_ttft_s": med(r["http"]["ttft_s"] for r in rows),
            "zmq_ttft_s": med(r["zmq"]["ttft_s"] for r in rows),
            "generate_total_s": med(r["generate"]["total_s"] for r in rows),
            "http_total_s": med(r["http"]["total_s"] for r in rows),
            "disconnects": disc,
            "disconnect_freed_s": med(d["freed_s"] for d in disc),
            "disconnect_next_first_token_s": med(d["next_first_token_s"] for d in disc)}


def main_bench_http(args) -> int:
    res = run(args.pool, args.prompts, args.max_new_tokens)
    print(f"time to first token, median of {res['prompts']} prompts ({res['max_new_tokens']} "
          f"new tokens): memspec generate {res['generate_ttft_s']:.2f} s, HTTP (warm server) "
          f"{res['http_ttft_s'] * 1000:.0f} ms: {res['generate_ttft_s'] / res['http_ttft_s']:.0f}x; "
          f"Python API over ZeroMQ on the same server {res['zmq_ttft_s'] * 1000:.0f} ms "
          f"(HTTP / ZeroMQ {res['http_ttft_s'] / res['zmq_ttft_s']:.2f}x)")
    print(f"whole request: memspec generate {res['generate_total_s']:.2f} s, HTTP "
          f"{res['http_total_s']:.2f} s: {res['generate_total_s'] / res['http_total_s']:.1f}x")
    for i, r in enumerate(res["rows"]):
        g, h, z = r["generate"], r["http"], r["zmq"]
        print(f"  prompt {i}: generate first {g['ttft_s']:5.2f} s end {g['total_s']:5.2f} s | "
              f"HTTP first {h['ttft_s'] * 1000:4.0f} ms end {h['total_s']:5.2f} s "
              f"({h['tokens']} tokens) | ZeroMQ first {z['ttft_s'] * 1000:4.0f} ms end "
              f"{z['total_s']:5.2f} s | same text: {r['same_text']}")
    print(f"client disconnect mid-stream -> server free: {res['disconnect_freed_s'] * 1000:.0f} "
          f"ms; -> next request's first token: "
          f"{res['disconnect_next_first_token_s'] * 1000:.0f} ms (median of 3)")
    if args.json:
        res = {"provenance": result_provenance(args.pool), **res}  # what it measured
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0
