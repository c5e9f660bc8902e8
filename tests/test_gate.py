"""The speculation gate: memspec runs the target alone when no draft pays for its iterations,
from a decoder's first request on, and a closed gate costs nothing."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch
from test_controller import FakeChannels, FakeClock, FakeSlots
from test_engine import PROMPTS, engine_with

from memspec.common.config import load_pool
from memspec.common.metrics import IterationRecord
from memspec.procs.decoder.oracle.calibration import draft_gamma_s, measure_target
from memspec.procs.decoder.sched.costs import LOOKUP
from memspec.procs.decoder.sched.gate import GateCosts, SpecGate
from memspec.procs.decoder.sched.loop import Controller, Job
from memspec.procs.decoder.sched.policies import Gated, MemSpec, SchedView, make_policy
from memspec.procs.decoder.service import SessionExecutor
from memspec.sim.costmodel import CostModel
from memspec.sim.simulate import SimConfig, SimRequest, simulate, simulate_traced
from memspec.zoo.tables import table_from_correct

DRAFTS = ("general", "code", "math", "law", "medical")
# a target step 10 ms, a speculative iteration 22 ms: a draft must average > 2.2 tokens
COSTS = GateCosts(target=(0.010, 0.0), spec={d: (0.022, 0.0) for d in DRAFTS})


@pytest.fixture
def free_first_look(monkeypatch):
    """A machine where the pool's drafts could pay (break-even below PRIOR_TAU): each draft's
    first look is free, the mechanics these tests check."""
    monkeypatch.setattr(SpecGate, "PRIOR_TAU", 10**6)


def rec(draft, accepted, seconds, context=100):
    if draft is None:
        return IterationRecord(None, 0, 0, 1, 0.0, t_verify=seconds, context=context)
    return IterationRecord(draft, 4, accepted, accepted + 1, 0.0, t_verify=seconds,
                           context=context)


def cost() -> CostModel:
    return CostModel(spec_s={d: 0.09 for d in DRAFTS}, target_s=0.04, catchup_base_s=0.003,
                     catchup_per_token_s=2e-5, load_s={d: 0.1 for d in DRAFTS},
                     predict_s=0.025, snapshot_s=0.0003, sched_s=0.001, inner_s=0.0001)


def tables(p: float, seed: int = 0, length: int = 128) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {d: table_from_correct([rng.random() < p for _ in range(length)], 4) for d in DRAFTS}


def test_first_look_is_single_iterations_then_the_record_decides(free_first_look):
    gate = SpecGate(COSTS)
    assert gate.verdict("code") == "probe"  # nothing known: one iteration, not an interval
    gate.observe(rec("code", 3, 0.022))  # 4 tokens for 2.2 steps: pays
    assert all(gate.verdict("code") == "run" for _ in range(10))
    near = SpecGate(COSTS)  # near misses: looked at one iteration at a time, FIRST_LOOK in all
    for i in range(SpecGate.FIRST_LOOK):
        assert near.verdict("law") == "probe", i
        near.observe(rec("law", 1, 0.022))  # 2 tokens for 2.2 steps
    assert near.verdict("law") == "skip" and near.closed  # the record decides
    slow, looks = SpecGate(COSTS), 0
    while slow.verdict("law") == "probe":
        looks += 1
        slow.observe(rec("law", 0, 0.022))  # 1 token an iteration: pays on no machine
    assert looks <= 2 and slow.closed  # two looks without a token end the first look


def test_iterations_beside_a_load_price_nothing(free_first_look):
    """A draft's iterations on fewer cores (a load in flight: `shared`) keep their tokens in
    its record but not their time: three of them at twice the iteration's cost would price
    a draft that pays at 2.4 tokens out of the request; unshared, the same timings do."""
    def run(shared: bool) -> SpecGate:
        gate = SpecGate(COSTS)  # break-even 2.2 tokens at 22 ms an iteration
        gate.verdict("code")
        for _ in range(3):
            r = rec("code", 2, 0.044)  # 3 tokens an iteration
            r.shared = shared
            gate.observe(r)
        return gate

    assert run(shared=True).pays("code")
    assert not run(shared=False).pays("code")


def test_no_free_look_where_the_pools_drafts_cannot_pay(monkeypatch):
    """Where an iteration costs more target steps than the pool's drafts bring on dev
    (PRIOR_TAU), a request's first look is not free: the target runs alone until the probe
    share affords a look. Where iterations are cheap, the first look comes at once."""
    monkeypatch.setattr(SpecGate, "PRIOR_TAU", 2.0)
    gate = SpecGate(COSTS)  # break-even 2.2 tokens per iteration
    assert gate.verdict("law") == "skip" and gate.closed
    steps = 0
    while gate.verdict("law") == "skip":
        for _ in range(4):
            gate.observe(rec(None, 0, 0.010))
            steps += 1
    assert steps * 0.010 * SpecGate.PROBE_SHARE >= 0.022 - 0.010  # paid from the share
    cheap = SpecGate(GateCosts(target=(0.010, 0.0), spec={"law": (0.015, 0.0)}))
    assert cheap.verdict("law") == "probe"  # break-even 1.5: the pool's drafts could pay


def test_a_paying_draft_is_found_by_the_share_where_looks_are_not_free(monkeypatch):
    """No free first look (break-even above PRIOR_TAU) does not shut out a draft that pays:
    a budgeted probe finds it, and from then on it runs."""
    monkeypatch.setattr(SpecGate, "PRIOR_TAU", 2.0)
    c = cost()  # an iteration 2.25 target steps
    req = SimRequest("p", "x", 40, tables(0.9, seed=3, length=600),
                     scores=lambda p: {d: 1.0 if d == "general" else 0.1 for d in DRAFTS})
    cfg = SimConfig(DRAFTS, "general", K=2, N=4, gamma=4, plan=c.plan_costs())
    on = simulate("memspec", req, c, cfg, resident=["general", "code"])
    drafts = [r.draft for r in on.records]
    assert drafts[0] is None  # nothing looked at for free
    first = drafts.index("general")
    assert all(d is not None for d in drafts[first + 1:first + 40])  # found: it runs


def test_a_running_draft_stops_inside_its_interval_once_it_no_longer_pays(monkeypatch):
    monkeypatch.setattr(SpecGate, "STOP_INSIDE", 8)  # the mechanism (tuned.json may turn it off)
    gate = SpecGate(COSTS)
    gate.verdict("code")
    gate.observe(rec("code", 4, 0.022))  # 5 tokens for 2.2 steps: runs
    assert gate.verdict("code") == "run" and gate.keeps("code")
    gate.observe(rec("code", 0, 0.022))  # (5 + 1) / 2 = 3: still pays
    assert gate.keeps("code")
    gate.observe(rec("code", 0, 0.022))
    gate.observe(rec("code", 0, 0.022))  # (5 + 1 + 1 + 1) / 4 = 2 < 2.2
    assert not gate.keeps("code")
    assert gate.verdict("code") != "run"


def test_probes_stay_within_two_percent_of_the_decode_time(monkeypatch):
    """A draft that never pays: after the first look, probes only while their worst-case
    extra cost (a probe that accepts nothing) stays within 2% of the time decoded, at a 1%
    share and a prior that gives no free look (the mechanism; tuned.json chooses them)."""
    monkeypatch.setattr(SpecGate, "PROBE_SHARE", 0.01)
    monkeypatch.setattr(SpecGate, "PRIOR_TAU", 2.0)
    gate = SpecGate(COSTS)
    probes, extra = 0, 0.0
    for _ in range(2000):  # intervals of 4 target steps, or one probe iteration
        v = gate.verdict("law")
        if v == "probe":
            probes += 1
            extra += 0.022 - 0.010
            gate.observe(rec("law", 0, 0.022))
        else:
            assert v == "skip"
            for _ in range(4):
                gate.observe(rec(None, 0, 0.010))
    assert probes > 5  # it keeps looking...
    assert extra <= 0.02 * gate.elapsed + 0.012 + 1e-9  # ...within its share (+ first look)


def test_a_probes_catch_up_on_the_tokens_it_missed_counts_in_its_share(free_first_look):
    """A probe after many target steps re-reads every token since the draft last ran (a
    head: 1% of a target step per token caught up on here); that catch-up is part of what the
    probe costs, so the probes of a draft that never pays still stay within the share."""
    gate = SpecGate(COSTS)
    probes, extra, context, seen, first = 0, 0.0, 100, 0, 0.0
    for _ in range(3000):
        v = gate.verdict("law")
        if v == "probe":
            behind = context - seen
            catch = 0.0001 * behind
            probes += 1
            extra += 0.022 - 0.010 + catch
            first = first or extra  # the first look (free: it also catches up on the prompt)
            gate.observe(IterationRecord("law", 4, 0, 1, 0.0, t_verify=0.022, t_catchup=catch,
                                         catchup_tokens=behind, context=context))
            seen = context
            context += 1
        else:
            for _ in range(4):
                gate.observe(rec(None, 0, 0.010, context))
                context += 1
    assert probes >= 2  # the first look, then what the share affords
    assert extra <= SpecGate.PROBE_SHARE * gate.elapsed + first + 1e-9  # (<= 2%)


def test_a_busy_machine_never_makes_probes_free():
    """Other work on the machine makes single iterations many times slower (a target step
    of 10 ms taking 0.5 s): a draft that accepts nothing is still probed only within the
    share, counted at what a probe costs at least (the calibration's extra)."""
    gate, rng = SpecGate(COSTS), random.Random(0)
    probes, extra = 0, 0.0

    def slow(seconds: float) -> float:
        return 0.5 if rng.random() < 0.15 else seconds

    for _ in range(2000):
        v = gate.verdict("law")
        assert v != "run"
        if v == "probe":
            probes += 1
            extra += 0.022 - 0.010
            gate.observe(rec("law", 0, slow(0.022)))
        else:
            for _ in range(4):
                gate.observe(rec(None, 0, slow(0.010)))
    assert probes > 5
    assert extra <= 0.02 * gate.elapsed + 0.012 + 1e-9


def test_costs_grow_with_the_context():
    """A draft that pays at a short context stops paying where the verify's attention
    makes an iteration dearer than its tokens."""
    costs = GateCosts(target=(0.010, 1e-6), spec={"code": (0.018, 1.2e-5)})
    gate = SpecGate(costs)
    gate.observe(rec("code", 1, 0.018 + 1.2e-5 * 100, context=100))
    for _ in range(20):
        gate.observe(rec("code", 1, 0.018 + 1.2e-5 * 100, context=100))  # 2 tokens: pays
    assert gate.verdict("code") == "run"
    for _ in range(20):  # same draft, same acceptance, context 1500: 2 tokens do not pay
        gate.observe(rec("code", 1, 0.018 + 1.2e-5 * 1500, context=1500))
    assert gate.verdict("code") == "skip"


def test_measured_costs_override_the_calibration_within_the_request():
    """Calibration said iterations are cheap; this request's own iterations say otherwise
    (e.g. the predictor shares the cores): the gate follows what it measures."""
    gate = SpecGate(GateCosts(target=(0.010, 0.0), spec={"code": (0.012, 0.0)}))
    for _ in range(8):
        gate.observe(rec("code", 1, 0.030))  # 2 tokens per 3 steps, measured
        gate.observe(rec(None, 0, 0.010))
    assert gate.verdict("code") == "skip"


def test_a_closed_gate_rests_the_predictor_and_its_loads(free_first_look):
    view = SchedView(iteration=8, drafts=DRAFTS, general="general", capacity=2,
                     resident=frozenset({"code"}), loading=frozenset(), failed=frozenset(),
                     active="code", scores={"code": 1.0, "general": 0.5})
    pol = make_policy("memspec", gate_costs=COSTS)
    assert isinstance(pol, Gated)
    d = pol.decide(view)
    for _ in range(SpecGate.FIRST_LOOK):  # first look: misses, until the gate closes
        if d.run is None:
            break
        pol.observe_iteration(rec("code", 0, 0.022))
        d = pol.decide(view)
    assert d.run is None and d.preferred is None  # desired: not counted as fallback
    assert d.actions.prefetch == ()  # the working set's other draft is not loaded now
    assert not pol.wants_ranking()
    ungated = make_policy("memspec", gate_costs=COSTS, gate=False)
    assert isinstance(ungated, MemSpec) and ungated.decide(view).run == "code"
    assert make_policy("memspec").wants_ranking()
    assert not make_policy("mab-async").wants_ranking()


def test_the_loop_sends_no_snapshot_while_the_gate_is_closed():
    """In the simulator (the runtime's loop): with drafts that lose, memspec sends far fewer
    snapshots than intervals, and target steps run with the predictor at rest."""
    c = cost()
    c.predictor_slowdown = 0.5
    req = SimRequest("p", "x", 40, tables(0.2),
                     scores=lambda p: {d: 1.0 if d == "code" else 0.1 for d in DRAFTS})
    cfg = SimConfig(DRAFTS, "general", K=2, N=4, gamma=4, plan=c.plan_costs())
    s = simulate_traced("memspec", req, c, cfg, resident=["general", "code"])
    intervals = -(-len(s.trace.iterations) // 4)
    assert len(s.trace.rankings) <= intervals // 4
    slow = [it for it in s.trace.iterations if it.draft is None]
    durations = sorted({round(it.duration, 6) for it in slow})
    assert durations[0] == round(c.target_cost(slow[0].context), 6)


def test_memspec_with_the_gate_is_not_slower_than_the_target_alone_when_drafts_lose():
    """Drafts that accept ~20% of proposals: speculating costs ~2x; the gate keeps memspec
    within 4.5% of target-only (a 2-iteration first look and the probes' 2%, the worst case:
    a near-useless draft at 2.25 target steps an iteration) while ungated memspec pays it
    all."""
    c = cost()
    req = SimRequest("p", "x", 40, tables(0.2),
                     scores=lambda p: {d: 1.0 if d == "code" else 0.1 for d in DRAFTS})
    cfg = SimConfig(DRAFTS, "general", K=2, N=4, gamma=4, plan=c.plan_costs())
    steady = {}
    for name, gate in (("target-only", True), ("memspec", True), ("memspec", False)):
        s = simulate(name, req, c, SimConfig(**{**cfg.__dict__, "gate": gate}),
                     resident=["general", "code"])
        steady[(name, gate)] = s.summary()["tokens_per_s_steady"]
    assert steady[("memspec", True)] >= 0.955 * steady[("target-only", True)]
    assert steady[("memspec", False)] < 0.75 * steady[("target-only", True)]
    # the oracle may also choose the target alone: it still bounds gated memspec
    oracle = simulate("oracle-dynamic", req, c, cfg, resident=["general", "code"])
    assert oracle.summary()["tokens_per_s_steady"] >= 0.99 * steady[("memspec", True)]


def test_gate_never_stands_in_the_way_of_a_draft_that_pays(free_first_look):
    """A paying draft runs as without the gate: a request long enough for a ranking to pay
    (RANK_HORIZON) has its prompt ranked at once, so the gated request runs the predicted
    draft from its first iteration, as the ungated one does."""
    c = cost()
    n = SpecGate.RANK_HORIZON + 200
    req = SimRequest("p", "x", n, tables(0.85, seed=3, length=n),
                     scores=lambda p: {d: 1.0 if d == "code" else 0.1 for d in DRAFTS})
    cfg = SimConfig(DRAFTS, "general", K=2, N=4, gamma=4, plan=c.plan_costs())
    on = simulate("memspec", req, c, cfg, resident=["general", "code"])
    off = simulate("memspec", req, c, SimConfig(**{**cfg.__dict__, "gate": False}),
                   resident=["general", "code"])
    assert [r.draft for r in on.records] == [r.draft for r in off.records]
    assert {r.draft for r in on.records} == {"code"}


def test_a_short_request_asks_for_no_ranking(free_first_look):
    """With fewer tokens to come than a switch needs to pay back (RANK_HORIZON) the gated
    request runs the resident draft that pays and leaves the predictor alone."""
    c = cost()
    req = SimRequest("p", "x", 40, tables(0.85, seed=3),
                     scores=lambda p: {d: 1.0 if d == "code" else 0.1 for d in DRAFTS})
    cfg = SimConfig(DRAFTS, "general", K=2, N=4, gamma=4, plan=c.plan_costs())
    on = simulate_traced("memspec", req, c, cfg, resident=["general", "code"])
    assert {r.draft for r in on.trace.iterations} == {"general"}
    assert on.snapshots == 0


def fresh_decoder_run(tiny_dir, draft, n, prompt, lookup=0):
    """One gated memspec request of 96 tokens on an int4 engine that has never run one (costs
    from its start-up calibration), `draft` resident: its executor, and target-only's
    tokens."""
    eng = engine_with(tiny_dir, [draft], dtype="int4", lookup=lookup)
    lines = measure_target(eng, eng.gamma)
    costs = GateCosts(target=lines["step"], verify=lines["verify"]).with_draft(
        draft, draft_gamma_s(eng, eng.drafts[draft], eng.gamma))
    ref, _ = eng.generate(prompt, 96)
    clock = FakeClock()
    channels = FakeChannels(clock, load_s=0.0, scores=lambda p: {draft: 1.0})
    ctl = Controller((draft,), draft, 1, n, 8, clock, channels, FakeSlots())
    ctl.prefetch(draft)
    ctl.drain(1.0)
    ex = SessionExecutor(eng.start(prompt, 96))
    ctl.start(Job("r", "p", make_policy("memspec", gate_costs=costs, lookup=bool(lookup)),
                  ex, 0.0))
    while ctl.step() is None:
        pass
    return ex, ref


def test_a_fresh_decoder_gates_a_wrong_draft_within_two_intervals(tiny_dir, free_first_look):
    """On an engine that has never run a request, with costs from the start-up calibration:
    a draft that proposes wrong tokens stops within two scheduling intervals of the first
    request (then only budgeted one-iteration probes), and the output is token-identical to
    target-only."""
    n, draft = 4, "random"
    ex, ref = fresh_decoder_run(tiny_dir, draft, n, PROMPTS[1])
    assert ex.session.generated == ref
    spec = [i for i, r in enumerate(ex.stats.records) if r.draft is not None]
    assert spec and spec[0] == 0  # it was looked at, from the first iteration on
    later = [i for i in spec if i >= 2 * n]  # after two intervals: budgeted probes only
    assert all(i - 1 not in spec for i in later) and len(later) <= 2, [(i, ex.stats.records[i].accepted, round(ex.stats.records[i].duration * 1e3, 3)) for i in spec]
    assert sum(r.accepted for r in ex.stats.records) <= len(spec)  # a wrong draft indeed


def test_the_engine_times_a_target_step_after_its_commit(tiny_dir):
    """Target steps and speculative iterations both stop their clock after committing (a
    streamed token costs the same in either)."""
    eng = engine_with(tiny_dir, ["self"], dtype="int4")
    committed = []

    def slow_stream(ids):
        committed.extend(ids)
        t = torch.ones(300, 300)
        for _ in range(40):
            t = t @ t.clamp(max=1.0)  # ~ms of work inside the commit

    s = eng.start(PROMPTS[0], 8, on_tokens=slow_stream)
    r = s.step(None)
    assert r.context == len(PROMPTS[0]) and committed
    quick = eng.start(PROMPTS[0], 8)
    assert r.duration > 2 * quick.step(None).duration


def test_pool_spec_gate_option_is_validated(tmp_path):
    text = (load_pool().source.read_text()).replace("[pool]", "[pool]\nspec_gate = 1", 1)
    bad = tmp_path / "pool.toml"
    bad.write_text(text)
    try:
        load_pool(bad, check=False)
    except Exception as exc:  # ConfigError: one line naming the key
        assert "spec_gate" in str(exc)
    else:
        raise AssertionError("spec_gate = 1 was accepted")
    assert load_pool().spec_gate is True


def test_ngram_index_proposes_the_latest_successor_of_the_longest_suffix():
    from memspec.procs.decoder.drafts.lookup import NgramIndex

    idx = NgramIndex(2, [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3])
    assert idx.propose([2, 3]) == 7  # most recent earlier "2 3" (the last is not indexed yet)
    assert idx.propose([9, 1, 2, 3]) == 7
    assert idx.propose([5, 1, 2, 3]) == 7  # longest match that exists: "1 2 3"
    assert idx.propose([3]) is None  # below n_min
    assert idx.propose([4, 4]) is None
    idx.extend([8])
    assert idx.propose([2, 3]) == 8  # the newest occurrence wins


def test_a_calibration_from_a_busier_machine_does_not_open_the_gate(free_first_look):
    """The cached calibration was taken while other work slowed everything 3x: a target
    step looks like 30 ms. This request's verifies run at their quiet cost, so the gate
    scales the target's calibrated cost down by the same ratio and closes a draft that
    brings 2 tokens for 2.6 target steps."""
    busy = GateCosts(target=(0.030, 0.0), verify=(0.042, 0.0), gamma=4)
    gate = SpecGate(busy)
    for _ in range(max(6, SpecGate.FIRST_LOOK)):  # quiet: a verify 14 ms (+ draft 12 ms),
        # as a 10 ms step would have it
        r = rec("law", 1, 0.026)
        r.t_verify, r.t_draft = 0.014, 0.012
        gate.observe(r)
    assert gate.target_s(100) == pytest.approx(0.010, rel=0.05)
    assert gate.verdict("law") == "skip"
    naive = SpecGate(GateCosts(target=(0.030, 0.0), verify=None))  # no verify line to compare
    for _ in range(max(6, SpecGate.FIRST_LOOK)):
        naive.observe(rec("law", 1, 0.026))
    assert naive.verdict("law") == "run"  # what the stale calibration alone would believe


def test_every_drafting_policy_gets_the_gate():
    """No baseline lacks a tool memspec has: the pool's spec_gate wraps every policy that
    runs drafts (oracle-dynamic plans the target alone itself); `gate=False` gives the
    ungated policy."""
    from memspec.procs.decoder.sched.policies import GATED, POLICY_NAMES

    for name in POLICY_NAMES:
        pol = make_policy(name, gate_costs=COSTS, oracle_plan=lambda v: "code")
        assert isinstance(pol, Gated) == (name in GATED), name
        assert not isinstance(make_policy(name, gate_costs=COSTS, gate=False,
                                          oracle_plan=lambda v: "code"), Gated)
    assert set(POLICY_NAMES) - set(GATED) == {"target-only", "lookup-only", "oracle-dynamic"}


def test_target_steps_slowed_by_a_helper_do_not_open_the_gate():
    """Target steps while a load is in flight run on fewer cores (or beside the loader's
    bursts): ~2x slower. Taken as the target's cost they would make a draft that brings 2
    tokens for 2.2 target steps look like it pays; the gate learns only from steps with the
    cores to themselves."""
    def slowed(shared: bool) -> SpecGate:
        gate = SpecGate(COSTS)
        for _ in range(8):
            r = rec(None, 0, 0.020)
            r.shared = shared
            gate.observe(r)
        for _ in range(SpecGate.FIRST_LOOK):
            gate.observe(rec("law", 1, 0.022))  # 2 tokens an iteration
        return gate

    assert slowed(True).verdict("law") == "skip"
    assert slowed(False).verdict("law") == "run"  # what the slowed steps alone would say


def test_a_closed_gate_loads_nothing_it_cannot_look_at(monkeypatch):
    """No draft resident and no look affordable yet (a machine where the first look is not
    free): memspec loads nothing, so no load takes a core from the target running alone."""
    monkeypatch.setattr(SpecGate, "PRIOR_TAU", 2.0)  # break-even 2.2: no free look
    view = SchedView(iteration=0, drafts=DRAFTS, general="general", capacity=2,
                     resident=frozenset(), loading=frozenset(), failed=frozenset(),
                     active=None, scores={"code": 1.0, "general": 0.5})
    pol = make_policy("memspec", gate_costs=COSTS)
    assert not pol.may_look(DRAFTS)  # so the request starts without a ranking
    d = pol.decide(view)
    assert d.run is None and d.actions.prefetch == ()
    assert d.preferred is None  # the target alone by choice, not a fallback
    cheap = make_policy("memspec", gate_costs=GateCosts(target=(0.010, 0.0),
                                                        spec={d: (0.015, 0.0) for d in DRAFTS}))
    assert cheap.decide(view).actions.prefetch  # a look is free there: its draft loads


def test_a_request_whose_gate_cannot_look_starts_without_a_ranking(monkeypatch):
    """Nothing resident and no look affordable: in the runtime's loop (simulated) memspec
    sends no snapshot at the start (the predictor would encode the prompt on a core the
    prefill needs), loads nothing, and books its target steps as chosen, not as fallback."""
    monkeypatch.setattr(SpecGate, "PRIOR_TAU", 2.0)
    monkeypatch.setattr(SpecGate, "PROBE_SHARE", 0.01)
    c = cost()  # an iteration 2.25 target steps
    req = SimRequest("p", "x", 40, tables(0.5), scores=lambda p: {d: 1.0 for d in DRAFTS})
    cfg = SimConfig(DRAFTS, "general", K=2, N=4, gamma=4, plan=c.plan_costs())
    s = simulate_traced("memspec", req, c, cfg, resident=[])
    assert s.snapshots == 0 and s.loads == 0 and not s.trace.rankings
    assert s.trace.iterations and all(it.draft is None and it.desired
                                      for it in s.trace.iterations)


def lookup_rec(proposed, accepted, seconds, context=100):
    return IterationRecord(LOOKUP, proposed, accepted, accepted + 1, 0.0, t_verify=seconds,
                           context=context)


def test_a_closed_gate_runs_the_context_lookup_while_it_pays(monkeypatch):
    """Where the target would run alone by choice, the context lookup runs instead (its
    iterations without a proposal are plain target steps); a lookup whose record stops
    paying for its wider verifies stops inside the interval and is skipped after that,
    once it is judged at all (the mechanism at a fixed LOOKUP_LOOKS; tuned.json chooses it,
    and as tuned, never: then it runs on, its proposal lengths weighing its cost)."""
    monkeypatch.setattr(SpecGate, "PRIOR_TAU", 2.0)  # drafts: no free look (break-even 2.2)
    monkeypatch.setattr(SpecGate, "LOOKUP_LOOKS", 8)
    monkeypatch.setattr(SpecGate, "LOOKUP_FAILING", None)
    view = SchedView(iteration=0, drafts=DRAFTS, general="general", capacity=2,
                     resident=frozenset(), loading=frozenset(), failed=frozenset(),
                     active=None, scores=None)
    costs = GateCosts(target=(0.010, 0.0), verify=(0.013, 0.0),
                      spec={d: (0.022, 0.0) for d in DRAFTS})
    assert make_policy("memspec", gate_costs=costs).decide(view).run is None  # no lookup
    pol = make_policy("memspec", gate_costs=costs, lookup=True)
    d = pol.decide(view)
    assert d.run == LOOKUP and d.preferred == LOOKUP  # chosen, not a fallback
    assert d.actions.prefetch == () and not pol.wants_ranking()
    for _ in range(20):  # no repeat in the context yet: target steps, nothing learnt
        pol.observe_iteration(lookup_rec(0, 0, 0.010))
        assert pol.keeps(LOOKUP)
    assert LOOKUP not in pol.gate.tau
    for _ in range(10):  # 3 tokens for 1.3 target steps: pays, and loads nothing
        pol.observe_iteration(lookup_rec(4, 2, 0.013))
        assert pol.keeps(LOOKUP)
    assert pol.decide(view).run == LOOKUP and not pol.wants_ranking()
    assert not pol.gate.any_paid()  # the lookup's record opens no draft's working set
    stopped = False
    for _ in range(40):  # the text stops repeating: 1 token for 1.3 steps
        pol.observe_iteration(lookup_rec(4, 0, 0.013))
        if not pol.keeps(LOOKUP):
            stopped = True
            break
    assert stopped
    d = pol.decide(view)
    assert d.run is None or d.run == LOOKUP and pol.gate.probing  # a probe at most
    # a draft that pays still runs: the lookup only stands in for the target alone
    paid = make_policy("memspec", gate_costs=costs, lookup=True)
    paid.gate.observe(rec("code", 3, 0.022))
    code = SchedView(iteration=4, drafts=DRAFTS, general="general", capacity=2,
                     resident=frozenset({"code"}), loading=frozenset(), failed=frozenset(),
                     active="code", scores={"code": 1.0})
    assert paid.decide(code).run == "code"


def test_a_fresh_decoder_with_the_lookup_stays_token_identical(tiny_dir, free_first_look):
    """The lookup standing in for the target alone (a wrong draft gated off) changes no
    token, and the wrong draft is still gated off within two intervals."""
    n, draft = 4, "random"
    ex, ref = fresh_decoder_run(tiny_dir, draft, n, PROMPTS[1] * 3, lookup=2)  # (repeats)
    assert ex.session.generated == ref
    recs = ex.stats.records
    assert any(r.draft == LOOKUP for r in recs)
    spec = [i for i, r in enumerate(recs) if r.draft == draft]
    later = [i for i in spec if i >= 2 * n]
    assert all(i - 1 not in spec for i in later) and len(later) <= 2


def _ranked_run(free: bool, rank_horizon: int | None):
    """A 40-token gated memspec request, general and code resident, the predictor ranking
    math first; datastores (`free`) or model drafts; the pool's ranking horizon."""
    c = cost()
    req = SimRequest("p", "x", 40, tables(0.85, seed=3),
                     scores=lambda p: {d: 1.0 if d == "math" else 0.1 for d in DRAFTS})
    gate_costs = replace(c.gate_costs(), free=frozenset(DRAFTS) if free else frozenset())
    cfg = SimConfig(DRAFTS, "general", K=2, N=4, gamma=4, plan=c.plan_costs(),
                    gate_costs=gate_costs, rank_horizon=rank_horizon)
    out = simulate_traced("memspec", req, c, cfg, resident=["general", "code"])
    return out.snapshots, [r.draft for r in out.trace.iterations]


def test_a_pool_horizon_under_the_request_ranks_the_prompt_and_a_datastore_loads_at_once(
        free_first_look):
    """A pool whose drafts differ enough sets a ranking horizon below its requests' length:
    the prompt is ranked although drafts are resident, and a datastore the ranking puts
    first (a 0.5 MB load, no catch-up) replaces a resident one before any draft has paid; a
    model draft is not loaded for a ranking before one has paid (its load and catch-up cost
    several iterations)."""
    snapshots, ran = _ranked_run(free=True, rank_horizon=16)
    assert snapshots >= 1 and "math" in ran[:4]  # within the first interval
    snapshots, ran = _ranked_run(free=False, rank_horizon=16)
    assert snapshots >= 1 and ran[:4] == ["code"] * 4  # the best resident, until one pays
    snapshots, ran = _ranked_run(free=True, rank_horizon=None)  # the tuned one: over 40
    assert snapshots == 0 and set(ran) == {"general"}


def test_a_calibration_from_a_busier_machine_scales_every_line_alike(free_first_look):
    """A calibration cached while the machine was loaded (steps 3x what this request
    measures) must not price an unmeasured draft at its stale line against the request's
    measured target: the ratio stays the calibration's, and a datastore (a verify at 1.5
    target steps) still gets its free first look."""
    slow = GateCosts(target=(0.030, 0.0), verify=(0.045, 0.0), free=frozenset({"code"}))
    gate = SpecGate(slow, lookup=True)
    for _ in range(3):  # this request's own target steps: 10 ms
        gate.observe(rec(None, 0, 0.010))
    assert gate.target_s(100) == pytest.approx(0.010)
    assert gate.spec_s("code", 100) == pytest.approx(0.015)
    assert gate.break_even("code") == pytest.approx(1.5)
    assert gate.verdict("code") == "probe"


def test_a_stale_calibration_scales_its_slope_too():
    """The same, 500 tokens in, where the stale calibration's slope is as steep as its
    intercept is high (the busier machine slowed attention too): the whole line scales, so
    a datastore's break-even is the calibration's ratio at that context, under PRIOR_TAU,
    and its first look is free. With only the intercept scaled it read 2.3 target steps
    here and the gate ran the target alone for the whole request (seen on the stores
    pool: a warm request after a calibration taken while the predictor loaded)."""
    slow = GateCosts(target=(0.024, 3e-5), verify=(0.034, 4e-5), free=frozenset({"code"}))
    gate = SpecGate(slow, lookup=True)
    for _ in range(3):  # this request's own target steps: a third of the calibration's
        gate.observe(rec(None, 0, (0.024 + 3e-5 * 500) / 3, context=500))
    ratio = (0.034 + 4e-5 * 500) / (0.024 + 3e-5 * 500)  # 1.38
    assert gate.scale() == pytest.approx(1 / 3, rel=0.01)  # (a token later)
    assert gate.break_even("code") == pytest.approx(ratio, rel=0.01)
    assert gate.break_even("code") < SpecGate.PRIOR_TAU
    assert gate.verdict("code") == "probe"


def store_rec(accepted: int, led: bool, seconds: float = 0.0075) -> IterationRecord:
    return IterationRecord("code", 4, accepted, accepted + 1, 0.0, t_verify=seconds,
                           context=100, store_led=led)


def test_a_store_whose_own_proposals_do_not_pay_gives_way_to_the_lookup(free_first_look):
    """Where the context repeats, a datastore draft proposes the lookup's tokens; only the
    iterations its own token led tell it from the lookup alone, and there the lookup would
    have run a target step. A store that pays overall only on the lookup's tokens runs the
    lookup instead (the interval ends, and the next runs the lookup); judged on its whole
    record until LED_LOOKS such iterations, and never without the lookup on."""
    from memspec.procs.decoder.sched.cache_manager import CacheActions
    from memspec.procs.decoder.sched.gate import gate_decision
    from memspec.procs.decoder.sched.policies import Decision

    costs = GateCosts(target=(0.005, 0.0), verify=(0.0075, 0.0), free=frozenset({"code"}))
    for lookup in (True, False):
        gate = SpecGate(costs, lookup=lookup)
        for i in range(8):  # the lookup's tokens: all accepted; the store's own: none
            gate.observe(store_rec(4 if i % 2 else 0, led=not i % 2))
        assert gate.tau["code"].value > gate.break_even("code")  # pays on its whole record
        assert gate.led["code"].n == 4 and gate.led["code"].value == 1.0
        assert gate.keeps("code") is not lookup  # inside its interval
        run = gate_decision(gate, Decision("code", "code", CacheActions()), resident=True).run
        assert run == (LOOKUP if lookup else "code")  # the next
    gate = SpecGate(costs, lookup=True)
    for _ in range(SpecGate.LED_LOOKS - 1):
        gate.observe(store_rec(0, led=True))
        gate.observe(store_rec(4, led=False))
    assert gate.store_pays("code")  # too few of its own to judge by
    gate.observe(store_rec(4, led=True))
    gate.observe(store_rec(3, led=True))
    assert gate.store_pays("code") and gate.verdict("code") == "run"


def test_the_lookup_runs_unjudged_through_its_first_proposals(free_first_look, monkeypatch):
    """The lookup costs nothing where the context does not repeat and pays in bursts: its
    first LOOKUP_LOOKS proposals run even where its record (here 1.5 tokens an iteration,
    under the 1.7 break-even) does not pay; after that it is gated like a draft (and one
    that pays runs on). One that accepts almost nothing stops after LOOKUP_FAILING's
    count: a context that repeats words but not what follows them (the mechanism, at
    fixed settings; tuned.json chooses them)."""
    monkeypatch.setattr(SpecGate, "LOOKUP_LOOKS", 32)
    monkeypatch.setattr(SpecGate, "LOOKUP_FAILING", (8, 1.25))
    monkeypatch.setattr(SpecGate, "PRIOR_TAU", 2.0)  # no free look, and too little probe share
    monkeypatch.setattr(SpecGate, "PROBE_SHARE", 0.01)  # for one yet: gated means not run
    costs = GateCosts(target=(0.005, 0.0), verify=(0.0085, 0.0))
    gate = SpecGate(costs, lookup=True)

    def look(accepted: int) -> IterationRecord:
        return IterationRecord(LOOKUP, 4, accepted, accepted + 1, 0.0, t_verify=0.0085,
                               context=100)

    for i in range(SpecGate.LOOKUP_LOOKS - 1):
        gate.observe(look(i % 2))  # 0.5 accepted a proposal
        assert gate.verdict(LOOKUP) == "run" and gate.keeps(LOOKUP)
    gate.observe(look(1))
    assert gate.verdict(LOOKUP) != "run" and not gate.keeps(LOOKUP)
    for _ in range(SpecGate.LOOKUP_LOOKS):
        gate.observe(look(4))
    assert gate.verdict(LOOKUP) == "run"
    failing = SpecGate(costs, lookup=True)
    looks, _ = SpecGate.LOOKUP_FAILING
    for _ in range(looks - 1):
        failing.observe(look(0))
        assert failing.verdict(LOOKUP) == "run"
    failing.observe(look(0))
    assert failing.verdict(LOOKUP) != "run" and not failing.keeps(LOOKUP)
    monkeypatch.setattr(SpecGate, "LOOKUP_FAILING", None)  # never gated early
    patient = SpecGate(costs, lookup=True)
    for _ in range(SpecGate.LOOKUP_LOOKS - 1):
        patient.observe(look(0))
        assert patient.verdict(LOOKUP) == "run"


def test_a_head_that_pays_stops_where_the_lookup_alone_was_faster(free_first_look):
    """With the lookup on, what the gate runs instead of a draft is the lookup: a head
    whose record pays against the target alone but brings fewer tokens a second than the
    lookup's record (LED_LOOKS proposals or more, paying) stops; with no such record, or
    a lookup that does not pay, the head is judged against the target as before."""
    costs = GateCosts(target=(0.005, 0.0), verify=(0.0085, 0.0),
                      spec={"general": (0.011, 0.0)})

    def look(accepted: int) -> IterationRecord:
        return IterationRecord(LOOKUP, 4, accepted, accepted + 1, 0.0, t_verify=0.0085,
                               context=100)

    gate = SpecGate(costs, lookup=True)
    for _ in range(8):
        gate.observe(rec("general", 2, 0.011))  # 3 tokens in 2.2 steps: pays on its own
    assert gate.pays("general")
    for _ in range(SpecGate.LED_LOOKS - 1):
        gate.observe(look(3))  # 4 tokens in 1.7 steps
    assert gate.pays("general")  # the lookup's record is too short to say yet
    gate.observe(look(3))
    assert gate.pays(LOOKUP) and not gate.pays("general") and gate.verdict("general") != "run"
    weak = SpecGate(costs, lookup=True)
    for _ in range(8):
        weak.observe(rec("general", 2, 0.011))
    for _ in range(2 * SpecGate.FIRST_LOOK):
        weak.observe(look(0))  # a lookup that does not pay: the head stands
    assert not weak.pays(LOOKUP) and weak.pays("general")
    assert SpecGate(costs).pays("general") is False  # (no record yet)


def test_with_lookup_first_a_head_is_judged_against_the_target_alone(free_first_look):
    """With LOOKUP_FIRST the engine runs the lookup wherever the context repeats, so a head
    runs only where the lookup has nothing: there it competes with a target step, and the
    lookup's record sets no bar. A probe of the head is booked by the head's own iteration,
    not by a lookup iteration the engine ran in its place."""
    costs = GateCosts(target=(0.005, 0.0), verify=(0.0085, 0.0),
                      spec={"general": (0.011, 0.0)})
    look = IterationRecord(LOOKUP, 4, 3, 4, 0.0, t_verify=0.0085, context=100)
    both = {first: SpecGate(costs, lookup=True, lookup_first=first) for first in (False, True)}
    for gate in both.values():
        for _ in range(8):
            gate.observe(rec("general", 2, 0.011))  # 3 tokens in 2.2 steps
        for _ in range(SpecGate.LED_LOOKS):
            gate.observe(look)  # 4 tokens in 1.7 steps
    assert not both[False].pays("general") and both[False].lookup_bar("general") > 3
    assert both[True].pays("general") and both[True].lookup_bar("general") == 0.0
    gate = SpecGate(costs, lookup=True, lookup_first=True)
    assert gate.verdict("general") == "probe"
    gate.observe(look)  # the engine's lookup iteration in the probe's place
    assert gate.probing and gate.probes == 0
    gate.observe(rec("general", 2, 0.011))
    assert not gate.probing and gate.probes == 1


def test_a_head_prior_keeps_two_bad_iterations_from_closing_a_head(monkeypatch):
    """With LOOKUP_FIRST a head serves the positions the lookup cannot, where one-token
    iterations are common. HEAD_PRIOR starts its record from dev's figure there: two such
    iterations no longer close a head that pays on average, a long bad record still does,
    and without LOOKUP_FIRST (or for the lookup itself) there is no prior."""
    monkeypatch.setattr(SpecGate, "HEAD_PRIOR", [1.65, 8])
    costs = GateCosts(target=(0.005, 0.0), verify=(0.0055, 0.0),
                      spec={"general": (0.007, 0.0)})  # break-even 1.4 tokens an iteration
    gates = {first: SpecGate(costs, lookup=True, lookup_first=first) for first in (False, True)}
    for gate in gates.values():
        for _ in range(2):
            gate.observe(rec("general", 0, 0.007))
    assert gates[True].pays("general") and gates[True].verdict("general") == "run"
    assert not gates[False].pays("general") and gates[False].verdict("general") != "run"
    gate = gates[True]
    for _ in range(30):
        gate.observe(rec("general", 0, 0.007))
    assert not gate.pays("general")
    gate.observe(IterationRecord(LOOKUP, 4, 3, 4, 0.0, t_verify=0.0055, context=100))
    assert gate.tau[LOOKUP].n == 1 and gate.tau[LOOKUP].value == 4.0


def test_no_free_look_at_a_head_that_cannot_beat_a_paying_lookup(monkeypatch):
    """A head's first look is free where the pool's drafts could pay (PRIOR_TAU), measured
    against the higher bar: the target alone, or a paying lookup's record in this request."""
    monkeypatch.setattr(SpecGate, "PRIOR_TAU", 2.0)
    costs = GateCosts(target=(0.005, 0.0), verify=(0.0085, 0.0),
                      spec={"general": (0.0095, 0.0)})  # break-even 1.9: under PRIOR_TAU
    gate = SpecGate(costs, lookup=True)
    assert gate.may_look("general")
    for _ in range(SpecGate.LED_LOOKS):
        gate.observe(IterationRecord(LOOKUP, 4, 3, 4, 0.0, t_verify=0.0085, context=100))
    assert gate.lookup_bar("general") == pytest.approx(4 * 0.0095 / 0.0085)
    assert not gate._free_look("general")


def test_two_target_steps_do_not_outweigh_many_verifies():
    """A request's target cost comes from its own target steps once it has three; with
    fewer, and three or more full verifies, from the calibration scaled by those verifies
    (a resident head looked at after two steps was priced on a stale step and paid on
    paper at 2.4 target steps an iteration)."""
    costs = GateCosts(target=(0.005, 0.0), verify=(0.008, 0.0), spec={"general": (0.012, 0.0)})
    gate = SpecGate(costs)
    gate.observe(rec(None, 0, 0.005))
    gate.observe(rec(None, 0, 0.005))
    assert gate.target_s(100) == pytest.approx(0.005)  # no verify yet: its own steps
    for _ in range(3):  # verifies at 0.6x the calibration's: this machine is faster now
        gate.observe(IterationRecord("general", 4, 1, 2, 0.0, t_verify=0.0048, context=100))
    assert gate.target_s(100) == pytest.approx(0.003)
    gate.observe(rec(None, 0, 0.004))  # a third step of its own: those decide again
    assert gate.target_s(100) == pytest.approx(0.005)


def test_a_calibration_cached_on_a_busy_machine_is_measured_again(tiny_dir, tmp_path,
                                                                   monkeypatch):
    """Lines cached while the machine was busy (a target step three times its cost) are
    re-measured by the next decoder that reads them, and the faster lines are kept; lines
    that the target still matches are read as they are."""
    from memspec.common.paths import HOME_ENV
    from memspec.procs.decoder.oracle.calibration import CONTEXTS, at, cache_key, gate_costs

    monkeypatch.setenv(HOME_ENV, str(tmp_path))
    eng = engine_with(tiny_dir, [], dtype="int4")
    pool = load_pool(check=False)
    first = gate_costs(eng, pool, "int4-test")  # (measured and cached)
    path = tmp_path / "calib" / f"{cache_key(eng, pool, 'int4-test')}.json"
    raw = json.loads(path.read_text())
    # a target timed now at what the line says reads the line as it is (the real step_now
    # is left to the slow line below: on a loaded machine two reads of a 0.1 ms step
    # differ by more than STALE, which made this check flaky beside the suite)
    from memspec.procs.decoder.oracle import calibration

    with monkeypatch.context() as m:
        m.setattr(calibration, "step_now", lambda engine: at(tuple(raw["step"]), CONTEXTS[0]))
        assert gate_costs(eng, pool, "int4-test").target == tuple(raw["step"])  # (read as is)
    slow = [3 * raw["step"][0] + 0.01, raw["step"][1]]
    path.write_text(json.dumps({**raw, "step": slow,
                                "verify": [3 * raw["verify"][0] + 0.02, raw["verify"][1]]}))
    again = gate_costs(eng, pool, "int4-test")
    assert at(again.target, CONTEXTS[0]) < at(tuple(slow), CONTEXTS[0]) / 2
    assert json.loads(path.read_text())["step"] != slow
    assert at(first.target, CONTEXTS[0]) > 0
    # the prefill's line comes with them, read back as cached (its slope is a timing: a
    # tiny model's 48- and 304-token prefills can time alike beside the suite's load)
    assert first.prefill is not None and min(first.prefill) >= 0 and sum(first.prefill) > 0
    assert again.prefill == tuple(json.loads(path.read_text())["prefill"])
