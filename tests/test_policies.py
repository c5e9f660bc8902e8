"""Pure scheduling logic: the cache manager (paper Alg. 2) and every policy's contract."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from memspec.common.config import POLICIES
from memspec.common.errors import ConfigError
from memspec.procs.decoder.sched.cache_manager import CacheActions, rank, update_cache
from memspec.procs.decoder.sched.costs import LOOKUP
from memspec.procs.decoder.sched.policies import (
    POLICY_NAMES,
    Decision,
    Policy,
    SchedView,
    make_policy,
)

DRAFTS = ("general", "code", "math", "law", "medical")
SCORES = {"code": 0.5, "math": 0.3, "law": 0.15, "medical": 0.04, "general": 0.01}
EMPTY: frozenset[str] = frozenset()


def view(**kw) -> SchedView:
    base = dict(iteration=0, drafts=DRAFTS, general="general", capacity=2, resident=EMPTY,
                loading=EMPTY, failed=EMPTY, active=None, scores=SCORES)
    base.update({k: frozenset(v) if k in ("resident", "loading", "failed") else v
                 for k, v in kw.items()})
    return SchedView(**base)


def oracle(_: SchedView) -> str:
    return "math"


def build(name: str, **kw) -> Policy:
    if name.startswith("oracle"):
        kw.setdefault("oracle_plan", oracle)
    return make_policy(name, **kw)


# ---- Algorithm 2 --------------------------------------------------------------------------

def test_fills_free_slots_in_score_order() -> None:
    got = update_cache(SCORES, set(), set(), 2, None)
    assert got == CacheActions(prefetch=("code", "math"))


def test_evicts_lowest_scored_outside_working_set() -> None:
    got = update_cache(SCORES, {"general", "law"}, set(), 2, None)
    assert got == CacheActions(prefetch=("code", "math"), evict=("general", "law"))


def test_never_evicts_active_even_if_lowest() -> None:
    got = update_cache(SCORES, {"general", "law"}, set(), 2, "general")
    assert got == CacheActions(prefetch=("code",), evict=("law",))


def test_breaks_when_nothing_evictable() -> None:
    assert update_cache(SCORES, {"general"}, set(), 1, "general") == CacheActions()
    # The working set itself is never evicted to make room for its own lower members.
    assert update_cache(SCORES, {"code", "general"}, set(), 2, "general") == CacheActions()


def test_loading_occupies_a_slot() -> None:
    assert update_cache(SCORES, {"general"}, {"law"}, 2, "general") == CacheActions()
    assert update_cache(SCORES, set(), {"code", "math"}, 2, None) == CacheActions()


def test_capacity_one() -> None:
    assert update_cache(SCORES, set(), set(), 1, None) == CacheActions(prefetch=("code",))
    got = update_cache(SCORES, {"law"}, set(), 1, None)
    assert got == CacheActions(prefetch=("code",), evict=("law",))
    assert update_cache(SCORES, {"code"}, set(), 1, "code") == CacheActions()


@pytest.mark.parametrize("k", [5, 7])
def test_capacity_covers_pool(k: int) -> None:
    got = update_cache(SCORES, {"law"}, {"math"}, k, "law")
    assert got == CacheActions(prefetch=("code", "medical", "general"))


def test_capacity_zero_and_unscored() -> None:
    assert update_cache(SCORES, set(), set(), 0, None) == CacheActions()
    assert update_cache({}, {"law"}, set(), 2, None) == CacheActions()
    nan = {"code": float("nan"), "math": 0.1}
    assert rank(nan) == ("math", "code")


def test_ties_are_deterministic() -> None:
    flat = dict.fromkeys(DRAFTS, 1.0)
    backwards = dict.fromkeys(reversed(DRAFTS), 1.0)
    first = update_cache(flat, {"medical", "math"}, set(), 2, None)
    assert first == update_cache(backwards, {"math", "medical"}, set(), 2, None)
    assert first == CacheActions(prefetch=("code", "general"), evict=("medical", "math"))


# ---- policies -----------------------------------------------------------------------------

def test_names_match_config() -> None:
    assert set(POLICY_NAMES) == set(POLICIES)


def test_make_policy_errors() -> None:
    with pytest.raises(ConfigError, match="valid: target-only, lookup-only, general-static"):
        make_policy("fastest")
    with pytest.raises(ConfigError, match="oracle plan"):
        make_policy("oracle-dynamic")
    with pytest.raises(ConfigError, match="unknown policy option"):
        make_policy("memspec", gamma=4)
    with pytest.raises(ConfigError, match="ucb_c"):
        make_policy("mab-async", ucb_c=-1.0)


def test_target_only() -> None:
    d = make_policy("target-only").decide(view(resident={"code"}))
    assert d == Decision(None, None, CacheActions())


def test_general_static_loads_then_runs_general() -> None:
    p = make_policy("general-static")
    assert p.decide(view()) == Decision(None, "general", CacheActions(prefetch=("general",)))
    assert p.decide(view(loading={"general"})).actions == CacheActions()
    assert p.decide(view(resident={"general"})).run == "general"


def test_memspec_runs_best_resident_and_switches() -> None:
    p = make_policy("memspec")
    d = p.decide(view(resident={"general"}, active="general"))
    assert (d.run, d.preferred, d.actions.prefetch) == ("general", "code", ("code",))
    d = p.decide(view(resident={"general", "code"}, active="general"))
    assert (d.run, d.actions) == ("code", CacheActions())
    d = p.decide(view(resident={"general", "code"}, active="code"))
    assert (d.run, d.actions) == ("code", CacheActions(prefetch=("math",), evict=("general",)))


def test_memspec_never_runs_what_it_evicts() -> None:
    scores = {"code": 4.0, "math": 3.0, "law": 2.0, "general": 1.0}
    d = make_policy("memspec").decide(view(resident={"general", "law"}, active="general",
                                           scores=scores))
    assert d.actions == CacheActions(prefetch=("code",), evict=("law",))
    assert d.run == "general"


def test_memspec_before_any_ranking_prefers_general() -> None:
    p = make_policy("memspec")
    assert p.decide(view(scores=None)) == Decision(None, "general",
                                                   CacheActions(prefetch=("general",)))
    d = p.decide(view(scores=None, resident={"law"}))
    assert (d.run, d.actions.prefetch, d.actions.evict) == ("law", ("general",), ())


def test_memspec_converges_to_top_k_without_idling() -> None:
    p, resident, loading, active = make_policy("memspec"), {"general"}, set(), None
    for _ in range(5):  # load, switch, then evict the old active one and load the second
        d = p.decide(view(resident=resident, loading=loading, active=active))
        assert d.run is not None and d.wait_for is None
        resident = (resident | loading) - set(d.actions.evict)  # loads land by the next point
        loading, active = set(d.actions.prefetch), d.run
    assert resident == {"code", "math"} and active == "code"


def test_prediction_only_loads_top1_reactively() -> None:
    p = make_policy("prediction-only")
    assert p.decide(view()).actions == CacheActions(prefetch=("code",))
    d = p.decide(view(resident={"general"}, active="general"))
    assert (d.run, d.actions) == ("general", CacheActions(prefetch=("code",)))
    d = p.decide(view(resident={"general", "law"}, active="law"))
    assert (d.run, d.actions) == ("law", CacheActions(prefetch=("code",), evict=("general",)))
    assert p.decide(view(resident={"general"}, loading={"code"})).actions == CacheActions()
    assert p.decide(view(resident={"code"}, active="code")).actions == CacheActions()


REWARD = {"general": 1, "code": 4, "math": 2, "law": 0, "medical": 1}


def run_bandit(c: float, steps: int) -> list[str]:
    """All drafts resident, deterministic rewards: the pure UCB choice sequence."""
    p, picks = make_policy("mab-async", ucb_c=c), []
    everything = view(capacity=5, resident=set(DRAFTS))
    for _ in range(steps):
        d = p.decide(everything)
        assert d.run == d.preferred and d.actions == CacheActions()
        picks.append(d.run)
        p.observe(d.run, 4, REWARD[d.run])
    return picks


def test_ucb_explores_each_once_then_exploits() -> None:
    picks = run_bandit(0.0, 40)
    assert picks[:5] == list(DRAFTS)
    assert set(picks[5:]) == {"code"}


def test_ucb_c_controls_exploration() -> None:
    off = [run_bandit(c, 300)[5:] for c in (0.0, 1.0, 3.0)]
    others = [sum(x != "code" for x in picks) for picks in off]
    assert others[0] == 0 < others[1] < others[2]
    assert all(picks.count("code") > len(picks) / 2 for picks in off)


def tried(name: str, **kw) -> Policy:
    """A bandit that has seen general (reward 1) and code (reward 4) once each."""
    p = make_policy(name, **kw)
    p.observe("general", 4, 1)
    p.observe("code", 4, 4)
    return p


def test_mab_async_does_not_wait() -> None:
    d = tried("mab-async").decide(view(resident={"general", "code"}, active="code"))
    assert d.preferred == "math" and d.wait_for is None
    assert (d.run, d.actions) == ("code", CacheActions(prefetch=("math",), evict=("general",)))
    d = tried("mab-async").decide(view(resident={"general", "code"}, loading=(), active="code",
                                       failed={"math", "law", "medical"}))
    assert d.run == d.preferred


def test_mab_sync_waits() -> None:
    d = tried("mab-sync").decide(view(resident={"general", "code"}, active="code"))
    assert d == Decision("math", "math", CacheActions(prefetch=("math",), evict=("general",)),
                         wait_for="math")
    d = tried("mab-sync").decide(view(resident={"code"}, loading={"math"}, active="code"))
    assert (d.run, d.wait_for, d.actions) == ("math", "math", CacheActions())
    # K=1: the idle active draft makes way rather than deadlock the wait.
    d = tried("mab-sync").decide(view(capacity=1, resident={"code"}, active="code"))
    assert d.actions == CacheActions(prefetch=("math",), evict=("code",))


def test_reset_forgets_bandit_state() -> None:
    p = tried("mab-async")
    p.reset()
    assert p.decide(view(resident={"law"})).preferred == "law"


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_failed_drafts_never_chosen_or_loaded(name: str) -> None:
    p = build(name, oracle_plan=lambda v: {"math": 2.0, "code": 1.0})
    failed = {"math", "code"} if name != "general-static" else {"general"}
    for step in range(12):
        d = p.decide(view(iteration=step, failed=failed, resident={"law"}, active="law"))
        touched = {d.run, d.preferred, d.wait_for, *d.actions.prefetch}
        assert not touched & failed
        p.observe(d.run, 4, step % 3)


def test_oracles_follow_their_plan() -> None:
    asked: list[int] = []

    def plan(v: SchedView) -> str:
        asked.append(v.iteration)
        return "math"

    p = make_policy("oracle-static", oracle_plan=plan)
    assert p.decide(view()).actions == CacheActions(prefetch=("math",))
    assert p.decide(view(iteration=4, resident={"math"})).run == "math"
    assert asked == [0]
    p.reset()
    p.decide(view(iteration=0))
    assert asked == [0, 0]
    # oracle-dynamic does what its plan decides, loads included; never runs a non-resident
    planned = Decision("math", "math", CacheActions(prefetch=("law",)))
    d = make_policy("oracle-dynamic", oracle_plan=lambda v: planned).decide(
        view(resident={"math"}, active="math"))
    assert d == planned
    d = make_policy("oracle-dynamic", oracle_plan=lambda v: planned).decide(view())
    assert (d.run, d.actions.prefetch) == (None, ("law",))
    assert make_policy("oracle-dynamic", oracle_plan=lambda v: None).decide(view()).run is None


def test_the_first_decision_is_the_initial_load() -> None:
    """Taken before prefill (Alg. 3 lines 2-5): every draft-using policy names its initial
    draft(s) from an empty residency."""
    first = {name: build(name).decide(view()).actions.prefetch
             for name in ("general-static", "oracle-static", "mab-async", "mab-sync",
                          "prediction-only", "memspec")}
    assert first == {"general-static": ("general",), "oracle-static": ("math",),
                     "mab-async": ("general",), "mab-sync": ("general",),
                     "prediction-only": ("code",), "memspec": ("code", "math")}
    assert build("target-only").decide(view()).actions.empty


# ---- invariants over random states --------------------------------------------------------

def random_view(rng: random.Random) -> SchedView:
    drafts = tuple(rng.sample(DRAFTS, rng.randint(1, len(DRAFTS))))
    k = rng.randint(0, len(drafts) + 1)
    resident, loading, failed = set(), set(), set()
    for d in rng.sample(drafts, len(drafts)):
        slot = rng.choice(("resident", "loading", "out", "failed"))
        if slot == "failed":
            failed.add(d)
        elif slot != "out" and len(resident) + len(loading) < k:
            (resident if slot == "resident" else loading).add(d)
    scores = None if rng.random() < 0.2 else {
        d: float(rng.randint(0, 3)) for d in drafts if rng.random() < 0.9}
    active = rng.choice(sorted(resident) + [None])
    return view(iteration=rng.randint(0, 64), drafts=drafts, general=rng.choice(drafts),
                capacity=k, resident=resident, loading=loading, failed=failed,
                active=active, scores=scores)


def check(name: str, v: SchedView, d: Decision) -> None:
    a = d.actions
    assert set(a.evict) <= v.resident and set(a.cancel) <= v.loading
    assert not set(a.prefetch) & (v.resident | v.loading) and len(set(a.prefetch)) == len(a.prefetch)
    assert not {d.run, d.preferred, d.wait_for, *a.prefetch} & v.failed
    left = v.resident - set(a.evict)
    assert len(left) + len(v.loading - set(a.cancel)) + len(a.prefetch) <= v.capacity
    if d.wait_for is None:
        assert d.run is None or d.run in left or (d.run == LOOKUP and name == "lookup-only")
    else:
        assert d.run == d.wait_for and d.wait_for in (v.loading | set(a.prefetch))
    if v.active in a.evict:  # only a blocking wait may take the idle active draft's slot
        assert name == "mab-sync" and d.wait_for and v.resident == {v.active}


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_invariants_random_states(name: str) -> None:
    for seed in range(300):
        rng = random.Random(seed)
        v = random_view(rng)
        plan_choice = rng.choice(v.drafts)
        c = rng.choice((0.1, 2.0))
        twins = [build(name, ucb_c=c, oracle_plan=lambda _, d=plan_choice: d) for _ in range(2)]
        for _ in range(rng.randint(0, 8)):
            draft, acc = rng.choice(v.drafts), rng.randint(0, 4)
            for p in twins:
                p.observe(draft, 4, acc)
        d = twins[0].decide(v)
        check(name, v, d)
        assert d == twins[1].decide(replace(v)), "decisions must be deterministic"


def test_cache_invariants_random_states() -> None:
    for seed in range(500):
        rng = random.Random(seed)
        v = random_view(rng)
        scores = {d: float(rng.randint(0, 3)) for d in v.drafts}
        a = update_cache(scores, v.resident, v.loading, v.capacity, v.active)
        working = set(rank(scores)[:v.capacity])
        assert v.active not in a.evict and not set(a.evict) & working
        assert set(a.prefetch) <= working and not a.cancel
        left = len(v.resident) - len(a.evict) + len(v.loading)
        assert left + len(a.prefetch) <= v.capacity


def test_oracle_dynamic_runs_the_lookup_where_its_plan_runs_the_target_alone():
    """The plan's target steps run the context lookup when the engine has one (a step
    where the context does not repeat; a gain where it does), keeping what the plan waits
    for as a fallback; a planned draft runs as planned; without the lookup, the target."""
    acts = CacheActions(prefetch=("math",))
    moves = {"chosen": Decision(None, None, CacheActions()),
             "waiting": Decision(None, "math", acts),
             "draft": Decision("code", "code", CacheActions())}
    for lookup in (True, False):
        for what, move in moves.items():
            p = make_policy("oracle-dynamic", oracle_plan=lambda _v, m=move: m, lookup=lookup)
            d = p.decide(view(resident={"code"}))
            if what == "draft":
                assert d.run == "code"
            else:
                assert d.run == (LOOKUP if lookup else None)
                assert d.preferred == ("math" if what == "waiting" else
                                       LOOKUP if lookup else None)
                assert d.actions == move.actions
    plain = Decision(None, None, CacheActions(), lookup=False)  # (the plan knows it fails)
    p = make_policy("oracle-dynamic", oracle_plan=lambda _v: plain, lookup=True)
    assert p.decide(view(resident={"code"})).run is None
