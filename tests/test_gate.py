"""The speculation gate: memspec runs the target alone when no draft pays for its iterations."""

from __future__ import annotations

import random

from memspec.common.config import load_pool
from memspec.procs.decoder.loadplan import PlanCosts
from memspec.procs.decoder.policies import MemSpec, SchedView, SpecGate, make_policy
from memspec.sim.costmodel import CostModel
from memspec.sim.simulate import SimConfig, SimRequest, simulate, simulate_traced
from memspec.zoo.tables import table_from_correct

DRAFTS = ("general", "code", "math", "law", "medical")
# a verify costs ~2.2 target steps: a draft must average > 2.2 tokens per iteration to pay
COSTS = PlanCosts.uniform(DRAFTS, 2.0, target=0.45, timed=True)


def cost() -> CostModel:
    return CostModel(spec_s={d: 0.09 for d in DRAFTS}, target_s=0.04, catchup_base_s=0.003,
                     catchup_per_token_s=2e-5, load_s={d: 0.1 for d in DRAFTS},
                     predict_s=0.025, snapshot_s=0.0003, sched_s=0.001, inner_s=0.0001)


def tables(p: float, seed: int = 0, length: int = 128) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {d: table_from_correct([rng.random() < p for _ in range(length)], 4) for d in DRAFTS}


def test_gate_passes_a_paying_draft_and_probes_a_losing_one_with_growing_gaps():
    gate = SpecGate(COSTS)
    assert gate.allow("code")  # optimistic before any iteration
    for _ in range(4):
        gate.observe("code", 4, 3)  # 4 tokens per iteration: pays
    assert all(gate.allow("code") for _ in range(10))
    slow = SpecGate(COSTS)
    for _ in range(12):
        slow.observe("law", 4, 0)  # 1 token per iteration: loses
    pattern = [slow.allow("law") for _ in range(4 + 1 + 8 + 1)]
    assert pattern == [False] * 4 + [True] + [False] * 8 + [True]
    assert not slow.allow(None)


def test_a_closed_gate_asks_for_fewer_rankings():
    """While closed, memspec asks for a ranking every 4th gated interval (a new top-1 may
    reopen it) and for the 2 intervals before a probe; a paying draft asks every interval."""
    slow = SpecGate(COSTS)
    for _ in range(12):
        slow.observe("law", 4, 0)
    asks = []
    for _ in range(4 + 1 + 8 + 1):
        slow.allow("law")
        asks.append(slow.wants_ranking())
    assert asks == [False] * 2 + [True] * 2 + [True] + [False] * 3 + [True] + [False] * 2 \
        + [True] * 2 + [True]
    fast = SpecGate(COSTS)
    for _ in range(4):
        fast.observe("code", 4, 3)
    assert all(fast.allow("code") and fast.wants_ranking() for _ in range(5))
    assert make_policy("memspec", costs=COSTS, gate=False).wants_ranking()
    assert not make_policy("mab-async").wants_ranking()


def test_the_loop_sends_no_snapshot_while_the_gate_is_closed():
    """In the simulator (the runtime's loop): with drafts that lose, memspec sends far fewer
    snapshots than intervals, and the predictor's slowdown is paid only while it encodes."""
    c = cost()
    c.predictor_slowdown = 0.5
    req = SimRequest("p", "x", 40, tables(0.2),
                     scores=lambda p: {d: 1.0 if d == "code" else 0.1 for d in DRAFTS})
    cfg = SimConfig(DRAFTS, "general", K=2, N=4, gamma=4, plan=c.plan_costs())
    s = simulate_traced("memspec", req, c, cfg, resident=["general", "code"])
    intervals = -(-len(s.trace.iterations) // 4)
    assert len(s.trace.rankings) <= intervals // 2
    slow = [it for it in s.trace.iterations if it.draft is None]
    durations = sorted({round(it.duration, 6) for it in slow})
    assert durations[0] == round(c.target_s, 6)  # target steps with the predictor at rest


def test_gate_is_off_until_the_target_step_is_timed():
    gate = SpecGate(PlanCosts.uniform(DRAFTS, 2.0, target=0.45))  # the prior, not measured
    for _ in range(8):
        gate.observe("code", 4, 0)
    assert gate.allow("code")
    assert SpecGate(None).allow("code")


def test_gated_interval_is_a_choice_not_a_fallback():
    view = SchedView(iteration=8, drafts=DRAFTS, general="general", capacity=2,
                     resident=frozenset({"code"}), loading=frozenset(), failed=frozenset(),
                     active="code", scores={"code": 1.0, "general": 0.5})
    pol = MemSpec(COSTS)
    for _ in range(12):
        pol.observe("code", 4, 0)
    d = pol.decide(view)
    assert d.run is None and d.preferred is None  # desired: not counted as fallback
    assert "general" in d.actions.prefetch  # the working set is still kept warm
    ungated = MemSpec(COSTS, gate=False)
    assert ungated.decide(view).run == "code"
    assert make_policy("memspec", costs=COSTS, gate=False).gate is None


def test_memspec_with_the_gate_is_not_slower_than_the_target_alone_when_drafts_lose():
    """Drafts that accept ~20% of proposals: speculating costs ~2x; the gate keeps memspec
    within ~15% of target-only (the probes, in a 128-token request) while ungated memspec
    pays it all."""
    c = cost()
    req = SimRequest("p", "x", 40, tables(0.2),
                     scores=lambda p: {d: 1.0 if d == "code" else 0.1 for d in DRAFTS})
    cfg = SimConfig(DRAFTS, "general", K=2, N=4, gamma=4, plan=c.plan_costs())
    steady = {}
    for name, gate in (("target-only", True), ("memspec", True), ("memspec", False)):
        s = simulate(name, req, c, SimConfig(**{**cfg.__dict__, "gate": gate}),
                     resident=["general", "code"])
        steady[(name, gate)] = s.summary()["tokens_per_s_steady"]
    assert steady[("memspec", True)] >= 0.85 * steady[("target-only", True)]
    assert steady[("memspec", False)] < 0.75 * steady[("target-only", True)]
    # the oracle may also choose the target alone: it still bounds gated memspec
    oracle = simulate("oracle-dynamic", req, c, cfg, resident=["general", "code"])
    assert oracle.summary()["tokens_per_s_steady"] >= 0.99 * steady[("memspec", True)]


def test_gate_never_stands_in_the_way_of_a_draft_that_pays():
    c = cost()
    req = SimRequest("p", "x", 40, tables(0.85, seed=3),
                     scores=lambda p: {d: 1.0 if d == "code" else 0.1 for d in DRAFTS})
    cfg = SimConfig(DRAFTS, "general", K=2, N=4, gamma=4, plan=c.plan_costs())
    on = simulate("memspec", req, c, cfg, resident=["general", "code"])
    off = simulate("memspec", req, c, SimConfig(**{**cfg.__dict__, "gate": False}),
                   resident=["general", "code"])
    assert [r.draft for r in on.records] == [r.draft for r in off.records]


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
    from memspec.procs.decoder.lookup import NgramIndex

    idx = NgramIndex(2, [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3])
    assert idx.propose([2, 3]) == 7  # most recent earlier "2 3" (the last is not indexed yet)
    assert idx.propose([9, 1, 2, 3]) == 7
    assert idx.propose([5, 1, 2, 3]) == 7  # longest match that exists: "1 2 3"
    assert idx.propose([3]) is None  # below n_min
    assert idx.propose([4, 4]) is None
    idx.extend([8])
    assert idx.propose([2, 3]) == 8  # the newest occurrence wins
