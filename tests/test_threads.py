"""The decoder's threads follow the CPU that is free (procs/decoder/forward/threads.py), and the
forward's pool never waits for a thread that has not started (csrc/pool.h): the thread
count may change at any step, or a worker may never come, and no token changes."""

from __future__ import annotations

import itertools
import os
import threading

import pytest
import torch
from test_engine import PROMPTS, engine_with

from memspec.procs.decoder.forward.threads import (
    MAX_IDLE_WINDOW_S,
    CpuProbe,
    CpuShare,
    Reading,
    ThreadPlan,
    adaptive,
    apply_threads,
    native_pools,
)

MAIN, WORKER = 100, 101


def reading(t: float, main: float = 0.0, worker: float = 0.0, idle: float = 0.0) -> Reading:
    return Reading(t, {MAIN: main, WORKER: worker}, idle)


def test_a_shared_cpu_drops_a_thread_within_two_windows_and_a_free_one_gives_it_back():
    share = CpuShare(2)
    assert share.update(reading(0.0), 2) == 2
    # quiet: neither thread waits for a CPU
    assert share.update(reading(0.03, 0.001, 0.001), 2) == 2
    # a burst (a process starting) holds a core for one window: no change
    assert share.update(reading(0.06, 0.002, 0.011), 2) == 2
    assert share.update(reading(0.09, 0.002, 0.011), 2) == 2
    # another program takes a core: the worker waits a third of two windows in a row
    assert share.update(reading(0.12, 0.002, 0.021), 2) == 2
    assert share.update(reading(0.15, 0.002, 0.031), 2) == 1
    assert share.drops == 1
    # on one thread with the other core busy: no idle time, no restore however long
    t, idle = 0.15, 0.0
    for _ in range(20):
        t += 0.03
        assert share.update(reading(t, 0.002, 0.031, idle), 1) == 1
    # the program ends: the other core idles, and the thread is back within an idle window
    for _ in range(5):
        t += 0.03
        idle += 0.03
        n = share.update(reading(t, 0.002, 0.031, idle), 1)
    assert n == 2 and share.restores == 1
    assert [n for _, n in share.history] == [1, 2]


def test_a_restore_taken_back_doubles_the_wait_for_the_next_one():
    share = CpuShare(2)
    share.update(reading(0.0), 2)
    share.update(reading(0.03, 0.0, 0.01), 2)
    share.update(reading(0.06, 0.0, 0.02), 2)  # drop
    assert share.allowed == 1
    t, idle, wait = 0.06, 0.0, 0.02
    restored: list[float] = []
    for _ in range(200):  # a program that runs in bursts: idle at one thread, waits at two
        t += 0.01
        running = share.allowed
        if running == 1:
            idle += 0.01
        else:
            wait += 0.005
        before = share.allowed
        share.update(reading(t, 0.0, wait, idle), running)
        if share.allowed > before:
            restored.append(t)
    gaps = [b - a for a, b in itertools.pairwise(restored)]
    assert len(gaps) >= 3 and gaps[-1] > 1.5 * gaps[0] and gaps[-1] >= MAX_IDLE_WINDOW_S
    # the program ends while the wait is at its longest: the thread is back within 0.5 s
    if share.allowed == 2:  # (taken back once more first: the program's last burst)
        t += 0.03
        wait += 0.02
        share.update(reading(t, 0.0, wait, idle), 2)
        t += 0.03
        wait += 0.02
        share.update(reading(t, 0.0, wait, idle), 2)
    assert share.allowed == 1
    ended = t
    while share.allowed == 1 and t < ended + 5:
        t += 0.01
        idle += 0.01
        share.update(reading(t, 0.0, wait, idle), 1)
    assert share.allowed == 2 and t - ended <= 0.5


def test_after_a_pause_every_core_is_tried_again():
    share = CpuShare(2)
    share.rest(reading(0.0))
    share.update(reading(0.03, 0.0, 0.01), 2)
    share.update(reading(0.06, 0.0, 0.02), 2)
    assert share.allowed == 1  # a program held a core during the request
    # between requests the decoder ran nothing: the next one starts on every core when no
    # other program is runnable, and the waits of its first windows decide again
    assert share.rest(reading(2.0)) == 2
    share.update(reading(2.03, 0.0, 0.02), 2)
    assert share.update(reading(2.06, 0.0, 0.03), 2) == 1
    # one program runnable as the next request starts: on the core it leaves
    assert share.rest(reading(4.0), others=1) == 1
    assert share.rest(reading(6.0), others=5) == 1
    assert share.rest(reading(8.0), others=0) == 2


def test_the_plan_takes_the_least_of_helpers_cap_and_free_cpu():
    set_to: list[int] = []
    m = {"t": 0.0, "wait": 0.0, "idle": 0.0}  # the machine, as the probe would read it

    class Probe:
        def read(self, tids):
            assert tids[0] == threading.get_native_id()
            return reading(m["t"], 0.0, m["wait"], m["idle"])

    plan = ThreadPlan(2, 1, Probe(), apply=set_to.append, tids=lambda: [WORKER],
                      clock=lambda: m["t"])

    def at(t: float, busy: bool = False, **kw: float) -> None:
        m.update(t=t, **kw)
        plan(busy)

    at(0.0)
    at(0.03)
    at(0.06, wait=0.02)  # the worker waits two thirds of a window: maybe a burst
    assert set_to == [2]
    at(0.09, wait=0.04)  # and of the next: the CPU is shared
    assert set_to == [2, 1] and plan.stats()["cpu_drops"] == 1
    at(0.12, busy=True)  # a helper works too: still one
    plan.limit(1)
    at(0.25, idle=0.12)  # the other core idled for the idle window: the CPU allows two...
    assert set_to == [2, 1] and plan.stats()["cpu_restores"] == 1
    plan.limit(None)  # ... and without the request's cap the plan takes them
    assert set_to == [2, 1, 2]


def test_the_environment_chooses_the_thread_policy(monkeypatch):
    from memspec.common.errors import ConfigError

    monkeypatch.delenv("MEMSPEC_DECODER_THREADS", raising=False)
    monkeypatch.delenv("MEMSPEC_THREAD_POLICY", raising=False)
    assert adaptive()
    monkeypatch.setenv("MEMSPEC_THREAD_POLICY", "static")
    assert not adaptive()
    monkeypatch.setenv("MEMSPEC_THREAD_POLICY", "fast")
    with pytest.raises(ConfigError, match="MEMSPEC_THREAD_POLICY"):
        adaptive()
    monkeypatch.setenv("MEMSPEC_THREAD_POLICY", "adaptive")
    monkeypatch.setenv("MEMSPEC_DECODER_THREADS", "1")
    assert not adaptive()  # a fixed count stays fixed


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
def test_the_probe_reads_this_threads_cpu_wait_and_the_idle_time():
    probe = CpuProbe()
    me = threading.get_native_id()
    a = probe.read([me, 999_999_999])  # a thread that is gone is left out
    b = probe.read([me])
    assert set(a.waits) == {me} and b.waits[me] >= a.waits[me] >= 0.0
    assert b.t >= a.t and b.idle >= a.idle >= 0.0
    assert probe.others_runnable() >= 0


def _native(tiny_dir, dtype):
    eng = engine_with(tiny_dir, ["self", "small"], gamma=3, dtype=dtype)
    if type(eng.target).__name__ != "NativeLM" or not native_pools():
        pytest.skip("the native forward cannot be built here")
    return eng


@pytest.mark.parametrize("dtype", ["int4", "int8", "bfloat16"])
def test_tokens_stay_identical_whatever_the_thread_count_does_mid_request(tiny_dir, dtype):
    eng = _native(tiny_dir, dtype)
    was = torch.get_num_threads()
    try:
        apply_threads(1)
        refs = [eng.generate(p, 40)[0] for p in PROMPTS]
        for draft in (None, "self", "small"):
            counts = itertools.cycle([2, 1, 3, 2, 2, 1])
            for prompt, ref in zip(PROMPTS, refs):
                out, _ = eng.generate(prompt, 40, select=lambda s, d=draft: d,
                                      tick=lambda c=counts: apply_threads(next(c)))
                assert out == ref
    finally:
        apply_threads(was)
        for ext in native_pools():
            ext.set_threads(0)


@pytest.mark.parametrize("dtype", ["int4", "bfloat16"])
def test_a_forward_never_waits_for_a_worker_that_does_not_come(tiny_dir, dtype):
    """Workers held back (as the scheduler holds a descheduled thread) join no job: every
    product, attention and verify finishes on the caller alone, with the same tokens. A
    pool that waited for its workers would hang here."""
    eng = _native(tiny_dir, dtype)
    exts = native_pools()
    try:
        apply_threads(2)
        refs = [eng.generate(p, 30, select=lambda s: "small")[0] for p in PROMPTS]
        before = [ext.pool_counters() for ext in exts]
        for ext in exts:
            ext.hold_workers(True)
        outs = [eng.generate(p, 30, select=lambda s: "small")[0] for p in PROMPTS]
    finally:
        for ext in exts:
            ext.hold_workers(False)
            ext.set_threads(0)
    assert outs == refs
    jobs = sum(ext.pool_counters()[0] - b[0] for ext, b in zip(exts, before))
    joins = sum(ext.pool_counters()[1] - b[1] for ext, b in zip(exts, before))
    assert jobs > 100 and joins == 0
