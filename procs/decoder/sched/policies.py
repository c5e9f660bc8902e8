"""Draft scheduling policies behind one interface (ARCHITECTURE.md §5).

Pure logic: no sockets, processes, torch or clocks, so the decoder's controller and the
replay simulator run the very same code. At every scheduling point the caller builds a
`SchedView`, asks `decide`, issues `Decision.actions` (evictions, cancels, then loads) and
runs `Decision.run` for the next interval; after every SD iteration it calls `observe`.

Contract: `run` is always resident (after `actions.evict`), the context lookup (`LOOKUP`,
always runnable) or None (target alone), except that a blocking policy may set `wait_for`,
in which case `run == wait_for` and the caller blocks until that draft is resident (or has
failed; then it should decide again).
Quarantined (`failed`) drafts are never chosen, loaded or run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol, cast

from memspec.common.errors import ConfigError
from memspec.common.metrics import IterationRecord
from memspec.procs.decoder.sched.cache_manager import (
    NO_ACTIONS,
    CacheActions,
    lowest,
    rank,
    update_cache,
)
from memspec.procs.decoder.sched.costs import LOOKUP, PlanCosts
from memspec.procs.decoder.sched.gate import GateCosts, SpecGate, gate_decision


@dataclass
class SchedView:
    """What a policy sees at a scheduling point (every N iterations)."""

    iteration: int
    drafts: tuple[str, ...]  # all pool drafts, pool order
    general: str  # the general draft's name
    capacity: int  # K
    resident: frozenset[str]  # loaded + bound, runnable now
    loading: frozenset[str]  # loads in flight
    failed: frozenset[str]  # quarantined drafts (load failed): never choose, never load
    active: str | None  # draft that ran the last interval
    scores: Mapping[str, float] | None  # newest predictor ranking (None if none arrived yet)

    def usable(self) -> tuple[str, ...]:
        """Pool drafts that may still be chosen, in pool order."""
        return tuple(d for d in self.drafts if d not in self.failed)

    def runnable(self) -> frozenset[str]:
        return self.resident - self.failed

    def in_flight(self) -> frozenset[str]:
        return self.loading - self.resident - self.failed


@dataclass(frozen=True)
class Decision:
    run: str | None  # draft for the next interval; resident (or None = target-only)
    preferred: str | None  # what the policy would run if everything were resident
    actions: CacheActions  # loads/evictions to issue now
    wait_for: str | None = None  # blocking policies: wait until resident, then run it
    limit: int = 0  # iterations before the next scheduling point (0: the pool's N); the
    # speculation gate probes a draft with one
    lookup: bool = True  # with run None: whether the context lookup may run there
    # (oracle-dynamic's plan turns it off where it knows its proposals are rejected)


class Policy(Protocol):
    name: str
    uses_predictor: bool

    def reset(self) -> None:
        """Forget per-request state (a new prompt starts)."""

    def observe(self, draft: str | None, proposed: int, accepted: int) -> None:
        """Feed back one SD iteration's outcome."""

    def observe_iteration(self, rec: IterationRecord) -> None:
        """The whole record of one iteration (the loop calls this; costs, context)."""

    def decide(self, view: SchedView) -> Decision:
        """Choose the next interval's draft and the cache actions to issue now."""

    def wants_ranking(self) -> bool:
        """(Policies that use the predictor) send a snapshot after this interval?"""

    def keeps(self, draft: str) -> bool:
        """Go on running `draft` for the rest of this interval (after its last iteration)?"""


# An oracle plan sees the view and names the draft to run (oracle-static) or decides the
# interval outright, loads included (oracle-dynamic; None: nothing left to plan).
OraclePlan = Callable[[SchedView], "str | Mapping[str, float] | Decision | None"]


def _acquire(view: SchedView, want: str | None, victim: Callable[[set[str]], str | None],
             protect: set[str], *, cancel_ok: bool = False) -> CacheActions:
    """Load one draft reactively: a free slot if any, else evict `victim(candidates)`.

    Returns no actions when `want` is resident, loading or failed, or no slot can be freed.
    """
    busy = view.resident | view.loading | view.failed
    if want is None or want in busy or view.capacity < 1:
        return NO_ACTIONS
    if len(view.runnable()) + len(view.in_flight()) < view.capacity:
        return CacheActions(prefetch=(want,))
    out = victim(set(view.runnable()) - protect - {want})
    if out is not None:
        return CacheActions(prefetch=(want,), evict=(out,))
    out = victim(set(view.in_flight()) - {want}) if cancel_ok else None
    return CacheActions(prefetch=(want,), cancel=(out,)) if out is not None else NO_ACTIONS


def _after(view: SchedView, actions: CacheActions) -> frozenset[str]:
    """Drafts still runnable once the evictions are issued."""
    return view.runnable() - set(actions.evict)


def _keeper(view: SchedView, best: Callable[[frozenset[str]], str | None]) -> str | None:
    """The draft to protect from eviction: the active one, or, when none ran last interval
    (request start, target-only fallback), the resident one we would run now, so that
    loading toward a better draft never leaves the next interval without one."""
    if view.active in view.runnable():
        return view.active
    return best(view.runnable())


def _by_name(names: set[str]) -> str | None:
    """Victim choice for policies without scores: deterministic, nothing smarter to go on."""
    return max(names) if names else None


class TargetOnly:
    """No drafts at all: the baseline every speedup is measured against."""

    name = "target-only"
    uses_predictor = False

    def reset(self) -> None:
        pass

    def observe(self, draft: str | None, proposed: int, accepted: int) -> None:
        pass

    def observe_iteration(self, rec: IterationRecord) -> None:
        self.observe(rec.draft, rec.proposed, rec.accepted)

    def decide(self, view: SchedView) -> Decision:
        return Decision(None, None, NO_ACTIONS)

    def keeps(self, draft: str) -> bool:
        return True

    def wants_ranking(self) -> bool:
        return self.uses_predictor


class LookupOnly(TargetOnly):
    """The context lookup alone as the draft (procs/decoder/drafts/lookup.py): no model, nothing to
    load; an iteration verifies what the context proposes, or is a plain target step."""

    name = "lookup-only"

    def decide(self, view: SchedView) -> Decision:
        return Decision(LOOKUP, LOOKUP, NO_ACTIONS)


class _StaticDraft(TargetOnly):
    """One draft for the whole request: load it, run it once resident, target alone before."""

    def target(self, view: SchedView) -> str | None:
        raise NotImplementedError

    def decide(self, view: SchedView) -> Decision:
        want = self.target(view)
        if want is None or want in view.failed:
            return Decision(None, None, NO_ACTIONS)
        protect = {view.active} if view.active else set()
        actions = _acquire(view, want, _by_name, protect)
        run = want if want in _after(view, actions) else None
        return Decision(run, want, actions)


class GeneralStatic(_StaticDraft):
    name = "general-static"

    def target(self, view: SchedView) -> str | None:
        return view.general


class OracleStatic(_StaticDraft):
    """Best single draft per prompt, from offline tables: the plan is asked once per request."""

    name = "oracle-static"

    def __init__(self, plan: OraclePlan) -> None:
        self.plan = plan
        self.choice: str | None = None
        self.asked = False

    def reset(self) -> None:
        self.choice, self.asked = None, False

    def target(self, view: SchedView) -> str | None:
        if not self.asked:
            self.choice, self.asked = _top1(_plan_scores(self.plan(view), view)), True
        return self.choice


def _top1(scores: Mapping[str, float], names: Iterable[str] | None = None) -> str | None:
    """Best of `names` (default: every scored draft) by score; None when there is none."""
    ranked = rank(scores, names)
    return ranked[0] if ranked else None


def _plan_scores(result: str | Mapping[str, float] | None, view: SchedView) -> dict[str, float]:
    """An oracle names one draft or ranks several; either way, scores over usable drafts."""
    if result is None:
        return {}
    scores = {result: 1.0} if isinstance(result, str) else result
    return {d: float(scores[d]) for d in view.usable() if d in scores}


class MemSpec(TargetOnly):
    """Keep the predicted top-K resident (Alg. 2), run the best resident one (Alg. 3); with
    the pool's speculation gate (``Gated``) only while it pays."""

    name = "memspec"
    uses_predictor = True

    def wants_ranking(self) -> bool:
        return True

    def scores(self, view: SchedView) -> dict[str, float]:
        """The predictor's scores over usable drafts; before any arrives, the general draft."""
        if view.scores is None:
            return {view.general: 1.0} if view.general not in view.failed else {}
        return {d: float(view.scores[d]) for d in view.usable() if d in view.scores}

    def decide(self, view: SchedView) -> Decision:
        scores = self.scores(view)
        keep = _keeper(view, lambda names: _top1(scores, names))
        actions = update_cache(scores, view.runnable(), view.in_flight(), view.capacity, keep)
        return Decision(_top1(scores, _after(view, actions)), _top1(scores), actions)


class Gated:
    """Any drafting policy behind the speculation gate (procs/decoder/sched/gate.py): its choice
    runs while it pays, is probed one iteration at a time while that is cheap, and the
    target runs alone otherwise (by choice: not booked as a fallback)."""

    def __init__(self, inner: Policy, gate: SpecGate) -> None:
        self.inner, self.gate = inner, gate
        self.name, self.uses_predictor = inner.name, inner.uses_predictor

    def reset(self) -> None:
        self.inner.reset()
        self.gate.reset()

    def observe(self, draft: str | None, proposed: int, accepted: int) -> None:
        self.inner.observe(draft, proposed, accepted)

    def observe_iteration(self, rec: IterationRecord) -> None:
        self.gate.observe(rec)
        self.inner.observe_iteration(rec)

    def decide(self, view: SchedView) -> Decision:
        return gate_decision(self.gate, self.inner.decide(view), bool(view.runnable()))

    def keeps(self, draft: str) -> bool:
        """A draft the gate let run stops at the first iteration after which its record no
        longer pays: the rest of the interval runs the target alone (an interval of N
        iterations of a draft that accepts nothing cost ~N target steps on a CPU)."""
        return self.gate.keeps(draft) and self.inner.keeps(draft)

    @property
    def ranking_horizon(self) -> int:
        """Tokens a request must still have ahead for a ranking to be worth asking for
        (the pool's `rank_horizon`, else `SpecGate.RANK_HORIZON`; none without the gate's
        costs)."""
        return self.gate.horizon if self.gate.costs is not None else 0

    def ranks_prompt(self, tokens: int, drafts: tuple[str, ...]) -> bool:
        """Rank the prompt before any draft has paid: only for a request long enough to pay
        a ranking back (`ranking_horizon`; 0 tokens: not known) and where the gate would
        look at a draft at all; else the resident draft is probed first (the encoding
        takes a core from the prefill)."""
        if self.gate.costs is None:
            return self.inner.wants_ranking()
        return self.inner.wants_ranking() and self.may_look(drafts) \
            and (tokens == 0 or tokens >= self.ranking_horizon)

    def may_look(self, drafts: tuple[str, ...]) -> bool:
        """Whether the gate would look at one of `drafts` now (a draft has paid, a first
        look is free, or the probe share affords one): if not, no ranking and no load can
        change what runs, so a request starts without either (the predictor's encoding of
        the prompt would take a core from the prefill)."""
        g = self.gate
        return g.costs is None or g.any_paid() or any(g.may_look(d) for d in drafts)

    def wants_ranking(self) -> bool:
        """Rankings only once a draft has paid in this request: until then the gate loads
        nothing while a resident draft can be probed, so a ranking could change neither
        residency nor the choice, and on a CPU every ranking takes a core from the target
        (measured: a ranking before each probe cost more than the probe itself)."""
        return self.inner.wants_ranking() and (self.gate.costs is None or self.gate.any_paid())


class OracleDynamic(TargetOnly):
    """Future knowledge of acceptance *and* of loads: the plan (procs/decoder/oracle/oracle.py)
    picks each interval's draft and starts every load early enough, under the same K and
    loader. An upper bound for the online policies, not a competitor to tune. Where the
    plan runs the target alone (by choice, or while a load it waits for lands) it runs the
    context lookup when the engine has one, as the gated policies do: an iteration without
    a match is that target step, so the plan's clock holds, and one with a match gains
    what the online policies gain there (without it, a prompt whose context repeats ran at
    half oracle-static's speed)."""

    name = "oracle-dynamic"

    def __init__(self, plan: OraclePlan, lookup: bool = False) -> None:
        self.plan, self.lookup = plan, lookup

    def decide(self, view: SchedView) -> Decision:
        d = self.plan(view)
        if not isinstance(d, Decision):
            d = Decision(None, None, NO_ACTIONS)
        if d.run is not None and d.run not in _after(view, d.actions):
            d = replace(d, run=None)  # guard: only resident drafts run
        if d.run is None and self.lookup and d.lookup:
            d = replace(d, run=LOOKUP, preferred=LOOKUP if d.preferred is None else d.preferred)
        return d


class PredictionOnly(MemSpec):
    """Predictor top-1 only, loaded reactively when chosen: no working set (ablation)."""

    name = "prediction-only"

    def decide(self, view: SchedView) -> Decision:
        scores = self.scores(view)
        want = _top1(scores)
        keep = _keeper(view, lambda names: _top1(scores, names))
        actions = _acquire(view, want, lambda names: lowest(scores, names), {keep})
        return Decision(_top1(scores, _after(view, actions)), want, actions)


class _Ucb:
    """UCB1 over drafts; reward = accepted tokens per SD iteration."""

    uses_predictor = False

    def __init__(self, c: float) -> None:
        self.c = c
        self.reset()

    def reset(self) -> None:
        self.pulls: dict[str, int] = {}
        self.rewards: dict[str, float] = {}

    def wants_ranking(self) -> bool:
        return False

    def keeps(self, draft: str) -> bool:
        return True

    def observe_iteration(self, rec: IterationRecord) -> None:
        self.observe(rec.draft, rec.proposed, rec.accepted)

    def observe(self, draft: str | None, proposed: int, accepted: int) -> None:
        if draft is None or draft == LOOKUP:  # (the gate's lookup: no arm of the bandit)
            return
        self.pulls[draft] = self.pulls.get(draft, 0) + 1
        self.rewards[draft] = self.rewards.get(draft, 0.0) + accepted

    def mean(self, draft: str) -> float:
        n = self.pulls.get(draft, 0)
        return self.rewards.get(draft, 0.0) / n if n else 0.0

    def index(self, draft: str) -> float:
        """Mean plus exploration bonus; untried drafts come first (infinite index)."""
        n = self.pulls.get(draft, 0)
        if n == 0:
            return math.inf
        total = sum(self.pulls.values())
        return self.mean(draft) + self.c * math.sqrt(math.log(total) / n)

    def pick(self, view: SchedView) -> str | None:
        """Explore each usable draft once (resident ones first, fewer loads), then UCB."""
        usable = view.usable()
        order = {d: i for i, d in enumerate(usable)}
        untried = [d for d in usable if self.pulls.get(d, 0) == 0]
        if untried:
            return min(untried, key=lambda d: (d not in view.resident, d not in view.loading,
                                               order[d]))
        return max(usable, key=lambda d: (self.index(d), -order[d]), default=None)

    def victim(self, names: set[str]) -> str | None:
        """Evict the resident the bandit values least (lowest index, then mean, then name)."""
        return min(names, key=lambda d: (self.index(d), self.mean(d), d), default=None)

    def best_known(self, names: frozenset[str], view: SchedView) -> str | None:
        order = {d: i for i, d in enumerate(view.drafts)}
        return max(names, key=lambda d: (self.mean(d), -order.get(d, 0)), default=None)


class MabAsync(_Ucb):
    """UCB choice loaded in the background; the best resident by mean reward runs meanwhile."""

    name = "mab-async"

    def decide(self, view: SchedView) -> Decision:
        chosen = self.pick(view)
        keep = _keeper(view, lambda names: self.best_known(names, view))
        actions = _acquire(view, chosen, self.victim, {keep})
        runnable = _after(view, actions)
        run = chosen if chosen in runnable else self.best_known(runnable, view)
        return Decision(run, chosen, actions)


class MabSync(_Ucb):
    """UCB choice, blocking until it is resident (the active draft is idle while it waits)."""

    name = "mab-sync"

    def decide(self, view: SchedView) -> Decision:
        chosen = self.pick(view)
        if chosen is None or chosen in view.runnable():
            return Decision(chosen, chosen, NO_ACTIONS)
        actions = _acquire(view, chosen, lambda names: self._victim(names, view.active), set(),
                           cancel_ok=True)
        if chosen in view.loading or chosen in actions.prefetch:
            return Decision(chosen, chosen, actions, wait_for=chosen)
        return Decision(self.best_known(view.runnable(), view), chosen, actions)

    def _victim(self, names: set[str], active: str | None) -> str | None:
        """Spare the active draft when another can go; it is idle during the wait anyway."""
        return self.victim(names - {active}) or self.victim(names)


def _need_plan(name: str, plan: object) -> OraclePlan:
    if not callable(plan):
        raise ConfigError(f"policy '{name}' needs an oracle plan from acceptance tables",
                          "run `memspec trace` first, or pick another policy")
    return cast(OraclePlan, plan)


_KW = ("oracle_plan", "costs", "gate", "gate_costs", "lookup", "lookup_first", "rank_horizon")
# the policies the pool's spec_gate applies to: every one that runs drafts, so that no
# baseline lacks a tool memspec has (oracle-dynamic plans the target alone itself)
GATED = ("general-static", "oracle-static", "mab-sync", "mab-async", "prediction-only",
         "memspec")


def make_policy(name: str, *, ucb_c: float = 2.0, **kw: object) -> Policy:
    """Build a policy by its config name (memspec.common.config.POLICIES); every policy
    here is deterministic.

    kw: `oracle_plan` (oracle-static: view -> draft name or scores; oracle-dynamic: view
    -> Decision); `costs` (PlanCosts, oracle-dynamic's beliefs); `gate` (bool, default
    True) and `gate_costs` (GateCosts, what an iteration costs on this machine) for the
    speculation gate of every drafting policy (GATED; no gate without costs); `lookup`
    (bool, default False): the executor runs the context lookup, and the gate runs it
    where the target would otherwise run alone; `lookup_first` (bool): the executor runs
    it in place of a model draft's iteration where the context repeats (engine.LOOKUP_FIRST),
    so the gate judges a draft against the target alone. Every policy's
    first decision is taken before the prompt prefills, so its initial loads overlap the
    prefill (procs/decoder/sched/loop.py, Alg. 3 line 3).
    """
    unknown = sorted(set(kw) - set(_KW))
    if unknown:
        raise ConfigError(f"unknown policy option(s) {', '.join(unknown)}",
                          f"valid: {', '.join(_KW)}")
    if not (isinstance(ucb_c, (int, float)) and math.isfinite(ucb_c) and ucb_c >= 0):
        raise ConfigError(f"ucb_c = {ucb_c!r} is not a finite number >= 0", "use e.g. 2.0")
    return _build(name, float(ucb_c), kw)


def _build(name: str, c: float, kw: Mapping[str, object]) -> Policy:
    costs = kw.get("costs")
    builders = _builders(name, c, kw.get("oracle_plan"),
                         costs if isinstance(costs, PlanCosts) else None,
                         bool(kw.get("lookup", False)))
    if name not in builders:
        raise ConfigError(f"unknown policy '{name}'", f"valid: {', '.join(builders)}")
    policy = builders[name]()
    gate_costs = kw.get("gate_costs")
    if name in GATED and bool(kw.get("gate", True)) and isinstance(gate_costs, GateCosts):
        horizon = kw.get("rank_horizon")
        return Gated(policy, SpecGate(gate_costs, lookup=bool(kw.get("lookup", False)),
                                      rank_horizon=horizon if isinstance(horizon, int) else None,
                                      lookup_first=bool(kw.get("lookup_first", False))))
    return policy


def _builders(name: str, c: float, plan: object, costs: PlanCosts | None = None,
              lookup: bool = False) -> dict[str, Callable[[], Policy]]:
    """Every policy by config name; oracle plans are checked only when an oracle is built."""
    return {
        "target-only": TargetOnly,
        "lookup-only": LookupOnly,
        "general-static": GeneralStatic,
        "oracle-static": lambda: OracleStatic(_need_plan(name, plan)),
        "mab-sync": lambda: MabSync(c),
        "mab-async": lambda: MabAsync(c),
        "prediction-only": PredictionOnly,
        "memspec": MemSpec,
        "oracle-dynamic": lambda: OracleDynamic(_need_plan(name, plan), lookup),
    }


POLICY_NAMES = tuple(_builders("", 2.0, None))
