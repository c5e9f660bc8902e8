"""oracle-dynamic's plan (procs/decoder/oracle/loadplan.py): queued loads, binds, per-draft
iteration costs, the target alone, an exact search, and the upper bound it must be in the
simulator."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from memspec.common.config import load_pool
from memspec.common.errors import RequestError
from memspec.common.metrics import IterationRecord
from memspec.common.paths import DEFAULT_POOL
from memspec.procs.decoder.drafts.lookup import lookup_table
from memspec.procs.decoder.oracle import oracle
from memspec.procs.decoder.oracle.loadplan import Key, LoadPlanner, State, Step
from memspec.procs.decoder.oracle.oracle import (
    CALIBRATED_CONTEXT,
    DynamicPlan,
    PlanCostMeter,
    Traced,
    make_plan,
    plan_costs,
    prompt_tables,
)
from memspec.procs.decoder.sched.costs import LOOKUP, PlanCosts
from memspec.procs.decoder.sched.gate import GateCosts
from memspec.sim.costmodel import CostModel
from memspec.sim.simulate import SimConfig, SimRequest, simulate, simulate_traced
from memspec.zoo.stores import store_walk
from memspec.zoo.tables import table_from_correct

ONLINE = ("target-only", "general-static", "mab-sync", "mab-async", "prediction-only",
          "memspec")


def table(good, n: int = 64) -> list[int]:
    """A draft that proposes the right tokens exactly where `good(position)`."""
    return table_from_correct([good(p) for p in range(n)], 4)


def cost_model(drafts, **kw) -> CostModel:
    base = dict(spec_s={d: 0.1 for d in drafts}, target_s=0.05, catchup_base_s=0.0,
                catchup_per_token_s=0.0, load_s={d: 0.3 for d in drafts}, predict_s=0.02,
                snapshot_s=0.0, sched_s=0.0, inner_s=0.0)
    return CostModel(**{**base, **kw})


def walk(planner: LoadPlanner, state: State) -> list[tuple[State, Step]]:
    """The plan from `state` to the end, as the planner expects it to unfold."""
    out = []
    while state[0] < planner.n:
        move = planner.step(state)
        out.append((state, move))
        state = planner.after(state, move)
    return out


def cold(planner: LoadPlanner) -> list[tuple[State, Step]]:
    """The plan from request start (the opening move first, before its prefill)."""
    first = planner.initial()
    start = planner.state(0, None, frozenset())
    return [(start, first), *walk(planner, planner.opened(frozenset(), first))]


class OneAtATime(LoadPlanner):
    """The plan as it was: nothing queued behind a load in flight."""

    def successors(self, key: Key):
        return [s for s in super().successors(key)
                if not s[0][1] or (key[4] < 0 and len(s[0][1]) == 1)]


# ---------------------------------------------------------------------------- load queue


SPLIT = {"a": table(lambda p: p < 8), "b": table(lambda p: p >= 8)}  # a early, b after
SPLIT_COSTS = PlanCosts.uniform(("a", "b"), 3.0, target=0.8, switch=0.0, bind=1.0)


def test_a_second_load_is_queued_behind_the_first_when_that_is_faster():
    """a is needed first and b soon after: the plan queues b while a is still loading (the
    loader starts it the moment a lands, not after a's bind and the next decision), and
    that beats every plan that waits for a load to land before issuing the next."""
    planner = LoadPlanner(SPLIT, 4, 4, 2, SPLIT_COSTS)
    steps = cold(planner)
    queued = [(state, move) for state, move in steps if move.loads and state[3]]
    assert queued and queued[0][1].loads == ("b",) and queued[0][0][3][0][0] == "a"
    one = OneAtATime(SPLIT, 4, 4, 2, SPLIT_COSTS).initial().value
    assert planner.initial().value < one - 1.0


def test_the_simulated_loader_gets_the_second_load_before_the_first_lands(monkeypatch):
    monkeypatch.setattr(oracle, "PLAN_BUDGET", None)  # (a plan over both drafts)
    c = cost_model(("a", "b"), target_s=0.08, bind_s=0.1)
    cfg = SimConfig(("a", "b"), "a", K=2, N=4, gamma=4, plan=c.plan_costs())
    s = simulate_traced("oracle-dynamic", SimRequest("p", "x", 20, SPLIT), c, cfg)
    events = [(ev.kind, ev.draft) for ev in s.trace.loads if ev.kind in ("load", "loaded")]
    assert events == [("load", "a"), ("load", "b"), ("loaded", "a"), ("loaded", "b")]
    assert {r.draft for r in s.trace.iterations} >= {"a", "b"}


def test_no_more_than_K_loads_and_residents():
    """A queued load holds its slot: resident + queued never exceed K."""
    tabs = {d: table(lambda p, i=i: (p // 6) % 4 == i) for i, d in enumerate("abcd")}
    for K in (1, 2, 3):
        planner = LoadPlanner(tabs, 4, 2, K, PlanCosts.uniform(tuple(tabs), 2.0, target=0.6))
        for state, move in cold(planner):
            after = planner.after(state, move)
            assert len(after[2]) + len(after[3]) <= K, (K, state, move)


# ---------------------------------------------------------------------------------- binds


def test_binds_are_charged_per_landed_draft():
    """The same schedule with a dearer bind takes that much longer per draft it loads; a
    bind that costs more than a second draft saves is not paid."""
    tabs = {"a": table(lambda p: p < 40 or p % 3 != 0), "b": table(lambda p: p >= 32)}

    def plan(bind: float) -> tuple[float, list[str], list[str | None]]:
        planner = LoadPlanner(tabs, 4, 4, 2, PlanCosts.uniform(("a", "b"), 2.0, target=0.6,
                                                               bind=bind))
        steps = cold(planner)
        return (planner.initial().value, [d for _, m in steps for d in m.loads],
                [m.run for _, m in steps])

    cheap, dear, too_dear = plan(0.01), plan(1.0), plan(3.0)
    assert cheap[1] == dear[1] == ["a", "b"] and cheap[2] == dear[2]
    assert dear[0] == pytest.approx(cheap[0] + 2 * 0.99)
    assert too_dear[1] == ["a"] and "b" not in too_dear[2]


def test_the_cost_model_and_the_meter_carry_the_bind():
    c = cost_model(("a", "b"), bind_s=0.05, mean_iteration_s=0.1)
    assert c.plan_costs().bind == pytest.approx(0.5)
    meter = PlanCostMeter(PlanCosts.uniform(("a", "b"), 2.7))
    meter.observe([IterationRecord("a", 4, 2, 3, 0.0, t_draft=0.02, t_verify=0.08)] * 8)
    assert meter.costs({}).bind == 0.0  # no bind timed yet: the prior's
    meter.observe_binds(2, 0.06)
    assert meter.costs({}).bind == pytest.approx(0.3)


# -------------------------------------------------------------------- per-draft iterations


def test_a_costlier_draft_runs_less_at_equal_acceptance():
    """Two drafts that accept alike: the plan runs the one whose iteration is cheaper."""
    same = table(lambda p: p % 5 != 0)
    tabs = {"cheap": same, "dear": list(same)}
    costs = PlanCosts.uniform(tuple(tabs), 2.0, target=0.6, spec={"cheap": 1.0, "dear": 1.3})
    planner = LoadPlanner(tabs, 4, 4, 2, costs)
    runs = [m.run for _, m in walk(planner, planner.state(0, None, frozenset(tabs)))]
    assert "cheap" in runs and "dear" not in runs
    swapped = LoadPlanner(tabs, 4, 4, 2, replace(costs, spec={"cheap": 1.3, "dear": 1.0}))
    runs = [m.run for _, m in walk(swapped, swapped.state(0, None, frozenset(tabs)))]
    assert "dear" in runs and "cheap" not in runs


def test_per_draft_iteration_costs_reach_the_simulated_oracle():
    same = table(lambda p: p % 5 != 0)
    tabs = {"fast": same, "dear": list(same)}  # (ties would go to "dear": first by name)
    c = cost_model(tuple(tabs), spec_s={"fast": 0.1, "dear": 0.13})
    assert c.plan_costs().spec["dear"] / c.plan_costs().spec["fast"] == pytest.approx(1.3)
    cfg = SimConfig(tuple(tabs), "fast", K=2, N=4, gamma=4, gate=False, plan=c.plan_costs())
    s = simulate("oracle-dynamic", SimRequest("p", "x", 20, tabs), c, cfg,
                 resident=("dear", "fast"))
    assert {r.draft for r in s.records} - {None} == {"fast"}


def test_the_meter_prices_each_draft_and_the_context():
    """Each draft's iteration from its own timings (a line over the context shared by all),
    the target's on the same slope; drafts seen too little get every draft's."""
    prior = PlanCosts.uniform(("a", "b", "c"), 2.7)
    meter = PlanCostMeter(prior)
    recs = [IterationRecord(d, 4, 2, 3, 0.0, t_draft=base + 1e-4 * ctx, t_verify=0.0,
                            context=ctx)
            for d, base in (("a", 0.1), ("b", 0.13)) for ctx in range(100, 1700, 200)]
    recs += [IterationRecord(None, 0, 0, 1, 0.0, t_verify=0.05 + 1e-4 * ctx, context=ctx)
             for ctx in range(100, 900, 100)]
    meter.observe(recs)
    got = meter.costs({})
    unit = sum(r.duration for r in recs if r.draft) / 16
    assert got.per_token == pytest.approx(1e-4 / unit)
    assert got.spec["a"] == pytest.approx(0.1 / unit)
    assert got.spec["b"] == pytest.approx(0.13 / unit)
    assert got.spec["c"] == pytest.approx(0.115 / unit)
    assert got.target == pytest.approx(0.05 / unit)


# --------------------------------------------------------------------- the target alone


def test_the_target_alone_when_no_draft_pays():
    """Drafts that accept one token an iteration, at 2.5 target steps an iteration: the
    plan never speculates and loads nothing; in the simulator it is as fast as the target
    alone."""
    tabs = {d: table(lambda p: p % 2 == 0) for d in ("a", "b")}
    planner = LoadPlanner(tabs, 4, 4, 2, PlanCosts.uniform(("a", "b"), 2.0, target=0.4,
                                                           bind=0.1))
    steps = walk(planner, planner.state(0, None, frozenset({"a"})))
    assert all(m.run is None and not m.loads for _, m in steps)
    c = cost_model(("a", "b"), target_s=0.04, bind_s=0.01)
    cfg = SimConfig(("a", "b"), "a", K=2, N=4, gamma=4, plan=c.plan_costs())
    req = SimRequest("p", "x", 20, tabs)
    oracle = simulate("oracle-dynamic", req, c, cfg)
    assert all(r.draft is None for r in oracle.records) and oracle.loads == 0
    assert oracle.t_e2e <= simulate("target-only", req, c, cfg).t_e2e + 1e-12


def test_a_draft_resumed_after_target_steps_catches_up_on_what_it_missed():
    tabs = {"a": table(lambda p: True)}
    costs = PlanCosts.uniform(("a",), 2.0, switch=0.2, switch_per_token=0.01)
    planner = LoadPlanner(tabs, 4, 4, 1, costs, prompt_len=100)

    def run_a(behind: int) -> float:
        key = planner.coded(planner.state(8, "a", frozenset({"a"}), (), behind))
        return next(dt for code, _, dt in planner.successors(key)
                    if code[0] == 0 and code[5] == 4)

    assert run_a(12) - run_a(1) == pytest.approx(0.2 + 0.01 * 12)
    fresh = planner.coded(planner.state(8, None, frozenset({"a"})))
    assert next(dt for code, _, dt in planner.successors(fresh) if code[0] == 0
                and code[5] == 4) - run_a(1) == pytest.approx(0.2 + 0.01 * 108)


# ------------------------------------------------------------------ an exact search


def exhaustive(planner: LoadPlanner, key: Key, memo: dict[Key, float]) -> float:
    """Every move from every state: the dynamic programme the search must agree with."""
    if key[0] >= planner.n:
        return 0.0
    if key not in memo:
        memo[key] = min(dt + exhaustive(planner, nxt, memo)
                        for _, nxt, dt in planner.successors(key))
    return memo[key]


def striped(rng: random.Random, n: int, stretch: int) -> dict[str, list[int]]:
    """Three drafts good in alternating stretches, each right 80% of the time there."""
    return {d: table_from_correct([(p // stretch + i) % 2 == 0 and rng.random() < 0.8
                                   for p in range(n)], 4) for i, d in enumerate(("a", "b", "c"))}


@pytest.mark.parametrize("seed", range(4))
def test_the_search_finds_the_exhaustive_optimum(seed):
    rng = random.Random(seed)
    tabs = striped(rng, 28, 8)
    drafts = tuple(tabs)
    costs = PlanCosts(load={d: rng.uniform(0.5, 3.0) for d in drafts},
                      spec={d: rng.uniform(0.8, 1.2) for d in drafts},
                      target=rng.uniform(0.3, 0.6), switch=0.05, switch_per_token=0.002,
                      bind=rng.uniform(0.0, 1.0), per_token=0.001, overhead=0.02,
                      load_slowdown=0.05, prefill=rng.uniform(0.0, 2.0))
    planner = LoadPlanner(tabs, 4, rng.choice((2, 4)), rng.choice((1, 2)), costs, 20)
    memo: dict[Key, float] = {}
    opened = planner.opened(frozenset(), planner.initial())
    for state, move in walk(planner, opened):  # from every state the plan passes through
        assert move.value == pytest.approx(exhaustive(planner, planner.coded(state), memo))
    # and from states off its path (a late load, an unexpected residency)
    for state in (planner.state(3, None, frozenset({"b"}), (("c", 0.7),)),
                  planner.state(10, "a", frozenset({"a"}), (), 6)):
        assert planner.step(state).value == \
            pytest.approx(exhaustive(planner, planner.coded(state), memo))


@pytest.mark.parametrize("seed", (1, 2))
def test_the_search_bound_never_exceeds_what_is_left(seed):
    """A* is exact only under a bound that never overestimates: checked at every state of
    the exhaustive programme, loads queued near the end included (a load that lands in
    the last interval is never bound: a bound that charged it overestimated there)."""
    rng = random.Random(seed)
    tabs = striped(rng, 20, 6)
    drafts = tuple(tabs)
    costs = PlanCosts(load={d: rng.uniform(0.5, 3.0) for d in drafts},
                      spec={d: rng.uniform(0.8, 1.2) for d in drafts},
                      target=rng.uniform(0.3, 0.6), switch=0.05, switch_per_token=0.002,
                      bind=rng.uniform(0.1, 1.0), per_token=0.001, overhead=0.02, inner=0.01,
                      load_slowdown=0.05)
    planner = LoadPlanner(tabs, 4, 2, 3, costs, 20)
    memo: dict[Key, float] = {}
    for state in (planner.state(0, None, frozenset()),
                  planner.state(2, "a", frozenset({"a"}), (("b", 1.1), ("c", 2.0)))):
        exhaustive(planner, planner.coded(state), memo)
    assert all(planner._bound(key) <= left + 1e-9 for key, left in memo.items())


# ----------------------------------------------------------- the upper bound, simulated


def scenario(seed: int) -> tuple[SimRequest, CostModel, SimConfig]:
    """A small random request: drafts good in stretches, costs and pool shape drawn."""
    rng = random.Random(seed)
    drafts = ("general", "code", "math", "law", "medical")[:rng.choice((3, 4, 5))]
    n, stretch = rng.choice((40, 56)), rng.choice((12, 20, 100))
    rates = {d: [rng.uniform(0.15, 0.9) for _ in range(4)] for d in drafts}
    tabs = {d: table_from_correct([rng.random() < rates[d][(p // stretch) % 4]
                                   for p in range(n)], 4) for d in drafts}
    c = cost_model(drafts, spec_s={d: rng.uniform(0.07, 0.12) for d in drafts},
                   target_s=rng.uniform(0.03, 0.06), bind_s=rng.uniform(0.0, 0.1),
                   load_s={d: rng.uniform(0.05, 0.5) for d in drafts},
                   catchup_base_s=0.003, catchup_per_token_s=rng.uniform(0.0, 3e-4),
                   per_context_token_s=rng.uniform(0.0, 2e-4), sched_s=0.001,
                   inner_s=0.0001, load_slowdown=rng.uniform(0.0, 0.1),
                   prefill_per_token_s=rng.uniform(0.0, 2e-3))
    cfg = SimConfig(drafts, drafts[0], K=rng.choice((1, 2, 3)), N=rng.choice((1, 2, 4)),
                    gamma=4, plan=c.plan_costs())  # what the decoder's meter learns
    best = max(drafts, key=lambda d: sum(tabs[d]))
    scores = {d: 1.0 if d == best else 0.1 for d in drafts}
    return SimRequest("p", "x", rng.randint(10, 200), tabs, lambda _p: scores), c, cfg


@pytest.mark.parametrize("seed", range(12))
def test_oracle_dynamic_is_no_slower_end_to_end_than_any_online_policy(seed):
    """Cold start, prefill to reply: oracle-dynamic, with K loads queued, binds and each
    draft's iteration in its costs, is at least as fast as every online policy, with the
    speculation gate and without."""
    req, c, cfg = scenario(seed)
    oracle = simulate("oracle-dynamic", req, c, cfg).t_e2e
    for name in ONLINE:
        for gate in (True, False):
            other = simulate(name, req, c, replace(cfg, gate=gate)).t_e2e
            assert oracle <= other * (1 + 1e-9), (name, gate, oracle, other)


# -------------------------------------------------------------- a search within budget


def five_striped(seed: int) -> tuple[dict[str, list[int]], PlanCosts]:
    """Five drafts good in stretches and near-equal overall: the exact search's worst case."""
    rng = random.Random(seed)
    drafts = ("general", "code", "math", "law", "medical")
    tabs = {d: table_from_correct([(p // 8 + i) % 5 < 2 and rng.random() < 0.8
                                   for p in range(48)], 4) for i, d in enumerate(drafts)}
    costs = PlanCosts(load={d: rng.uniform(1.0, 2.5) for d in drafts}, target=0.7,
                      switch=0.05, bind=0.2, per_token=0.001, overhead=0.02, prefill=0.5)
    return tabs, costs


def test_a_search_past_its_budget_plans_over_the_drafts_best_alone():
    """Where the exact search over every draft outgrows its budget, oracle-dynamic plans
    over fewer: those that run the trajectory best alone, the best single draft always
    among them (so never slower than oracle-static in its own costs). Without a budget it
    is the exact plan over all of them."""
    tabs, costs = five_striped(0)
    exact = LoadPlanner(tabs, 4, 4, 2, costs, 20)
    best = exact.initial().value
    budget = exact.expanded // 3  # binds over all five
    free = DynamicPlan(tabs, 4, 4, 2, costs, lambda: 0, 20, budget=None)
    assert free.initial(frozenset()).value == pytest.approx(best)
    assert free.width == len(tabs)
    plan = DynamicPlan(tabs, 4, 4, 2, costs, lambda: 0, 20, budget=budget)
    value = plan.initial(frozenset()).value
    assert 1 <= plan.width < len(tabs)
    top = plan.order[0]
    alone = LoadPlanner({top: tabs[top]}, 4, 4, 2, costs, 20).initial().value
    assert best - 1e-9 <= value <= alone + 1e-9
    assert set(plan.planner.drafts) == set(plan.order[:plan.width])
    assert plan.width == 1 or plan.planner.expanded <= budget


def test_a_re_plan_past_its_budget_narrows_and_keeps_what_is_held():
    """A re-plan from a state the plan never expected may outgrow the budget: the planner
    narrows, and still counts the drafts resident or loading (their slots are taken)."""
    tabs, costs = five_striped(1)
    plan = DynamicPlan(tabs, 4, 4, 2, costs, lambda: 0, 20, budget=None)
    plan.initial(frozenset())
    assert plan.width == len(tabs)
    plan.planner.budget = plan.budget = 1  # no re-plan fits now
    held, loading = plan.order[-1], plan.order[-2]  # the drafts worst alone
    state = (5, held, frozenset({held}), ((loading, 0.5),), 0)
    move = plan.step(state)
    assert plan.width == 1  # narrowed down to the search without a budget
    assert {held, loading} <= set(plan.planner.drafts)
    after = plan.planner.after(plan.planner.state(*state), move)
    assert len(after[2]) + len(after[3]) <= 2


def test_a_plan_met_mid_request_is_budgeted_too():
    """A request the plan first sees mid-way (no opening move: a resumed one) re-plans
    under the budget like any other, narrowing as far as it must."""
    tabs, costs = five_striped(2)
    plan = DynamicPlan(tabs, 4, 4, 2, costs, lambda: 0, 20, budget=1)
    assert plan.planner.budget == 1
    move = plan.step((6, None, frozenset(), (), 0))
    assert plan.width == 1 and move.value > 0


# ------------------------------------------------------------ the context lookup's table


def test_the_lookup_table_is_what_the_engine_s_lookup_alone_gets_right():
    """`lookup_table` against the engine's walk with the lookup as its only draft
    (zoo.stores.store_walk, which chains proposals as Session._lookup_step does): where a
    lookup-only iteration starts, the table says whether it proposes and what it accepts."""
    rng = random.Random(3)
    phrase = [rng.randrange(50, 60) for _ in range(6)]
    prompt = [1, 2, *phrase, 3, 4]
    tokens = [rng.randrange(5, 40) if rng.random() < 0.6 else phrase[i % 6] for i in range(90)]
    tab = lookup_table(prompt, tokens, 4, 2)
    assert len(tab) == len(tokens) and any(a is None for a in tab) and any(tab)
    t = 0
    for proposed, accepted in store_walk(prompt, tokens, None, 4, 2):
        assert (tab[t] is None) == (proposed == 0)
        assert (tab[t] or 0) == accepted
        t += min(accepted + 1, len(tokens) - t)


def test_the_plan_runs_the_lookup_where_it_beats_every_draft():
    """A draft that accepts one token an iteration (two tokens) at 1.67 target steps pays
    against the target alone, so a plan that does not know the lookup runs it throughout;
    where the lookup proposes (at 1.17 target steps) and accepts three, the plan leaves the
    draft off there and runs it only where the lookup has nothing."""
    n = 64
    draft = table(lambda p: p % 2 == 0, n)
    look = [3 if p < 32 else None for p in range(n)]
    costs = PlanCosts(load={"a": 1.0}, spec={"a": 1.0, LOOKUP: 0.7}, target=0.6, switch=0.0)
    blind = walk(LoadPlanner({"a": draft}, 4, 4, 1, costs), (0, "a", frozenset({"a"}), (), 0))
    assert all(m.run == "a" for s, m in blind if s[0] < 60)  # (the last token: the target)
    seeing = LoadPlanner({"a": draft}, 4, 4, 1, costs, lookup=look)
    steps = walk(seeing, (0, "a", frozenset({"a"}), (), 0))
    inside = [m for s, m in steps if s[0] < 28]  # (one draft iteration at most: a tie)
    assert sum(m.run == "a" for m in inside) <= 1 and inside[-1].run is None
    assert all(m.run == "a" for s, m in steps if 36 <= s[0] < 60)
    assert steps[0][1].value < blind[0][1].value


def test_the_plan_turns_the_lookup_off_where_its_proposals_are_rejected():
    """A lookup verify costs more than a target step, so where the plan knows that the
    lookup's proposals are all rejected it asks for plain target steps (one at a time),
    and where they are accepted it runs the lookup; the plan is then faster than one that
    runs the lookup wherever it proposes."""
    n = 48
    look = [0 if p % 12 < 6 else 4 for p in range(n)]
    costs = PlanCosts(load={"a": 1.0}, spec={"a": 1.0, LOOKUP: 0.7}, target=0.4, switch=0.0)
    never = table(lambda p: False, n)
    planner = LoadPlanner({"a": never}, 4, 4, 1, costs, lookup=look)
    steps = walk(planner, planner.state(0, None, frozenset()))
    assert all(m.run is None for _, m in steps)
    assert all(m.lookup == (look[s[0]] != 0) for s, m in steps if s[0] < n - 1)
    assert not steps[-1][1].lookup  # (one token left: a step, not a verify)
    assert all(m.limit == 1 for _, m in steps if not m.lookup)
    on = LoadPlanner({"a": never}, 4, 4, 1, costs, lookup=look)
    on._alone = (-1,)  # (the plan as it was: the lookup wherever the target runs alone)
    assert steps[0][1].value < on.step(on.state(0, None, frozenset())).value - 1.0


def test_an_exact_lookup_is_priced_per_row_and_needs_no_plain_steps():
    """Where the runtime proposes exactly the lookup tokens the target accepts
    (`PlanCosts.row`), a rejected proposal costs nothing, so the plan never turns the
    lookup off; it prices each lookup verify as a step and a row per accepted token, and
    is faster than the plan that had to turn the lookup off to skip rejections."""
    n = 48
    look = [(0, 1, 4)[p % 12 // 4] for p in range(n)]  # rejected, one accepted, all
    costs = PlanCosts(load={"a": 1.0}, spec={"a": 1.0, LOOKUP: 0.7}, target=0.4, switch=0.0)
    never = table(lambda p: False, n)
    exact = LoadPlanner({"a": never}, 4, 4, 1, replace(costs, row=0.075), lookup=look)
    steps = walk(exact, exact.state(0, None, frozenset()))
    assert all(m.run is None and m.lookup for _, m in steps)
    p, want = 0, 0.0
    while p < n:
        a = min(look[p], 4, n - p)
        want, p = want + 0.4 + 0.075 * a, p + a + 1
    assert steps[0][1].value == pytest.approx(want)
    off = LoadPlanner({"a": never}, 4, 4, 1, costs, lookup=look)
    assert want < off.step(off.state(0, None, frozenset())).value - 1.0


def lookup_case(rng: random.Random, overhead: float
                ) -> tuple[dict[str, list[int]], list[int | None], PlanCosts]:
    """Striped drafts, a lookup that matches half the positions, and costs drawn."""
    tabs = striped(rng, 24, 6)
    look = [None if rng.random() < 0.5 else rng.randrange(0, 5) for _ in range(24)]
    drafts = tuple(tabs)
    costs = PlanCosts(load={d: rng.uniform(0.5, 3.0) for d in drafts},
                      spec={**{d: rng.uniform(0.8, 1.2) for d in drafts},
                            LOOKUP: rng.uniform(0.5, 0.8)},
                      target=rng.uniform(0.3, 0.6), switch=0.05, switch_per_token=0.002,
                      bind=rng.uniform(0.0, 1.0), per_token=0.001, overhead=overhead,
                      prefill=rng.uniform(0.0, 2.0))
    return tabs, look, costs


@pytest.mark.parametrize("seed", range(5))
def test_the_search_with_the_lookup_finds_the_exhaustive_optimum(seed):
    tabs, look, costs = lookup_case(random.Random(seed), 0.02)
    costs = replace(costs, row=(0.0, 0.0, 0.0, 0.05, 0.12)[seed],  # (exact proposals)
                    call={d: 0.04 for d in tabs} if seed >= 3 else {})
    planner = LoadPlanner(tabs, 4, 2, 2, costs, 20, lookup=look)
    memo: dict[Key, float] = {}
    opened = planner.opened(frozenset(), planner.initial())
    for state, move in walk(planner, opened):
        assert move.value == pytest.approx(exhaustive(planner, planner.coded(state), memo))
    assert all(planner._bound(key) <= left + 1e-9 for key, left in memo.items())


@pytest.mark.parametrize("seed", range(4))
def test_a_plan_that_settles_loses_nothing_against_every_later_load(seed):
    """A plan that leaves a slot free with the loader idle tries no later load
    (`LoadPlanner._declines`), whether or not loads slow the decoder. Its value at every state it passes
    through must still be the exhaustive optimum of the unrestricted programme, and the
    pruned search expands no more states."""
    rng = random.Random(seed)
    tabs, look, costs = lookup_case(rng, 0.0)
    costs = replace(costs, load_slowdown=(0.0, 0.0, 0.2, 0.5)[seed],
                    prefill_slowdown=(0.0, 0.3, 0.0, 0.5)[seed])
    K = rng.choice((1, 2, 3))
    pruned = LoadPlanner(tabs, 4, 2, K, costs, 20, lookup=look)
    full = LoadPlanner(tabs, 4, 2, K, costs, 20, lookup=look, settle=False)
    memo: dict[Key, float] = {}
    opened = pruned.opened(frozenset(), pruned.initial())
    settled = 0
    for state, move in walk(pruned, opened):
        settled += state[5]
        key = full.coded((*state[:5], False))
        assert move.value == pytest.approx(exhaustive(full, key, memo))
    full.opened(frozenset(), full.initial())
    assert settled and pruned.expanded <= full.expanded


@pytest.mark.parametrize("seed", range(12))
def test_an_opening_that_loads_nothing_keeps_later_loads_where_the_prefill_is_slowed(seed):
    """A load during the prefill may cost more than one after it (`prefill_slowdown` above
    `load_slowdown`): an opening that loads nothing must still let the plan load later,
    so the opening's value is the unrestricted programme's."""
    rng = random.Random(100 + seed)
    tabs, look, costs = lookup_case(rng, 0.0)
    costs = replace(costs, prefill_slowdown=rng.choice((0.5, 1.0)), load_slowdown=0.0,
                    prefill=rng.uniform(1.0, 4.0))
    K = rng.choice((1, 2))
    pruned = LoadPlanner(tabs, 4, 2, K, costs, 20, lookup=look)
    full = LoadPlanner(tabs, 4, 2, K, costs, 20, lookup=look, settle=False)
    assert pruned.initial().value == pytest.approx(full.initial().value)


def test_a_settled_state_with_a_load_in_flight_is_bounded_below_what_is_left():
    """The runtime can meet a settled plan with a load still in flight (one left from an
    earlier request): the bound must count that it may land and run."""
    tabs, look, costs = lookup_case(random.Random(7), 0.0)
    planner = LoadPlanner(tabs, 4, 2, 2, costs, 20, lookup=look)
    key = planner.coded(planner.state(0, "b", frozenset({"b"}), (("a", 1.0),), 1, True))
    assert planner._bound(key) <= exhaustive(planner, key, {}) + 1e-9


def test_make_plan_keeps_the_lookup_out_of_the_drafts():
    """The lookup's table reaches oracle-dynamic's planner, never a choice of draft: a
    lookup that accepts everything is not oracle-static's best "draft"."""
    tabs = {"a": table(lambda p: p % 2 == 0), LOOKUP: [4] * 64}
    static = make_plan("oracle-static", tabs, 4, 4, lambda: 0)
    assert static is not None and static(None) == "a"
    dyn = make_plan("oracle-dynamic", tabs, 4, 4, lambda: 0, K=1)
    assert isinstance(dyn, DynamicPlan) and LOOKUP not in dyn.tables
    assert dyn.planner.lookup == [4] * 64


def test_the_meter_counts_a_lookup_without_a_match_as_a_target_step():
    meter = PlanCostMeter(PlanCosts.uniform(("a",), 2.7))
    recs = [IterationRecord("a", 4, 2, 3, 0.0, t_draft=0.1, t_verify=0.0, context=100)
            for _ in range(8)]
    recs += [IterationRecord(LOOKUP, 0, 0, 1, 0.0, t_verify=0.05, context=100)
             for _ in range(8)]
    recs += [IterationRecord(LOOKUP, 3, 2, 3, 0.0, t_verify=0.07, context=100)
             for _ in range(8)]
    meter.observe(recs)
    got = meter.costs({})
    assert got.target == pytest.approx(0.5) and got.spec[LOOKUP] == pytest.approx(0.7)
    assert got.spec["a"] == pytest.approx(1.0)


def test_the_meter_learns_a_lookup_row_from_verifies_of_every_length():
    """A lookup verify of k proposals costs a target step and k rows: the meter reads the
    row off verifies of several lengths (the prior's until ENOUGH are timed)."""
    prior = PlanCosts(load={"a": 2.7}, target=0.5, per_token=0.0, spec={"a": 1.0},
                      unit_s=0.01, row=0.2)
    meter = PlanCostMeter(prior)
    meter.observe([IterationRecord(None, 0, 0, 1, 0.0, t_verify=0.004, context=100)
                   for _ in range(8)])
    meter.observe([IterationRecord(LOOKUP, k, k, k + 1, 0.0, t_verify=0.004 + 0.0008 * k,
                                   context=100) for k in (1, 2, 3, 4)])
    assert meter.costs({}).row == pytest.approx(0.2)  # (4 verifies: the prior's)
    meter.observe([IterationRecord(LOOKUP, k, k, k + 1, 0.0, t_verify=0.004 + 0.0008 * k,
                                   context=100) for k in (1, 2, 3, 4)])
    got = meter.costs({})
    assert got.row == pytest.approx(0.08) and got.target == pytest.approx(0.4)
    assert got.lookup(3, 100) == pytest.approx((0.004 + 0.0024) / 0.01)


def test_the_meter_learns_what_loads_cost_a_prefill_with_no_prefill_alone():
    """A cold-start oracle that loads at every opening never times a prefill without a
    load beside it: the slowdown is read against the calibrated prefill line."""
    prior = PlanCosts(load={"a": 2.7}, target=0.5, spec={"a": 1.0}, unit_s=0.01,
                      prefill=0.2, prefill_per_token=0.05)
    meter = PlanCostMeter(prior)
    meter.observe([IterationRecord(None, 0, 0, 1, 0.0, t_verify=0.005, context=100)
                   for _ in range(8)])
    for n in (40, 80, 120):  # each 30% slower than the line, loads beside every one
        meter.observe_prefill(n, 1.3 * (0.002 + 0.0005 * n), shared=True)
    got = meter.costs({})
    assert got.prefill_slowdown == pytest.approx(0.3)
    assert got.prefill == pytest.approx(0.2) and got.prefill_per_token == pytest.approx(0.05)


def test_the_meter_prices_a_draft_by_the_proposals_it_makes():
    """With exact proposals a draft's iterations differ in length: the meter reads a
    draft step off them (a line over the proposals made) and a verify row off the
    lookup's, keeps spec[d] as an iteration of gamma proposals, and prices each length as
    it was timed."""
    prior = PlanCosts(load={"a": 2.7}, target=0.5, spec={"a": 1.0}, unit_s=0.01, row=0.2,
                      call={"a": 0.3})
    meter = PlanCostMeter(prior, gamma=4)
    meter.observe([IterationRecord(None, 0, 0, 1, 0.0, t_verify=0.004, context=100)
                   for _ in range(8)])
    meter.observe([IterationRecord(LOOKUP, k, k, k + 1, 0.0, t_verify=0.004 + 0.001 * k,
                                   context=100) for k in (1, 2, 3, 4) * 2])
    meter.observe([IterationRecord("a", k, k, k + 1, 0.0, t_draft=0.0005 + 0.0007 * k,
                                   t_verify=0.004 + 0.001 * k, context=100)
                   for k in (1, 2, 3, 4) * 2])
    got = meter.costs({})
    unit = 0.0045 + 0.0017 * 2.5  # (the mean iteration timed)
    assert got.row == pytest.approx(0.001 / unit) and got.call["a"] == pytest.approx(0.0007 / unit)
    assert got.spec["a"] == pytest.approx((0.0045 + 0.0017 * 4) / unit)
    for k in (1, 2, 3, 4):
        assert got.proposing("a", 100, k, 4) == pytest.approx((0.0045 + 0.0017 * k) / unit)


def test_a_datastore_that_proposes_nothing_is_a_plain_step_to_the_meter_and_the_plan():
    """A datastore with no match runs a plain target step (recorded under its name,
    nothing proposed): the meter times it as one, and with exact proposals the plan prices
    a datastore's iteration as the lookup's, a step and a row per token, no draft step."""
    prior = PlanCosts(load={"s": 2.7}, target=0.5, spec={"s": 1.0}, unit_s=0.01, row=0.1,
                      free=frozenset({"s"}))
    meter = PlanCostMeter(prior, gamma=4)
    meter.observe([IterationRecord("s", 0, 0, 1, 0.0, t_verify=0.004, context=100)
                   for _ in range(8)])
    got = meter.costs({})
    assert got.target == pytest.approx(0.4) and len(meter.spec) == 0
    assert got.proposing("s", 100, 0, 4) == pytest.approx(got.iteration(None, 100))
    assert got.proposing("s", 100, 3, 4) == pytest.approx(got.iteration(None, 100) + 0.3)
    assert "s" not in got.call


def test_the_meter_never_prices_a_target_step_at_nothing():
    """Draft iterations that happen to grow steeply over a narrow span of contexts give a
    slope that would put a target step below zero (every target step free to the plan):
    the meter then prices iterations at their mean ratios instead."""
    meter = PlanCostMeter(PlanCosts.uniform(("a",), 2.7))
    meter.observe([IterationRecord("a", 4, 2, 3, 0.0, t_draft=0.01 + 1e-3 * (ctx - 100),
                                   t_verify=0.0, context=ctx) for ctx in range(100, 116)])
    meter.observe([IterationRecord(None, 0, 0, 1, 0.0, t_verify=0.004, context=ctx)
                   for ctx in range(100, 116)])
    got = meter.costs({})
    assert got.per_token == 0.0
    assert got.target == pytest.approx(0.004 / 0.0175)


def test_a_calibrated_meter_keeps_the_calibration_s_slope_and_learns_before_drafting():
    """With a calibrated prior the meter keeps its slope (timed at two contexts on purpose)
    and prices target steps from their timings even before any draft has run: an oracle
    that drafts little would otherwise plan with the prior for ever."""
    prior = PlanCosts(load={"a": 2.7}, target=0.5, per_token=0.001, spec={"a": 1.0},
                      unit_s=0.01)
    meter = PlanCostMeter(prior)
    assert meter.costs({}) is prior  # (nothing timed)
    meter.observe([IterationRecord(None, 0, 0, 1, 0.0, t_verify=0.003 + 1e-5 * ctx,
                                   context=ctx) for ctx in range(100, 110)])
    got = meter.costs({})
    assert got.per_token == pytest.approx(0.001) and got.target == pytest.approx(0.3)
    assert got.spec["a"] == pytest.approx(1.0) and got.load["a"] == pytest.approx(2.7)


def test_the_plan_prior_comes_from_the_start_up_calibration():
    """Before a request is timed the plan prices a target step, a draft's iteration and a
    lookup verify from the calibrated lines (without them every iteration is one unit,
    the target step too, and every draft looks worth running on a CPU)."""
    pool = load_pool(DEFAULT_POOL, check=False)
    gate = GateCosts(target=(0.004, 1e-6), verify=(0.007, 3e-6), draft_prior_s=0.003,
                     gamma=pool.gamma, prefill=(0.002, 5e-4))
    got = plan_costs(pool, {}, gate)
    ctx = CALIBRATED_CONTEXT
    unit = 0.007 + 0.003 + 3e-6 * ctx
    # the loads' head start: a prompt's prefill as calibrated
    assert got.prefill == pytest.approx(0.002 / unit)
    assert got.prefill_per_token == pytest.approx(5e-4 / unit)
    assert got.iteration(pool.general, ctx) == pytest.approx(1.0)
    assert got.iteration(None, ctx) == pytest.approx((0.004 + 1e-6 * ctx) / unit)
    assert got.iteration(LOOKUP, ctx) == pytest.approx((0.007 + 3e-6 * ctx) / unit)
    # a lookup proposing exactly what is accepted: a step and a row per token, the rows of
    # the calibrated verify (gamma + 1 of them) less the step's
    row = (0.003 + 2e-6 * ctx) / pool.gamma / unit
    assert got.row == pytest.approx(row)
    assert got.lookup(2, ctx) == pytest.approx(got.iteration(None, ctx) + 2 * row)
    assert got.lookup(pool.gamma, ctx) == pytest.approx(got.iteration(LOOKUP, ctx))
    assert plan_costs(pool, {}).iteration(None, ctx) == 1.0  # (no calibration: one unit)


def test_a_prompt_s_tables_gain_the_lookup_s_own_when_the_engine_runs_it():
    prompt, tokens = [1, 2, 3, 1, 2], (3, 1, 2, 3, 9)
    index = {tuple(prompt): Traced({"a": [1, 0, 2, 0, 0]}, tokens)}
    plain = prompt_tables(index, "oracle-dynamic", prompt, True)
    assert plain == {"a": [1, 0, 2, 0, 0]}
    looked = prompt_tables(index, "oracle-dynamic", prompt, True, lookup=2, gamma=4)
    assert looked[LOOKUP] == lookup_table(prompt, tokens, 4, 2) == [4, 3, 2, 1, 0]
    assert lookup_table([5, 6], (7, 8), 4, 2) == [None, None]  # (no suffix seen before)
    with pytest.raises(RequestError, match="no acceptance tables"):
        prompt_tables(index, "oracle-dynamic", [7, 7], True)


def test_the_prefill_slowdown_is_read_beside_the_loads_only():
    """A short load beside a long prefill slows only the part of it that the load ran
    beside: the meter reads the slowdown as the planner charges it, so that the plan prices
    an opening load at what it cost (read over the whole prefill, a 28 ms load that cost a
    150 ms prefill 20 ms looked like 13% and the plan loaded beside every prefill)."""
    meter = PlanCostMeter(PlanCosts.uniform(("a",), 2.7))
    meter.observe([IterationRecord("a", 4, 2, 3, 0.0, t_draft=0.1, t_verify=0.0, context=100)
                   for _ in range(8)])  # (the unit: 0.1 s)
    meter.observe_prefill(100, 0.2)
    meter.observe_prefill(300, 0.4)  # (the line: 1 + 0.01 n units)
    for _ in range(3):  # 3 units of work, 0.5 of loading beside it, 0.4 more time
        meter.observe_prefill(200, 0.34, shared=True, loads=("a",))
    got = meter.costs({"a": 0.05})
    assert got.prefill_slowdown == pytest.approx(4.0)
    assert got.slowed(3.0, 0.5, got.prefill_slowdown) == pytest.approx(3.4)


def test_the_meter_learns_the_prefill_head_start_the_loads_get():
    meter = PlanCostMeter(PlanCosts.uniform(("a",), 2.7))
    meter.observe([IterationRecord("a", 4, 2, 3, 0.0, t_draft=0.1, t_verify=0.0, context=100)
                   for _ in range(8)])
    meter.observe_prefill(100, 0.2)
    assert meter.costs({}).prefill == 0.0  # (one prompt length: no line yet)
    meter.observe_prefill(300, 0.4)
    got = meter.costs({})
    assert got.prefill == pytest.approx(1.0) and got.prefill_per_token == pytest.approx(0.01)


def test_the_meter_prices_what_the_loader_s_work_costs_the_decoder():
    """On two cores a load's reads, checks and copies stall the decoder: iterations and a
    prefill timed while the loader worked are kept out of the lines and price the
    slowdowns, which make an opening load dearer to the plan."""
    meter = PlanCostMeter(PlanCosts.uniform(("a",), 2.7))
    quiet = IterationRecord("a", 4, 2, 3, 0.0, t_draft=0.1, t_verify=0.0, context=100)
    busy = IterationRecord("a", 4, 2, 3, 0.0, t_draft=0.15, t_verify=0.0, context=100,
                           shared=True)
    meter.observe([quiet] * 8 + [busy] * 8)
    meter.observe_prefill(100, 0.2)
    meter.observe_prefill(300, 0.4)
    for _ in range(3):
        meter.observe_prefill(200, 0.45, shared=True)
    got = meter.costs({})
    assert got.spec["a"] == pytest.approx(1.0)  # (the busy iterations are not the line)
    assert got.load_slowdown == pytest.approx(0.5)
    assert got.prefill_slowdown == pytest.approx(0.5)
    # the opening that loads during the prefill now pays for it
    tabs = {"a": table(lambda p: True, 32)}
    plain = PlanCosts(load={"a": 5.0}, prefill=10.0)
    for slow, more in ((0.0, 0.0), (0.5, 5.0 - 5.0 / 1.5)):  # (5 of loading at 1/1.5 speed)
        planner = LoadPlanner(tabs, 4, 4, 1, replace(plain, prefill_slowdown=slow))
        start = planner.coded(planner.state(0, None, frozenset()))
        _, t = planner._open(start, (-1, (0,), 0, planner._full[0], planner._full[0], 4))
        assert t == pytest.approx(10.0 + more)


def test_the_meter_prices_a_scheduling_point():
    """Each scheduling point drains replies, decides and streams: once timed, the plan
    counts it, so it runs whole intervals where cutting one gains nothing."""
    meter = PlanCostMeter(PlanCosts.uniform(("a",), 2.7))
    meter.observe([IterationRecord("a", 4, 2, 3, 0.0, t_draft=0.01, t_verify=0.0,
                                   context=100)] * 8)
    for _ in range(3):
        meter.observe_points(20, 0.004)
    assert meter.costs({}).overhead == pytest.approx(0.02)
    look = [0] * 16
    tabs = {"a": table(lambda p: False, 16)}
    costs = PlanCosts(load={"a": 1.0}, spec={LOOKUP: 0.5}, target=0.5, overhead=0.02)
    steps = walk(LoadPlanner(tabs, 4, 4, 1, costs, lookup=look),
                 (0, None, frozenset(), (), 0))
    assert all(m.limit == 0 for _, m in steps[:-1])  # (whole intervals: no point is free)
