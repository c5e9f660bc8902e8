"""`from memspec import Runtime`: the runtime started in this process (its own three
processes), greedy output identical across policies, streaming, stop strings, clean exit.
The same API against a running `memspec up` is in test_http.py."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from test_pipeline import _ready_pool

from memspec import Result, Runtime
from memspec.common.errors import MemspecError, RequestError
from memspec.launch.client import Timeouts

PROMPT = "Name three primary colours."


def test_runtime_refuses_bad_use_in_one_line():
    with pytest.raises(MemspecError, match="not started"):
        Runtime().generate("x")
    with pytest.raises(MemspecError, match="endpoint or a pool"):
        Runtime("ipc:///nowhere", pool="pool.toml")
    t0 = time.monotonic()
    with pytest.raises(MemspecError):
        Runtime("ipc:///tmp/memspec-test-nobody-here.sock",
                timeouts=Timeouts(connect=0.5, first=0.5)).start()
    assert time.monotonic() - t0 < 5


def _children() -> set[int]:
    alive = set()
    for p in psutil.Process().children():
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.NoSuchProcess:
        return []


def test_runtime_in_this_process():
    _ready_pool()
    before = _children()
    with Runtime() as rt:
        kids = _children() - before
        standby = {k for k in kids if "--standby" in _cmdline(k)}  # once idle for a second
        assert len(kids - standby) == 3 and len(standby) <= 1  # decoder, loader, predictor
        ref = rt.generate(PROMPT, max_new_tokens=20, policy="target-only")
        assert isinstance(ref, Result) and ref.policy == "target-only"
        res = rt.generate(PROMPT, max_new_tokens=20)  # the pool's policy, drafts and all
        assert res.token_ids == ref.token_ids and res.text == ref.text
        stream = rt.stream([{"role": "user", "content": PROMPT}], max_new_tokens=20)
        assert "".join(stream) == ref.text and stream.result.token_ids == ref.token_ids
        words = ref.text.split()
        cut = rt.generate(PROMPT, max_new_tokens=20, stop=" " + words[1])
        assert cut.text == words[0] and cut.finish_reason == "stop"
        with pytest.raises(RequestError):
            rt.generate([{"role": "robot", "content": "x"}])
        assert rt.status().totals.requests["done"] == 4
        # a decoder crash mid-stream: the stream goes on on the restarted decoder
        longer = rt.generate(PROMPT, max_new_tokens=48, policy="target-only")
        decoder = rt.status().procs["decoder"].pid
        stream = rt.stream(PROMPT, max_new_tokens=48)
        text = next(stream)  # the first commit: the rest (>= 28 tokens) is still to come
        os.kill(decoder, signal.SIGKILL)
        text += "".join(stream)
        assert text == longer.text and stream.result.token_ids == longer.token_ids
        assert stream.result.stats.resumed == 1
        assert rt.status().procs["decoder"].pid != decoder
    deadline = time.monotonic() + 10
    while _children() - before:
        assert time.monotonic() < deadline, "the processes outlived the Runtime"
        time.sleep(0.05)


def test_runtime_without_a_standby_and_with_a_tuning_knob():
    """What the benchmarks start (bench/realruns.py, soak.py): no standby decoder however
    long the server idles (its start-up would land on a peer's timing), and the mab-*
    exploration constant passed per request; greedy output is still target-only's."""
    from memspec.launch.supervisor import STANDBY_IDLE_S

    _ready_pool()
    before = _children()
    with Runtime(standby=False) as rt:
        ref = rt.generate(PROMPT, max_new_tokens=12, policy="target-only")
        tuned = rt.generate(PROMPT, max_new_tokens=12, policy="mab-async", ucb_c=0.05)
        assert tuned.token_ids == ref.token_ids
        time.sleep(STANDBY_IDLE_S + 1.5)
        kids = _children() - before
        assert len(kids) == 3 and not any("--standby" in _cmdline(k) for k in kids)
        decoder = rt.status().procs["decoder"]
        assert decoder.standby_pid is None and decoder.bandwidth_bytes_s >= 0
