"""The replay simulator and the exact optimum: pure logic over synthetic tables."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from memspec.common.metrics import IterationRecord, LoadEvent, RankEvent, RunStats, Summary, Trace
from memspec.procs.decoder.oracle.loadplan import LoadPlanner
from memspec.procs.decoder.oracle.oracle import dynamic_plan, static_plan
from memspec.procs.decoder.oracle.replay import oracle_static, replay_static, step_accepted
from memspec.procs.decoder.sched.costs import PlanCosts
from memspec.procs.decoder.sched.policies import POLICY_NAMES, SchedView
from memspec.sim.costmodel import CostModel, fit, linear_fit
from memspec.sim.loadqueue import LoadQueue
from memspec.sim.optimum import optimum
from memspec.sim.simulate import SimConfig, SimRequest, simulate, simulate_traced
from memspec.zoo.tables import table_from_correct

DRAFTS = ("general", "code", "math", "law", "medical")
# the simulator replays acceptance tables of pool drafts; the context lookup alone has none
SIMULATED = tuple(n for n in POLICY_NAMES if n != "lookup-only")


def tables(seed: int, length: int = 96, good: str = "math") -> dict[str, list[int]]:
    rng = random.Random(seed)
    out = {}
    for d in DRAFTS:
        p = 0.55 if d == good else 0.3
        out[d] = table_from_correct([rng.random() < p for _ in range(length)], 4)
    return out


def cost(load: float = 0.25, **kw) -> CostModel:
    base = dict(spec_s={d: 0.09 for d in DRAFTS}, target_s=0.04, catchup_base_s=0.003,
                catchup_per_token_s=2e-5, load_s={d: load for d in DRAFTS}, predict_s=0.025,
                snapshot_s=0.0003, sched_s=0.001, inner_s=0.0001)
    base.update(kw)
    return CostModel(**base)


CFG = SimConfig(DRAFTS, "general", K=2, N=4, gamma=4)


def test_resident_static_draft_replays_the_tables_exactly():
    tab = tables(1)
    req = SimRequest("p", "math", 40, tab)
    st = simulate("general-static", req, cost(), replace(CFG, gate=False), resident=["general"])
    rep = replay_static(tab, "general", 4)
    assert [r.accepted for r in st.records] == rep.accepted
    assert sum(r.emitted for r in st.records) == len(tab["general"])
    assert all(r.desired for r in st.records) and st.loads == 0
    # one catch-up (first activation), then pure iteration cost
    assert sum(1 for r in st.records if r.t_catchup > 0) == 1


def test_cold_start_pays_the_load_in_fallback_then_runs_the_draft():
    tab = tables(2)
    st = simulate("general-static", SimRequest("p", "math", 40, tab), cost(load=0.1),
                  replace(CFG, gate=False))
    first = [r.draft for r in st.records[:4]]
    assert first == [None] * 4 and not st.records[0].desired  # target alone while loading
    assert st.records[4].draft == "general" and st.loads == 1


def test_oracle_static_runs_the_best_single_draft():
    tab = tables(3, good="law")
    best, _ = oracle_static(tab, 4)
    st = simulate("oracle-static", SimRequest("p", "law", 40, tab), cost(),
                  replace(CFG, gate=False), resident=[best])
    assert {r.draft for r in st.records} == {best}


def test_memspec_follows_a_perfect_predictor_to_the_good_draft():
    """(A pool whose drafts differ this much ranks any request: rank_horizon 0.)"""
    tab = tables(4, good="code")
    req = SimRequest("p", "code", 40, tab,
                     scores=lambda p: {d: 1.0 if d == "code" else 0.1 for d in DRAFTS})
    cheap = cost(spec_s={d: 0.06 for d in DRAFTS})  # speculation pays: the gate lets it run
    s = simulate("memspec", req, cheap, replace(CFG, rank_horizon=0)).summary()
    assert s["num_drafts"] > 0 and s["drafts_used"].get("code", 0) > 0.8 * s["num_drafts"]


def test_a_request_shorter_than_the_ranking_horizon_loads_its_first_draft_at_once():
    """Nothing resident and fewer tokens to come than a ranking needs to pay back: memspec
    loads the general draft as the request opens (beside the prefill), asks for no ranking,
    and loads nothing else; a longer one ranks the prompt first and loads what it ranks."""
    tab = tables(4, good="code")
    req = SimRequest("p", "code", 40, tab,
                     scores=lambda p: {d: 1.0 if d == "code" else 0.1 for d in DRAFTS})
    cheap = cost(spec_s={d: 0.06 for d in DRAFTS})
    short = simulate_traced("memspec", req, cheap, replace(CFG, rank_horizon=128))  # (96 to come)
    assert short.snapshots == 0 and short.trace.initial_prediction == 0.0
    assert [e.draft for e in short.trace.loads if e.kind == "load"] == ["general"]
    ranked = simulate_traced("memspec", req, cheap, replace(CFG, rank_horizon=32))
    assert ranked.snapshots > 0
    assert "code" in {e.draft for e in ranked.trace.loads if e.kind == "load"}


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_optimum_bounds_every_policy(seed):
    tab = tables(seed, good=DRAFTS[seed % 5])
    c = cost()
    req = SimRequest("p", "x", 40, tab, scores=lambda p: {d: 1.0 / (1 + i)
                                                          for i, d in enumerate(DRAFTS)})
    opt = optimum(tab, c, CFG.K, CFG.N, CFG.gamma, prompt_len=40)
    sd = optimum(tab, c, CFG.K, CFG.N, CFG.gamma, prompt_len=40, target_only=False)
    assert sd.tokens_per_s <= opt.tokens_per_s * (1 + 1e-9)
    for name in SIMULATED:
        st = simulate(name, req, c, CFG)
        steady = st.summary()["tokens_per_s_steady"]
        assert steady <= opt.tokens_per_s * (1 + 1e-9), name
        # the others run a draft whenever one is resident (oracle-dynamic knows when the
        # target alone is faster)
        if name not in ("target-only", "oracle-dynamic"):
            assert steady <= sd.tokens_per_s * (1 + 1e-9), name


def _brute_force(tab, c, N, gamma):
    """K = 1, loads instant relative to nothing: try every per-interval draft sequence where
    a draft runs only if it was chosen (loaded) one interval earlier or is the current one."""
    n = len(next(iter(tab.values())))
    best = float("inf")
    options = (*tab, None)

    def go(pos, res, t, depth):
        nonlocal best
        if pos >= n:
            best = min(best, t)
            return
        if t >= best:
            return
        for run, nxt_res in itertools.product(options, tab):
            if run is not None and run != res:
                continue
            p, dt = pos, 0.0
            for _ in range(N):
                if p >= n:
                    break
                if run is None:
                    p, dt = p + 1, dt + c.target_s
                else:
                    p, dt = min(p + step_accepted(tab[run], p, gamma) + 1, n), dt + c.spec_s[run]
            # a load issued now lands within the interval when load_s <= dt
            land = nxt_res if (nxt_res == res or c.load_s[nxt_res] <= dt) else res
            go(p, land, t + dt, depth + 1)

    go(0, None, 0.0, 0)
    return best


def test_optimum_matches_brute_force_on_a_small_case():
    rng = random.Random(11)
    tab = {d: table_from_correct([rng.random() < q for _ in range(14)], 3)
           for d, q in (("a", 0.2), ("b", 0.7))}
    c = CostModel(spec_s={"a": 0.1, "b": 0.1}, target_s=0.05, catchup_base_s=0.0,
                  catchup_per_token_s=0.0, load_s={"a": 0.05, "b": 0.05}, predict_s=0.0,
                  snapshot_s=0.0, sched_s=0.0)
    opt = optimum(tab, c, K=1, N=2, gamma=3)
    brute = _brute_force(tab, c, 2, 3)
    # the DP may also idle for a load (never worse), so it is at most the brute force
    assert opt.time_s <= brute + 1e-9
    assert opt.time_s >= 0.0 and opt.time_s > 0.6 * brute


def test_oracle_plans():
    tab = tables(8, good="medical")
    best, _ = oracle_static(tab, 4)
    view = SchedView(0, DRAFTS, "general", 2, frozenset(), frozenset(), frozenset(), None, None)
    assert static_plan(tab, 4)(view) == best
    pos = {"p": 0}
    plan = dynamic_plan(tab, 4, 4, 2, PlanCosts.uniform(DRAFTS, 2.5), lambda: pos["p"])
    first = plan(view)  # request start: the drafts to load during the prefill (<= K)
    assert first.run is None and first.actions.prefetch[0] == "medical"
    assert len(first.actions.prefetch) <= 2
    pos["p"] = len(tab["general"])
    assert plan(view) is None


def _traced(its: list[IterationRecord], loads: list[LoadEvent], loop_start: float,
            prefill: float, e2e: float, prompt_tokens: int) -> Summary:
    """A traced request's summary, as the decoder sends it in Done.stats."""
    st = RunStats(records=its, t_prefill=prefill, t_e2e=e2e, prompt_tokens=prompt_tokens)
    out = st.report()
    out.trace = Trace(iterations=its, loads=loads, loop_start=loop_start, initial_prediction=0.0)
    return out


def test_costmodel_fit_from_a_trace():
    its = []
    t = 0.5
    for i in range(12):
        d = None if i < 4 else "code"
        dur = 0.04 if d is None else 0.09
        catch = 0.01 if i == 4 else 0.0
        its.append(IterationRecord(d, 4 if d else 0, 1, 2, t, t_verify=dur, t_catchup=catch,
                                   desired=d is not None))
        t += dur + catch + (0.002 if (i + 1) % 4 == 0 else 0.0001)
    run = _traced(its, [LoadEvent(0.25, "load", "code", 0), LoadEvent(0.7, "loaded", "code", 0,
                                                                        0.2)],
                  loop_start=0.49, prefill=0.3, e2e=t + 0.01, prompt_tokens=50)
    c = fit([run], 4, [(16, 0.002), (64, 0.005)], 0.025, ["general", "code"])
    assert c.spec_s["code"] == pytest.approx(0.09)
    assert c.target_s == pytest.approx(0.04)
    # the planner's beliefs, as the decoder's meter forms them: raw means, in SD iterations
    assert c.plan_costs().target == pytest.approx(0.04 / 0.09)
    assert c.load_s["code"] == pytest.approx(0.2)
    assert c.sched_s == pytest.approx((0.01 + 0.002 + 0.002) / 3, rel=1e-6)
    assert linear_fit([16, 64], [0.002, 0.005]) == pytest.approx((0.001, 6.25e-5))


def test_fit_separates_load_interference_and_bind_cost():
    """Iterations overlapping a load are slower; binding a landed draft costs the decoder."""
    its, t = [], 0.1
    for i in range(16):
        slow = 4 <= i < 8  # the loader streams during these
        dur = 0.11 if slow else 0.10
        its.append(IterationRecord("general", 4, 0, 1, t, t_verify=dur))
        t += dur + (0.0105 if i == 7 else 0.0005)  # a bind lands in the gap after i = 7
    loads = [LoadEvent(its[4].t_start, "load", "code", 1),
             LoadEvent(its[8].t_start - 0.001, "loaded", "code", 1,
                       its[7].t_start + its[7].duration - its[4].t_start, 0.01)]
    run = _traced(its, loads, loop_start=0.0995, prefill=0.05, e2e=t, prompt_tokens=20)
    c = fit([run], 4, [(8, 0.001), (64, 0.002)], 0.02, ["general", "code"])
    assert c.load_slowdown == pytest.approx(0.1, abs=0.02)
    assert c.bind_s == pytest.approx(0.01)
    assert c.sched_s == pytest.approx(0.0005, abs=1e-4)  # the bind is not a scheduling cost


def test_fit_charges_the_predictor_slowdown_only_while_it_encodes():
    """A predictor-driven run (a general-static run gives the plain iteration cost): only
    iterations that start inside a ranking's window (sent, plus the predictor's seconds)
    are slower; the simulator then slows only those."""
    base, t = [], 0.1
    for _ in range(8):
        base.append(IterationRecord("general", 4, 0, 1, t, t_verify=0.10))
        t += 0.1005
    plain = _traced(base, [], loop_start=0.0995, prefill=0.05, e2e=t, prompt_tokens=20)
    its, t = [], 0.1
    for i in range(16):
        busy = i % 4 < 2  # each snapshot keeps the predictor busy for two iterations
        dur = 0.13 if busy else 0.10
        its.append(IterationRecord("general", 4, 0, 1, t, t_verify=dur))
        t += dur + 0.0005
    rankings = [RankEvent(its[i].t_start - 0.001, i // 4, 0.2) for i in range(0, 16, 4)]
    run = _traced(its, [], loop_start=0.0995, prefill=0.05, e2e=t, prompt_tokens=20)
    run.trace.uses_predictor, run.trace.rankings = True, rankings
    c = fit([plain, run], 4, [(8, 0.001), (64, 0.002)], 0.2, ["general", "code"])
    assert c.predictor_slowdown == pytest.approx(0.3, abs=0.01)
    assert c.spec_s["general"] == pytest.approx(0.10, abs=1e-3)
    # a trace from before rankings were recorded (it waited for the first one): every
    # iteration of the run counts
    run.trace.uses_predictor, run.trace.rankings = False, []
    run.trace.initial_prediction = 0.05
    assert fit([plain, run], 4, [(8, 0.001)], 0.2, ["general", "code"]).predictor_slowdown \
        == pytest.approx(0.15, abs=0.01)


def test_load_queue_is_fifo_and_a_cancel_frees_the_loader():
    q = LoadQueue(free_at=0.0)
    q.issue("a", 0.0, 1.0)
    q.issue("b", 0.2, 1.0)
    assert q.windows() == [(0.0, 1.0), (1.0, 2.0)] and q.busy(0.5) and q.next_done() == 1.0
    assert q.cancel("a", 0.5)  # running: the loader is free at once, b starts now
    assert q.windows() == [(0.5, 1.5)]
    assert q.finished(1.4) == [] and q.finished(1.5) == [("b", 1.5, 1.0)]
    assert not q.busy(1.6) and not q.cancel("b", 2.0)


def test_a_slow_predictor_is_asked_within_its_share():
    """Snapshots after the prompt's go out only while the predictor's encoding stays within
    PREDICTOR_SHARE of the decode time, the rankings still in flight counted: a predictor
    50x slower asks for fewer rankings, and neither overruns the share."""
    from memspec.procs.decoder.sched.loop import PREDICTOR_SHARE

    tab = tables(9)
    counts = {}
    for predict_s in (0.004, 0.2):  # 0.2 s: a ranking is still in flight at the next check
        st = simulate_traced("memspec", SimRequest("p", "x", 40, tab,
                                                   lambda p: {d: 1.0 for d in DRAFTS}),
                             cost(predict_s=predict_s), replace(CFG, gate=False))
        assert st.generated_tokens == len(tab["general"])
        decode = st.time.decode
        later = len(st.trace.rankings) - 1  # beyond the prompt's
        assert later * predict_s <= PREDICTOR_SHARE * decode
        counts[predict_s] = later
    assert counts[0.004] > counts[0.2] >= 1


# --------------------------------------------------------------------------- oracle-dynamic


def phases(seed: int, length: int = 96, stretch: int = 24) -> dict[str, list[int]]:
    """Each draft good in its own stretches of the trajectory (a mixed-domain answer)."""
    rng = random.Random(seed)
    order = [DRAFTS[(seed + i) % 5] for i in range(5)]
    return {d: table_from_correct([rng.random() < (0.85 if order[(p // stretch) % 2] == d
                                                   else 0.25) for p in range(length)], 4)
            for d in DRAFTS}


def test_the_load_plan_starts_a_load_early_enough():
    """Two phases: the plan loads the second phase's draft while the first runs, so it is
    resident when its phase starts, and it beats the best single draft."""
    tab = phases(1)
    first, second = DRAFTS[1], DRAFTS[2]
    planner = LoadPlanner(tab, 4, 4, 2, PlanCosts.uniform(DRAFTS, 2.5, switch=0.0))
    move = planner.initial()
    assert move.loads[:1] == (first,)
    state = planner.opened(frozenset(), move)
    runs, loads = [], [(0, d) for d in move.loads]
    while state[0] < planner.n:
        move = planner.step(state)
        runs.append((state[0], move.run))
        loads += [(state[0], d) for d in move.loads]
        state = planner.after(state, move)
    switch = next(pos for pos, run in runs if run == second)
    issued = next(pos for pos, d in loads if d == second)
    assert issued < switch <= 24 + 12  # loaded before its phase, run soon after it starts
    static = oracle_static(tab, 4)[1].iterations  # the best single draft, always resident
    assert planner.step((0, first, frozenset({first}), ())).value < static


@pytest.mark.parametrize("seed", range(6))
def test_oracle_dynamic_bounds_the_online_policies(seed):
    """With future knowledge of acceptance and loads, oracle-dynamic is at least as fast as
    oracle-static and every online policy, in the simulator, cold start included."""
    tab = phases(seed) if seed % 2 else tables(seed, good=DRAFTS[seed % 5])
    c = cost(load=0.22)
    cfg = SimConfig(DRAFTS, "general", K=2, N=4, gamma=4, plan=c.plan_costs())
    oracle = max(DRAFTS, key=lambda d: sum(tab[d]))
    req = SimRequest("p", "x", 40, tab, scores=lambda p: {d: 1.0 if d == oracle else 0.1
                                                          for d in DRAFTS})
    steady = {name: simulate(name, req, c, cfg).summary()["tokens_per_s_steady"]
              for name in SIMULATED if name != "target-only"}
    for name, v in steady.items():
        assert steady["oracle-dynamic"] >= v * (1 - 0.01), (name, steady)


def test_oracle_dynamic_replans_when_loads_run_late():
    """The plan believes loads take 1 iteration; they take 5: it re-plans from the real
    state at every scheduling point, never runs a draft that is not resident, and finishes."""
    tab = phases(2)
    slow = cost(load=0.45)
    cfg = SimConfig(DRAFTS, "general", K=2, N=4, gamma=4, plan=PlanCosts.uniform(DRAFTS, 1.0))
    st = simulate_traced("oracle-dynamic", SimRequest("p", "x", 40, tab), slow, cfg)
    assert st.generated_tokens == len(tab["general"]) and st.num_drafts > 0
    loaded: set[str] = set()
    its = iter(st.trace.iterations)
    for ev in st.trace.loads:  # every drafted iteration ran a draft that had landed
        if ev.kind == "loaded":
            loaded.add(ev.draft)
    assert {r.draft for r in st.trace.iterations if r.draft} <= loaded
    assert next(its).draft is None  # the cold start: target alone until the first load lands


def test_plan_cost_meter_learns_the_runtimes_costs():
    """oracle-dynamic's beliefs from finished requests: iterations are the unit, catch-up a
    line over tokens, loads as the loader timed them; the prior until there is data."""
    from memspec.procs.decoder.oracle.oracle import PlanCostMeter

    prior = PlanCosts.uniform(DRAFTS, 2.7)
    meter = PlanCostMeter(prior)
    assert meter.costs({}) is prior
    recs = [IterationRecord("code", 4, 2, 3, 0.0, t_draft=0.02, t_verify=0.08,
                            t_catchup=0.002 + 0.0001 * n, catchup_tokens=n)
            for n in (10, 50, 100, 150, 200, 250)]
    recs += [IterationRecord("code", 4, 1, 2, 0.0, t_draft=0.02, t_verify=0.08)] * 10
    recs += [IterationRecord(None, 0, 0, 1, 0.0, t_verify=0.05)] * 4
    meter.observe(recs)
    got = meter.costs({"math": 0.3})
    assert got.target == pytest.approx(0.5) and got.load["math"] == pytest.approx(3.0)
    assert got.load["code"] == 2.7  # never loaded: the prior's ratio
    assert got.switch == pytest.approx(0.02) and got.switch_per_token == pytest.approx(0.001)


@pytest.mark.parametrize("policy", ["target-only", "general-static", "memspec", "mab-async"])
def test_the_time_split_adds_up_to_the_wall_clock(policy):
    """pre + prefill + decode (iterations, load waits, prediction) + scheduling + binds =
    e2e: nothing the request spent is missing from its split."""
    c = cost(predict_s=0.01)
    c.bind_s, c.prefill_base_s, c.pre_s = 0.002, 0.02, 0.003
    st = simulate_traced(policy, SimRequest("p", "x", 40, tables(4),
                                            lambda p: {d: 1.0 for d in DRAFTS}), c, CFG)
    t = st.time
    assert t.e2e > 0 and abs(t.other) <= 0.02 * t.e2e, t
    assert t.pre + t.prefill + t.decode + t.sched + t.bind + t.other == pytest.approx(t.e2e)
