"""The scheduling loop (procs/decoder/sched/loop.py) with scripted fakes: no sockets, no models.

Each fake is the smallest honest stand-in: a clock that moves only when told, channels
that answer loads and snapshots on a script, slots that bind (or refuse to), and an
executor that replays acceptance tables, one second per iteration. The last test runs one
scenario through these fakes and through the simulator and asserts the same decisions.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Mapping

import pytest

from memspec.common.errors import ModelError
from memspec.common.messages import (
    Cancel,
    Load,
    Loaded,
    LoadFailed,
    Message,
    PeerRestarted,
    Ranking,
    Snapshot,
)
from memspec.common.metrics import IterationRecord, RunStats, Summary
from memspec.procs.decoder.oracle import oracle
from memspec.procs.decoder.oracle.oracle import make_plan
from memspec.procs.decoder.oracle.replay import step_accepted
from memspec.procs.decoder.sched.cache_manager import NO_ACTIONS
from memspec.procs.decoder.sched.gate import SpecGate
from memspec.procs.decoder.sched.loop import Controller, Job
from memspec.procs.decoder.sched.policies import Decision, SchedView, TargetOnly, make_policy
from memspec.sim.costmodel import CostModel
from memspec.sim.simulate import SimConfig, SimRequest, simulate_traced
from memspec.zoo.tables import table_from_correct

DRAFTS = ("general", "code", "math", "law", "medical")
GAMMA, N = 4, 4
Scores = Callable[[int], Mapping[str, float]]


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def overhead(self, kind: str) -> None:
        pass


class FakeChannels:
    """A loader that serves loads one at a time in issue order, `load_s` each (a cancel
    frees it at once), and a predictor that answers a snapshot at once with
    `scores(position)`. `auto=False`: only what a test puts in `replies` ever arrives."""

    def __init__(self, clock: FakeClock, load_s: float = 6.0, scores: Scores | None = None,
                 position: Callable[[], int] = lambda: 0, auto: bool = True) -> None:
        self.clock, self.load_s, self.scores, self.position = clock, load_s, scores, position
        self.auto = auto
        self.sent: list[Message] = []
        self.replies: deque[Message] = deque()
        self.loading: list[dict] = []  # {"load", "issued", "start", "done"}, in issue order
        self.free = 0.0  # when the loader finished (or dropped) its last load

    def send(self, msg: Message) -> None:
        self.sent.append(msg)
        if not self.auto:
            return
        now = self.clock.t
        if isinstance(msg, Load):
            self.loading.append({"load": msg, "issued": now, "start": None, "done": None})
        elif isinstance(msg, Cancel):
            for item in self.loading:
                if (item["load"].slot, item["load"].generation) == (msg.slot, msg.generation):
                    if item["start"] is not None and item["start"] <= now:
                        self.free = now  # it was running: the loader stops at once
                    self.loading.remove(item)
                    break
        elif isinstance(msg, Snapshot) and self.scores is not None:
            ranked = self.scores(self.position())
            self.replies.append(Ranking(msg.req_id, msg.seq, list(ranked),
                                        list(ranked.values()), 0.0))
        self._plan()

    def _plan(self) -> None:
        free = self.free
        for item in self.loading:
            if item["start"] is not None and item["start"] <= self.clock.t:
                free = item["done"]  # running: keeps its times
                continue
            item["start"] = max(free, item["issued"])
            item["done"] = free = item["start"] + self.load_s

    def poll(self, timeout_s: float) -> list[Message]:
        if timeout_s > 0 and not self.replies:
            due = [item["done"] for item in self.loading]
            self.clock.t = max(self.clock.t, min([self.clock.t + timeout_s, *due]))
        out = list(self.replies)
        self.replies.clear()
        for item in list(self.loading):
            if item["done"] <= self.clock.t:
                self.loading.remove(item)
                self.free = max(self.free, item["done"])
                ld = item["load"]
                out.append(Loaded(ld.slot, ld.generation, ld.draft, 100, self.load_s, ""))
        return out

    def heartbeat(self, state: str) -> None:
        pass

    def of(self, kind: type) -> list:
        return [m for m in self.sent if isinstance(m, kind)]


class FakeSlots:
    def __init__(self, broken: tuple[str, ...] = ()) -> None:
        self.broken = broken
        self.bound: dict[str, tuple[int, int]] = {}

    def load_request(self, slot: int, generation: int, draft: str) -> Load:
        return Load(slot, generation, draft, f"/drafts/{draft}", "shm", f"slot{slot}", 100)

    def bind(self, slot: int, generation: int, draft: str) -> None:
        if draft in self.broken:
            raise ModelError(f"draft '{draft}' has unexpected tensors", "rebuild it")
        self.bound[draft] = (slot, generation)

    def unbind(self, draft: str) -> None:
        self.bound.pop(draft)


class FakeExecutor:
    """Acceptance from tables; every iteration takes one second of the fake clock."""

    def __init__(self, clock: FakeClock, tables: Mapping[str, list[int]]) -> None:
        self.clock, self.tables = clock, tables
        self.length = min(len(t) for t in tables.values())
        self.stats = RunStats(prompt_tokens=10)
        self.pos = 0
        self.last: str | None = None

    @property
    def done(self) -> bool:
        return self.pos >= self.length

    def step(self, draft: str | None, desired: bool) -> IterationRecord:
        a = step_accepted(self.tables[draft], self.pos, GAMMA) if draft else 0
        emitted = min(a + 1, self.length - self.pos)
        rec = IterationRecord(draft, GAMMA if draft else 0, a, emitted, self.clock.t,
                              t_verify=1.0, desired=desired)
        if draft is not None and self.last not in (None, draft):
            self.stats.switches += 1
        self.last = draft or self.last
        self.clock.t += 1.0
        self.stats.records.append(rec)
        self.pos += emitted
        return rec

    def recent(self, n: int) -> list[int]:
        return list(range(max(0, self.pos - n), self.pos))


def tables(seed: int, length: int = 80) -> dict[str, list[int]]:
    """Each draft good in its own stretch of the trajectory: switching pays."""
    rng = random.Random(seed)
    out = {}
    for i, d in enumerate(DRAFTS):
        out[d] = table_from_correct([rng.random() < (0.8 if (p // 16) % 5 == i else 0.3)
                                     for p in range(length)], GAMMA)
    return out


def favourite(p: int) -> dict[str, float]:
    """A predictor that follows the trajectory's stretches (a little late)."""
    best = DRAFTS[(max(0, p - 4) // 16) % 5]
    return {d: 0.6 if d == best else 0.1 for d in DRAFTS}


def setup(capacity: int = 2, broken: tuple[str, ...] = (), auto: bool = True,
          scores: Scores | None = favourite, seed: int = 0):
    clock = FakeClock()
    ex = FakeExecutor(clock, tables(seed))
    ch = FakeChannels(clock, scores=scores, position=lambda: ex.pos, auto=auto)
    slots = FakeSlots(broken)
    ctl = Controller(DRAFTS, "general", capacity, N, 8, clock, ch, slots)
    return ctl, ch, slots, ex


def job(ex: FakeExecutor, policy: str, req_id: str = "r", trace: bool = False, **kw) -> Job:
    return Job(req_id, "a prompt", make_policy(policy, **kw), ex, 0.0, trace=trace)


def finish(ctl: Controller) -> Summary:
    while (out := ctl.step()) is None:
        pass
    return out


# --------------------------------------------------------------------------- messages


def test_rankings_older_than_the_newest_or_for_another_request_are_ignored():
    ctl, ch, _, ex = setup(scores=None, auto=False)
    ch.replies.append(Ranking("r", 0, ["code", "math"], [0.9, 0.1], 0.0))
    ctl.start(job(ex, "memspec"))
    assert ctl.scores == {"code": 0.9, "math": 0.1}  # the first ranking was waited for
    assert [m.seq for m in ch.of(Snapshot)] == [0] and ch.of(Snapshot)[0].recent_ids == []
    ctl.handle(Ranking("r", 3, ["math"], [1.0], 0.0))
    ctl.handle(Ranking("r", 2, ["law"], [1.0], 0.0))  # overtaken by seq 3
    ctl.handle(Ranking("other", 9, ["law"], [1.0], 0.0))  # not this request's
    assert ctl.scores == {"math": 1.0}
    ctl.handle(Ranking("r", 3, ["medical"], [1.0], 0.0))  # the same seq again: newer text
    assert ctl.scores == {"medical": 1.0}
    ctl.step()
    snaps = ch.of(Snapshot)
    assert [m.seq for m in snaps] == [0, 1] and snaps[1].recent_ids == ex.recent(8)
    finish(ctl)
    ctl.handle(Ranking("r", 10, ["law"], [1.0], 0.0))  # the request is over
    assert ctl.scores == {"medical": 1.0}


def test_no_first_ranking_costs_at_most_the_timeout():
    ctl, ch, _, ex = setup(scores=None, auto=False)
    ctl.start(job(ex, "memspec"))
    assert ctl.scores is None and ex.stats.t_prediction == pytest.approx(2.0)


def _chunked_prefill(ex: FakeExecutor, ch: FakeChannels, seen: list, ranked_after: int | None,
                     chunks: int = 4, chunk_s: float = 0.1):
    """A prefill of `chunks` chunks of `chunk_s`; the predictor's ranking of the prompt lands
    after chunk `ranked_after` (None: never). `seen` gets what went out by each call."""

    def prefill(between):
        seen.append(("between", between is not None))
        for i in range(chunks):
            ex.clock.t += chunk_s
            if i == ranked_after:
                ch.replies.append(Ranking("r", 0, list(DRAFTS), [0.1, 0.6, 0.1, 0.1, 0.1],
                                          0.8))
            if i < chunks - 1 and between is not None:
                more = between()
                seen.append((i, len(ch.of(Load)), more))
                if not more:
                    break
        ex.clock.t += chunk_s * (chunks - 1 - i)  # the rest in one piece
        return ex

    return prefill


def test_the_prompt_is_ranked_while_it_prefills():
    """memspec sends the prompt's snapshot and prefills at once: the initial loads go out
    between the two chunks where the ranking has landed, no time is booked as waiting for
    the predictor, and the trace keeps the predictor's own time for that ranking."""
    ctl, ch, _slots, ex = setup(scores=None, auto=False)
    seen: list = []
    ctl.start(Job("r", "a prompt", make_policy("memspec"), None, 0.0, trace=True,
                  prefill=_chunked_prefill(ex, ch, seen, ranked_after=1)))
    assert seen == [("between", True), (0, 0, True), (1, 2, False)]  # K = 2 slots filled
    assert ch.of(Load)[0].draft == "code"  # the predicted top-1 first
    assert ex.stats.t_prediction == 0.0 and ex.clock.t == pytest.approx(0.4)
    out = finish(ctl)
    assert out.trace.initial_prediction == 0.0 and out.trace.ranking_s == 0.8
    assert out.trace.uses_predictor


def test_a_ranking_later_than_the_prefill_is_waited_for_and_booked():
    ctl, ch, _slots, ex = setup(scores=None, auto=False)
    seen: list = []
    ctl.start(Job("r", "a prompt", make_policy("memspec"), None, 0.0,
                  prefill=_chunked_prefill(ex, ch, seen, ranked_after=None)))
    assert seen[-1] == (2, 0, True)  # asked for every chunk; nothing loaded yet
    assert ex.stats.t_prediction == pytest.approx(2.0)  # then the bounded wait
    assert ctl.scores is None and len(ch.of(Load)) == 1  # the first decision still went out


def test_a_silent_predictor_stops_the_chunking_after_half_a_second():
    ctl, ch, _slots, ex = setup(scores=None, auto=False)
    seen: list = []
    ctl.start(Job("r", "a prompt", make_policy("memspec"), None, 0.0,
                  prefill=_chunked_prefill(ex, ch, seen, None, chunks=6, chunk_s=0.2)))
    assert [x[2] for x in seen[1:]] == [True, True, False]  # asks at 0.2 and 0.4 s, not 0.6
    assert ex.stats.t_prediction == pytest.approx(2.0)  # then the bounded wait


def test_a_runner_that_cannot_chunk_gets_the_loads_before_its_prefill():
    """CUDA / PyTorch runners prefill in one piece (`Job.chunks` False): the loop waits for
    the ranking first, as Alg. 3 is written, so the loads still overlap the prefill."""
    ctl, ch, _slots, ex = setup(scores=None, auto=False)
    ch.replies.append(Ranking("r", 0, list(DRAFTS), [0.1, 0.6, 0.1, 0.1, 0.1], 0.8))
    seen: list = []
    ctl.start(Job("r", "a prompt", make_policy("memspec"), None, 0.0,
                  prefill=_chunked_prefill(ex, ch, seen, None), chunks=False))
    assert seen == [("between", False)] and ch.of(Load)[0].draft == "code"


def test_a_policy_without_the_predictor_loads_before_the_prefill():
    ctl, ch, _slots, ex = setup(scores=None, auto=False)
    seen: list = []
    ctl.start(Job("r", "a prompt", make_policy("general-static"), None, 0.0,
                  prefill=_chunked_prefill(ex, ch, seen, ranked_after=None)))
    assert seen == [("between", False)] and [m.draft for m in ch.of(Load)] == ["general"]
    assert not ch.of(Snapshot) and ex.stats.t_prediction == 0.0


def test_stale_and_mismatched_completions_are_ignored():
    ctl, ch, slots, _ = setup(auto=False)
    ctl.prefetch("code")
    first = ch.of(Load)[-1]
    ctl.evict("code")  # a cancel: the slot's generation moves on
    assert ch.of(Cancel)[-1] == Cancel(first.slot, first.generation)
    ctl.handle(Loaded(first.slot, first.generation, "code", 100, 0.1, ""))
    assert not slots.bound and not ctl.table.resident
    ctl.handle(LoadFailed(first.slot, first.generation, "code", "cancelled"))
    assert not ctl.table.failed  # a cancelled load is no failure
    ctl.prefetch("code")
    again = ch.of(Load)[-1]
    assert again.generation > first.generation
    for bad in (Loaded(again.slot, first.generation, "code", 100, 0.1, ""),  # older load
                Loaded(again.slot, again.generation, "math", 100, 0.1, ""),  # other draft
                Loaded(7, again.generation, "code", 100, 0.1, "")):  # no such slot
        ctl.handle(bad)
        assert not slots.bound and ctl.table.loading == {"code"}
    ctl.handle(Loaded(again.slot, again.generation, "code", 100, 0.1, ""))
    assert slots.bound == {"code": (again.slot, again.generation)}
    assert ctl.table.resident == {"code"}


def test_a_draft_that_fails_to_bind_or_load_is_quarantined():
    ctl, ch, slots, ex = setup(broken=("code",), auto=False)
    ctl.prefetch("code")
    ld = ch.of(Load)[-1]
    ctl.handle(Loaded(ld.slot, ld.generation, "code", 100, 0.1, ""))
    assert "unexpected tensors" in ctl.table.failed["code"]
    assert not ctl.table.resident and not ctl.table.loading  # the slot is free again
    ctl.prefetch("math")
    ld = ch.of(Load)[-1]
    ctl.handle(LoadFailed(ld.slot, ld.generation, "math", "checksum mismatch"))
    assert ctl.table.failed["math"] == "checksum mismatch"
    n = len(ch.of(Load))
    ctl.prefetch("code")
    ctl.prefetch("math")
    assert len(ch.of(Load)) == n  # never loaded again
    view = ctl.view(0, None)
    assert view.failed == {"code", "math"} and "code" not in view.usable()
    # a request whose predictor loves the quarantined drafts runs the others
    ctl2, ch2, _, ex2 = setup(broken=("code",))
    ctl2.table.failed.update(ctl.table.failed)
    ch2.scores = lambda p: {"code": 0.5, "math": 0.3, "law": 0.2}
    out = finish_started(ctl2, job(ex2, "memspec"))
    assert set(out.drafts_used) == {"law"} and out.quarantined.keys() == {"code", "math"}


def finish_started(ctl: Controller, j: Job) -> Summary:
    ctl.start(j)
    return finish(ctl)


def test_loads_in_flight_are_reissued_after_a_loader_restart():
    ctl, ch, slots, _ = setup(auto=False)
    ctl.prefetch("code")
    ctl.prefetch("math")
    old = ch.of(Load)
    ctl.handle(PeerRestarted("predictor", 5))  # nothing to redo for the predictor
    assert len(ch.of(Load)) == 2
    ctl.handle(PeerRestarted("loader", 6))
    new = ch.of(Load)[2:]
    assert sorted(m.draft for m in new) == ["code", "math"]
    assert all(n.generation > o.generation for o, n in zip(old, new))
    for m in old:  # the dead loader's answers are stale now
        ctl.handle(Loaded(m.slot, m.generation, m.draft, 100, 0.1, ""))
    assert not slots.bound
    for m in new:
        ctl.handle(Loaded(m.slot, m.generation, m.draft, 100, 0.1, ""))
    assert ctl.table.resident == {"code", "math"}


def test_a_blocking_wait_survives_a_loader_restart():
    """mab-sync waits for its draft; the loader dies and comes back; the re-issued load
    ends the wait (a wait that only the lost load could end would never return)."""
    ctl, ch, slots, ex = setup()
    restarted = []
    real_poll = ch.poll

    def poll(timeout_s: float) -> list[Message]:
        if ch.loading and not restarted:  # the loader dies with the load in flight
            ch.loading.clear()
            ch.free = ch.clock.t
            restarted.append(ch.clock.t)
            return [PeerRestarted("loader", 7)]
        return real_poll(timeout_s)

    ch.poll = poll  # type: ignore[method-assign]
    ctl.start(job(ex, "mab-sync"))
    ctl.step()
    assert restarted and ex.stats.records[0].draft == "general"
    assert len(ch.of(Load)) == 2 and ex.stats.t_load_wait == pytest.approx(6.0)


def test_giving_up_a_wait_when_nothing_can_be_loaded_or_the_load_fails():
    class WaitFor(TargetOnly):
        """Always wants `want`, waits for it, never frees a slot."""

        name, uses_predictor = "wait-for", False

        def __init__(self, want: str) -> None:
            self.want = want

        def decide(self, view: SchedView) -> Decision:
            return Decision(self.want, self.want, NO_ACTIONS, wait_for=self.want)

    # every slot holds a draft the policy does not evict: no wait at all, target alone
    ctl, ch, slots, ex = setup(capacity=1)
    ctl.prefetch("law")
    ctl.drain(10.0)
    assert ctl.table.resident == {"law"}
    ctl.start(Job("r", "p", WaitFor("code"), ex, 0.0))
    ctl.step()
    assert ex.stats.t_load_wait == 0.0 and ex.stats.records[0].draft is None
    assert not ex.stats.records[0].desired
    # the load fails during the wait: the wait ends there, the draft is quarantined
    ctl, ch, slots, ex = setup()
    real_poll = ch.poll

    def poll(timeout_s: float) -> list[Message]:
        out = real_poll(timeout_s)
        return [LoadFailed(m.slot, m.generation, m.draft, "read error") if isinstance(m, Loaded)
                else m for m in out]

    ch.poll = poll  # type: ignore[method-assign]
    ctl.start(Job("r", "p", WaitFor("code"), ex, 0.0, trace=True))
    out = finish(ctl)
    assert out.quarantined == {"code": "read error"}
    waits = [e for e in out.trace.loads if e.kind == "wait"]
    assert waits[0].seconds == pytest.approx(6.0) and all(w.seconds == 0 for w in waits[1:])
    assert out.drafts_used == {}


def test_abort_and_one_request_at_a_time():
    ctl, ch, _, ex = setup()
    ctl.start(job(ex, "general-static"))
    with pytest.raises(RuntimeError):
        ctl.start(job(ex, "general-static", req_id="second"))
    assert not ctl.abort("second") and ctl.abort("r") and ctl.running is None
    with pytest.raises(RuntimeError):
        ctl.step()


# --------------------------------------------------------------------------- runtime == sim


UNIT = CostModel(spec_s={d: 1.0 for d in DRAFTS}, target_s=1.0, catchup_base_s=0.0,
                 catchup_per_token_s=0.0, load_s={d: 6.0 for d in DRAFTS}, predict_s=0.0,
                 snapshot_s=0.0, sched_s=0.0)


@pytest.mark.parametrize("policy", ["memspec", "mab-async", "mab-sync", "prediction-only",
                                    "oracle-dynamic", "general-static"])
def test_the_simulator_makes_the_runtime_loops_decisions(policy, monkeypatch):
    """The same scenario through the loop with hand-written fakes and through the simulator
    (its event queue, table executor and cost model): identical loads, evictions, switches
    and drafts per interval, at identical times. (The ranking horizon is off: this short
    scenario is there to switch drafts.)"""
    monkeypatch.setattr(SpecGate, "RANK_HORIZON", 0)
    monkeypatch.setattr(oracle, "PLAN_BUDGET", None)  # (oracle-dynamic over every draft)
    tabs = tables(3)
    ctl, ch, slots, ex = setup(seed=3)
    plan = make_plan(policy, tabs, GAMMA, N, lambda: ex.pos)
    pol = make_policy(policy, oracle_plan=plan, gate_costs=UNIT.gate_costs())
    real = finish_started(ctl, Job("r", "p", pol, ex, 0.0, trace=True, max_new_tokens=10))
    req = SimRequest("r", "x", 10, tabs, scores=favourite)
    sim = simulate_traced(policy, req, UNIT, SimConfig(DRAFTS, "general", 2, N, GAMMA))

    def decisions(s: Summary) -> dict:
        its = s.trace.iterations
        return {"intervals": [(its[i].draft, its[i].desired, round(its[i].t_start, 9))
                              for i in range(0, len(its), N)],
                "accepted": [r.accepted for r in its],
                "residency": [(e.kind, e.draft, e.slot, round(e.t, 9)) for e in s.trace.loads],
                "counts": (s.loads, s.evictions, s.switches, s.generated_tokens)}

    assert decisions(real) == decisions(sim)
    assert real.time.decode == pytest.approx(sim.time.decode)
    if policy not in ("general-static",):
        assert len({d for d, *_ in decisions(real)["intervals"]}) > 2, "a scenario that switches"


def test_a_requests_thread_cap_holds_through_helper_changes_and_ends_with_it():
    """`Submit.threads` caps the decoder at once (before its prefill asks), whatever the
    helpers do; the next request without a cap gets every core back."""
    from memspec.procs.decoder.forward.threads import ThreadPlan

    set_to: list[int] = []
    plan = ThreadPlan(4, 3, apply=set_to.append)
    plan(False)
    plan.limit(1)
    plan(True)
    plan(False)
    assert set_to == [4, 1] and plan.current == 1
    plan.limit(None)
    assert set_to[-1] == 4
    plan(True)
    plan.limit(2)
    assert set_to[-2:] == [3, 2]


def test_threads_follow_the_helpers():
    """The decoder is told before every interval whether the predictor is encoding (a
    snapshot not answered yet, for at most SNAPSHOT_STALE_S) or the loader works (a load in
    flight); target-only with nothing loading keeps every core throughout."""
    from memspec.procs.decoder.sched.loop import SNAPSHOT_STALE_S

    told: list[bool] = []
    ctl, ch, slots, ex = setup(auto=False)
    ctl.on_helpers = told.append
    ctl.start(job(ex, "target-only"))
    finish(ctl)
    assert told and not any(told)

    def land_all() -> None:
        for slot in ctl.table.slots:
            if slot.state.name == "LOADING":
                ctl.table.release(slot)

    ctl, ch, slots, ex = setup(auto=False)
    ctl.on_helpers = told.append
    ctl.start(job(ex, "memspec", trace=True))  # the prompt's ranking never came: loads out
    assert ctl.table.loading and ctl.helpers_busy()
    land_all()
    assert not ctl.helpers_busy()
    run = ctl.running
    run.seq += 1
    run.t_sent = ctl.clock.now()  # a snapshot out, not answered: the predictor encodes
    assert ctl.helpers_busy()
    ch.replies.append(Ranking("r", run.seq, list(DRAFTS), [0.2] * 5, 0.01))
    ctl.drain()
    assert not ctl.helpers_busy()
    run.seq += 1
    run.t_sent = ctl.clock.now()
    ctl.clock.t += SNAPSHOT_STALE_S  # a predictor that does not answer is not waited on
    assert not ctl.helpers_busy()
    told.clear()
    ctl.prefetch("law")
    ctl.step()
    assert told == [True]  # told before the interval: a load is in flight
