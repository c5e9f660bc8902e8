"""Oracle plans from acceptance tables: the future knowledge behind oracle-static/-dynamic.

The plans are pure (lists and ints): the decoder and the replay simulator hand the very same
plan to `make_policy(..., oracle_plan=...)`; each passes a `position()` callable that says
how many tokens the request has committed, which is all the tables need. oracle-static
names the best single draft; oracle-dynamic follows a plan of runs *and loads*
(procs/decoder/oracle/loadplan.py) under the pool's K and loader, re-planned from whatever state
the runtime is really in at each scheduling point. At run time the tables come from
`memspec trace`'s files (traced in the decoder's target precision), looked up by the
prompt's token ids: an oracle knows the future only of a traced prompt under greedy
decoding. Where the engine runs the context lookup, the index also holds the lookup's own
table (under LOOKUP, from the trajectory): the runtime runs the lookup wherever the plan
runs the target alone, so the plan must know what that gains, or it picks drafts that the
lookup alone beats (measured: oracle-dynamic at 0.74x lookup-only in real runs).
"""

from __future__ import annotations

import functools
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from operator import itemgetter, mul
from typing import Any, Literal

from memspec.common.config import PoolConfig
from memspec.common.errors import RequestError
from memspec.common.metrics import IterationRecord
from memspec.common.tuned import knob
from memspec.procs.decoder.drafts.lookup import lookup_table
from memspec.procs.decoder.oracle.loadplan import (
    Loading,
    LoadPlanner,
    PlanBudget,
    State,
    Step,
    linear_fit,
)
from memspec.procs.decoder.oracle.replay import Table, oracle_static, replay_static
from memspec.procs.decoder.oracle.tablefiles import (
    pool_fingerprint,
    read_tables,
    tables_path,
    traced_sets,
    trajectories_path,
    trajectory_rows,
)
from memspec.procs.decoder.sched.cache_manager import CacheActions
from memspec.procs.decoder.sched.costs import LOOKUP, PlanCosts
from memspec.procs.decoder.sched.gate import GateCosts
from memspec.procs.decoder.sched.policies import Decision, OraclePlan, SchedView

PLAN_BUDGET = knob("oracle.PLAN_BUDGET")  # states one plan search may expand past the
# narrowest: the plan runs on the request's end-to-end clock, so `memspec bench tune` counts
# the search's time beside the plan it finds (tuned.json)


@dataclass(frozen=True)
class Traced:
    """One traced prompt: its drafts' tables and the greedy trajectory they were made on."""

    tables: Mapping[str, list[int]]
    tokens: tuple[int, ...]


OracleIndex = dict[tuple[int, ...], Traced]


def static_plan(tables: Mapping[str, Table], gamma: int) -> OraclePlan:
    """oracle-static: the single draft that finishes this trajectory in fewest iterations."""
    best, _ = oracle_static(tables, gamma)

    def plan(_view: SchedView) -> str:
        return best

    return plan


class DynamicPlan:
    """oracle-dynamic at each scheduling point: the planner's move from the state the
    runtime is really in. What is left of each queued load is the plan's own expectation,
    in the order the plan queued them; a load the plan expected to have landed by now is
    late and counts as one quantum from landing. The draft that ran last and how far its
    KV cache is behind come from what really ran (the view says None after target steps).

    The exact search can take minutes where many drafts are near-equal (the stores pool's
    datastores): it plans over the drafts that run this trajectory best alone, adding one at
    a time while a search stays within `budget` states, and over fewer again should a later
    re-plan outgrow it. The best single draft is always among them, so the plan stays at
    least oracle-static's; drafts resident or loading are always among them, so the plan
    counts every slot. The budget counts states, not seconds: the decoder and the
    simulator plan alike."""

    def __init__(self, tables: Mapping[str, Table], gamma: int, interval: int, K: int,
                 costs: PlanCosts, position: Callable[[], int], prompt_len: int = 0,
                 budget: int | None | Literal["tuned"] = "tuned",
                 lookup: Sequence[int | None] | None = None) -> None:
        self.tables, self.position = dict(tables), position
        self.budget = PLAN_BUDGET if budget == "tuned" else budget
        self._planner_of = functools.partial(LoadPlanner, gamma=gamma, N=interval, K=K,
                                             costs=costs, prompt_len=prompt_len,
                                             lookup=lookup)
        alone = {d: _alone(tuple(t), gamma) for d, t in self.tables.items()}
        self.order = sorted(self.tables, key=lambda d: alone[d])  # stable: pool order on ties
        self.n = min((len(t) for t in self.tables.values()), default=0)
        self.width = len(self.order)  # the top drafts the planner may use (a request met
        self.planner = self._planner(frozenset(), self.budget)  # mid-way narrows it in `step`)
        self.expected: State | None = None  # the state the plan expects next
        self.last: tuple[str, int, int] | None = None  # (active, position, behind) then
        self.opened = False

    def _planner(self, held: frozenset[str], budget: int | None) -> LoadPlanner:
        """A planner over the top `width` drafts and those `held` (resident or loading)."""
        names = set(self.order[:max(1, self.width)]) | (held & self.tables.keys())
        sub = {d: self.tables[d] for d in self.order if d in names}
        return self._planner_of(sub, budget=budget)

    def initial(self, resident: frozenset[str]) -> Step:
        """The opening move of the widest planner whose search fits the budget: one draft
        (and the residents) without a budget, then one more draft at a time."""
        self.width = 1
        self.planner = self._planner(resident, None)
        move = self.planner.initial(resident)
        while self.width < len(self.order) and self.budget != 0:  # (no wider search fits 0)
            self.width += 1
            wider = self._planner(resident, self.budget)
            try:
                move, self.planner = wider.initial(resident), wider
            except PlanBudget:
                self.width -= 1
                break
        return move

    def step(self, state: State) -> Step:
        """The move from `state`; a re-plan past the budget narrows the planner."""
        held = state[2] | {d for d, _ in state[3]}
        while True:
            try:
                return self.planner.step(state)
            except PlanBudget:
                self.width -= 1
                narrowest = self.width <= 1
                self.planner = self._planner(held, None if narrowest else self.budget)

    def __call__(self, view: SchedView) -> Decision | None:
        resident, pos = view.runnable(), self.position()
        if pos >= self.n:
            return None
        if not self.opened and pos == 0 and view.iteration == 0:
            self.opened = True  # request start: the loads that run during the prefill
            move = self.initial(resident)
            self.expected = self.planner.opened(resident, move)
            return _decision(move, view, move.loads[0] if move.loads else None)
        self.opened = True
        active, behind = self._active(view, pos)
        queue, exp = self._queue(view), self.expected
        # the plan's own "no more loads" holds only where the runtime is where it expected
        settled = bool(exp is not None and exp[5] and not queue
                       and exp[2] == frozenset(d for d in resident if d in self.tables))
        state = (pos, active, resident, queue, behind, settled)
        move = self.step(state)
        p = self.planner
        state = p.state(*state)
        self.expected = p.after(state, move)
        waiting = (move.loads + tuple(d for d, _ in state[3]))[:1]
        return _decision(move, view, waiting[0] if waiting else None)

    def _active(self, view: SchedView, pos: int) -> tuple[str | None, int]:
        """The draft that ran last and the tokens its KV cache is behind now: as the plan
        expects when the runtime is where it expected, else from what the view says ran."""
        exp = self.expected
        if exp is not None and exp[0] == pos and view.active in (None, exp[1]):
            self.last = (exp[1], pos, exp[4]) if exp[1] is not None else None
        elif view.active is not None and view.active in self.tables:  # (not the lookup)
            self.last = (view.active, pos, 1)
        if self.last is None:
            return None, 0
        draft, at, behind = self.last
        return draft, behind + pos - at

    def _queue(self, view: SchedView) -> Loading:
        """The loads in flight in issue order: late ones first (the loader took them
        first), then the ones the plan expects, then any the plan never queued."""
        flying = view.in_flight()
        queue = self.expected[3] if self.expected is not None else ()
        expected = [(d, left) for d, left in queue if d in flying]
        known = {d for d, _ in expected}
        q = self.planner.costs.quantum
        late = [(d, q) for d in sorted(flying - known) if d in self.tables]
        return (*late, *expected)


@functools.lru_cache(maxsize=8192)
def _alone(table: tuple[int, ...], gamma: int) -> int:
    """Iterations one draft takes over a trajectory alone, made once per table (a
    benchmark repeats its prompts, and this is on a request's clock)."""
    return replay_static({"d": table}, "d", gamma).iterations


def _decision(move: Step, view: SchedView, waiting_for: str | None) -> Decision:
    """The move as a Decision; a draft that is not runnable (or quarantined) never runs or
    loads. Target steps while the planned draft loads are fallback, as for every policy;
    target steps the plan chose over a resident draft are not."""
    loads = tuple(d for d in move.loads if d not in view.failed)
    evicts = tuple(e for e in move.evicts if e in view.runnable()) if loads else ()
    run = move.run if move.run in view.runnable() and move.run not in evicts else None
    actions = CacheActions(prefetch=loads, evict=evicts)
    chose_target = move.run is None and bool(view.runnable() - set(evicts))
    return Decision(run, run if run is not None or chose_target else waiting_for, actions,
                    limit=move.limit, lookup=move.lookup)


def dynamic_plan(tables: Mapping[str, Table], gamma: int, interval: int, K: int,
                 costs: PlanCosts, position: Callable[[], int], prompt_len: int = 0,
                 lookup: Sequence[int | None] | None = None) -> DynamicPlan:
    """oracle-dynamic: runs and loads planned together from the tables (loadplan.py)."""
    return DynamicPlan(tables, gamma, interval, K, costs, position, prompt_len,
                       lookup=lookup)


CALIBRATED_CONTEXT = 176  # where the calibration's lines are read for a prior with one slope:
# midway between the two contexts it times (calibration.CONTEXTS)


def plan_costs(pool: PoolConfig, draft_bytes: Mapping[str, int] | None = None,
               gate: GateCosts | None = None) -> PlanCosts:
    """oracle-dynamic's beliefs before the decoder has timed a request: the pool's
    load/iteration ratio for the general draft (edge-emulated storage is paced to it; a
    benchmark pins the measured one), scaled by each draft's size; and, from the start-up
    calibration when there is one (`gate`), what a target step, each draft's iteration and
    the lookup's verify cost, in the general draft's iteration. Without it every iteration
    costs one unit, a target step too, which on a CPU makes every draft look worth running."""
    sizes = draft_bytes or {}
    ref = sizes.get(pool.general) or 0
    load = {d.name: pool.load_iter_ratio * (sizes.get(d.name, ref) / ref if ref else 1.0)
            for d in pool.drafts}
    if gate is None:
        return PlanCosts(load=load)
    slope = gate.target[1]  # one slope: the verify's steeper one read at CALIBRATED_CONTEXT

    def at(line: tuple[float, float]) -> float:
        return line[0] + (line[1] - slope) * CALIBRATED_CONTEXT

    unit = at(gate.spec_line(pool.general)) + slope * CALIBRATED_CONTEXT
    if unit <= 0:
        return PlanCosts(load=load)
    spec = {d.name: at(gate.spec_line(d.name)) / unit for d in pool.drafts}
    spec[LOOKUP] = at(gate.spec_line(LOOKUP)) / unit
    # a verify of gamma + 1 rows against a step of one: a row, where it is known
    row = max(0.0, at(gate.verify) - at(gate.target)) / pool.gamma / unit \
        if gate.verify is not None and pool.gamma > 0 else 0.0
    # a typical draft step until the drafts are timed (a datastore runs none)
    call = {d.name: gate.draft_prior_s / pool.gamma / unit for d in pool.drafts
            if not gate.model_free(d.name)} if row > 0 else {}
    pre = gate.prefill or (0.0, 0.0)  # (the loads' head start, and what they slow)
    return PlanCosts(load=load, spec=spec, target=at(gate.target) / unit,
                     per_token=slope / unit, unit_s=unit, row=row, call=call, free=gate.free,
                     prefill=max(0.0, pre[0]) / unit, prefill_per_token=pre[1] / unit)


class PlanCostMeter:
    """oracle-dynamic's beliefs, learnt from the decoder's own finished requests: the mean
    SD iteration (without catch-up) is the unit; each draft's iteration and a target step as
    lines over the context (one slope, each its own intercept, as the cost model fits them),
    catch-up (a line over the tokens caught up on), each draft's load (as the loader timed
    it) and a bind (as the decoder timed it) in that unit. The simulator's
    CostModel.plan_costs() is the same thing fitted offline."""

    ENOUGH = 8  # timings before they replace the prior

    def __init__(self, prior: PlanCosts, window: int = 4096, gamma: int = 4) -> None:
        self.prior, self.gamma = prior, gamma
        self.spec = _Drafts(window)  # (draft, ctx, s, proposed, draft s), summed per draft
        self.target: deque[tuple[float, float]] = deque(maxlen=window)  # (context, seconds)
        self.catchup: deque[tuple[float, float]] = deque(maxlen=window)
        self.binds: deque[float] = deque(maxlen=window)
        self.look: deque[tuple[float, float, int]] = deque(maxlen=window)  # lookup
        # verifies: (context, seconds, tokens proposed)
        self.prefills: deque[tuple[float, float]] = deque(maxlen=window)  # (tokens, s)
        # the same while the loader worked (`IterationRecord.shared`; a prefill with the
        # opening loads in flight): kept out of the lines, they price the slowdown
        self.during: deque[tuple[str | None, float, float, int]] = deque(maxlen=window)
        self.prefills_during: deque[tuple[float, float, tuple[str, ...]]] = deque(
            maxlen=window)  # (tokens, s, the loads in flight as it began)
        self.points: deque[tuple[int, float]] = deque(maxlen=window)  # (points, sched s)

    def observe(self, records: Iterable[IterationRecord]) -> None:
        for r in records:
            # the lookup or a datastore that proposed nothing ran a target step (a model
            # draft proposes one at least)
            step = r.draft is None or r.proposed == 0
            if r.shared:
                self.during.append((None if step else r.draft, float(r.context),
                                    r.duration - r.t_catchup, r.proposed))
            elif step:
                self.target.append((float(r.context), r.duration))
            elif r.draft == LOOKUP:
                self.look.append((float(r.context), r.duration, r.proposed))
            else:
                self.spec.append((r.draft, float(r.context), r.duration - r.t_catchup,
                                  r.proposed, r.t_draft))
                if r.t_catchup > 0 and r.catchup_tokens > 0:
                    self.catchup.append((float(r.catchup_tokens), r.t_catchup))

    def observe_binds(self, loads: int, seconds: float) -> None:
        """A request's binds: `loads` landed drafts bound in `seconds` (RunStats.t_bind)."""
        if loads > 0:
            self.binds.append(seconds / loads)

    def observe_prefill(self, prompt_tokens: int, seconds: float, shared: bool = False,
                        loads: Sequence[str] = ()) -> None:
        """A request's prefill: the head start its loads get (`shared`: loads ran during
        it, which slow it; `loads`: those in flight as it began, RunStats.prefill_loads)."""
        if prompt_tokens > 0 and seconds > 0:
            if shared or loads:
                self.prefills_during.append((float(prompt_tokens), seconds, tuple(loads)))
            else:
                self.prefills.append((float(prompt_tokens), seconds))

    def observe_points(self, points: int, seconds: float) -> None:
        """A request's scheduling points and the time they took (draining replies,
        deciding, streaming): what one more point costs, so that the plan does not cut
        intervals it could run whole (measured ~0.3 ms a point on AVX2, a target step's
        twentieth)."""
        if points > 0 and seconds >= 0:
            self.points.append((points, seconds))

    def costs(self, load_s: Mapping[str, float]) -> PlanCosts:
        """`load_s`: the latest load time of each draft the loader reported. With a
        calibrated prior (`PlanCosts.unit_s`) every iteration grows with the context at the
        calibration's slope, timed at two contexts on purpose (a slope fitted over a few
        requests' contexts put a target step at -0.15 of an iteration, every target step
        free to the plan), and what has been timed replaces the prior even before the
        drafts have run ENOUGH iterations (a plan that drafts little learns the rest).
        Runs on the next request's clock (before its prefill): plain sums, no statistics
        module (~4x faster over full windows)."""
        p = self.prior
        if len(self.spec) >= self.ENOUGH:
            unit = self.spec.mean()
        elif p.unit_s > 0 and (self.target or self.look or self.prefills):
            unit = p.unit_s
        else:
            return p
        k = p.unit_s / unit if p.unit_s > 0 else 1.0  # a prior's value in this unit
        row, calls, save = 0.0, {}, {}
        if p.unit_s > 0:
            slope = p.per_token * p.unit_s
            # exact proposals: each timed iteration as if it had proposed gamma (a row and a
            # draft step more per proposal it did not make), so that spec[d] stays gamma's
            row = self._row(self._target(slope, unit, k), slope / unit, unit, k)
            if row > 0:
                calls = {d: self._call(d, unit, k) for d in p.load if d not in p.free}
                save = {d: (row + c) * unit for d, c in calls.items()}
            pooled = statistics.fmean(save.values()) if save else 0.0
            a = self.spec.rest(slope, None, pooled, self.gamma)
        else:
            a, slope = linear_fit([r[1] for r in self.spec], [r[2] for r in self.spec])
            if slope > 0 and any(_rest(rows, slope) <= 0 for rows in (self.target, self.look)
                                 if rows):
                a, slope = self.spec.mean(), 0.0  # (mean ratios)
        load = {d: load_s[d] / unit if load_s.get(d) else v * k for d, v in p.load.items()}
        switch, per_token = p.switch * k, p.switch_per_token * k
        if len(self.catchup) >= 5:
            ca, cb = linear_fit([n for n, _ in self.catchup], [t for _, t in self.catchup])
            switch, per_token = max(0.0, ca) / unit, cb / unit
        bind = sum(self.binds) / len(self.binds) / unit if self.binds else p.bind * k
        # each draft's own intercept once it ran ENOUGH iterations, else every draft's
        # (`a`: a few timings would price one draft by the moments it happened to run in)
        own = {d: self.spec.rest(slope, d, save.get(d, 0.0), self.gamma)
               for d in self.spec.drafts(self.ENOUGH)}
        spec = {d: (own.get(d, a) / unit if self.spec else p.spec.get(d, 1.0) * k)
                for d in p.load}
        if len(self.look) >= self.ENOUGH:
            spec[LOOKUP] = _rest(self.look, slope) / unit
        elif LOOKUP in p.spec:
            spec[LOOKUP] = p.spec[LOOKUP] * k
        # the prefill: the calibration's line until two prompt lengths ran with no load
        pre, pre_per_token = p.prefill * k, p.prefill_per_token * k
        if len({n for n, _ in self.prefills}) >= 2:
            pa, pb = linear_fit([n for n, _ in self.prefills], [t for _, t in self.prefills])
            pre, pre_per_token = max(0.0, pa) / unit, pb / unit
        # what loads beside a prefill cost it: an oracle that always loads at the opening
        # (a cold start) sees no prefill without one, hence the calibrated line
        pre_slow = _slowdown([_slowed_by(t / unit, pre + pre_per_token * n,
                                         sum(load[d] for d in loads if d in load) or math.inf)
                              for n, t, loads in self.prefills_during
                              if pre + pre_per_token * n > 0], p.prefill_slowdown, 3)
        got = replace(p, load=load, spec=spec, prefill=pre, prefill_per_token=pre_per_token,
                      target=self._target(slope, unit, k), per_token=slope / unit, bind=bind,
                      switch=switch, switch_per_token=per_token, unit_s=unit,
                      timed=len(self.target) >= self.ENOUGH, prefill_slowdown=pre_slow,
                      row=row, call=calls)
        if len(self.points) >= 3:
            got = replace(got, overhead=sum(t for _, t in self.points)
                          / sum(n for n, _ in self.points) / unit)
        during = []
        for run, c, x, n in self.during:
            it = got.iteration(None, c) if run is None else got.lookup(n, c) \
                if run == LOOKUP else got.proposing(run, c, n, self.gamma)
            if it > 0:
                during.append(x / unit / it)
        return replace(got, load_slowdown=_slowdown(during, p.load_slowdown, self.ENOUGH))

    def _row(self, step: float, per_token: float, unit: float, k: float) -> float:
        """One lookup verify row, in the unit: the lookup's verifies less a target step
        (`step` at an empty context, `per_token` more a context token) at their contexts,
        per token proposed (least squares through zero), once ENOUGH verifies and target
        steps were timed; else the prior's."""
        look = self.look
        if self.prior.row <= 0:  # (no calibration: the runtime proposes as it would)
            return 0.0
        if len(look) < self.ENOUGH or not self.target:
            return self.prior.row * k
        c, x, n = (list(map(itemgetter(i), look)) for i in range(3))
        den = sum(map(mul, n, n))
        num = sum(map(mul, x, n)) / unit - step * sum(n) - per_token * sum(map(mul, c, n))
        return max(0.0, num / den) if den > 0 else self.prior.row * k

    def _call(self, draft: str, unit: float, k: float) -> float:
        """One more proposal step of `draft`, in the unit: its drafting time over the
        proposals it made (a line; a head's first proposal comes with its catch-up), once
        it has run ENOUGH iterations of two lengths or more; else the prior's."""
        got = self.spec.call(draft, self.ENOUGH)
        return got / unit if got is not None else self.prior.call.get(draft, 0.0) * k

    def _target(self, slope: float, unit: float, k: float) -> float:
        """A target step at an empty context, in the unit (the prior's, until target steps
        were timed; without a calibrated prior its ratio at the drafts' contexts)."""
        if self.target:
            return _rest(self.target, slope) / unit
        if self.prior.unit_s > 0 or not self.spec:
            return self.prior.target * k
        ctx = statistics.fmean(r[1] for r in self.spec)
        return max(0.0, self.prior.target - slope * ctx / unit)


class _Drafts:
    """The drafts' iteration timings, (draft, context, seconds, proposals, drafting
    seconds), over a sliding window, with running sums per draft (a row leaving the window
    is subtracted): the meter's means cost O(drafts) a request, not O(window), on the
    next request's clock."""

    def __init__(self, window: int) -> None:
        self.rows: deque[tuple[str, float, float, int, float]] = deque(maxlen=window)
        # draft -> [rows, contexts, seconds, proposals, proposals^2, drafting s, k * drafting s]
        self.sums: dict[str, list[float]] = {}
        self.total = [0.0] * 7

    def append(self, row: tuple[str, float, float, int, float]) -> None:
        if len(self.rows) == self.rows.maxlen:
            self._add(self.rows[0], -1.0)
        self.rows.append(row)
        self._add(row, 1.0)

    def _add(self, row: tuple[str, float, float, int, float], sign: float) -> None:
        d, c, x, n, t = row
        for acc in (self.sums.setdefault(d, [0.0] * 7), self.total):
            for i, v in enumerate((1.0, c, x, n, n * n, t, n * t)):
                acc[i] += sign * v

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[tuple[str, float, float, int, float]]:
        return iter(self.rows)

    def mean(self) -> float:
        n, _, x = self.total[:3]
        return x / n if n > 0 else 0.0

    def rest(self, slope: float, draft: str | None = None, per: float = 0.0,
             gamma: int = 0) -> float:
        """The mean of (seconds - slope * context) (of `draft`, or of every draft): an
        iteration at an empty context; `per` seconds more for each of gamma proposals an
        iteration did not make."""
        acc = self.total if draft is None else self.sums.get(draft)
        if acc is None or acc[0] <= 0:
            return 0.0
        n, c, x, k = acc[:4]
        return (x - slope * c + per * (gamma * n - k)) / n

    def call(self, draft: str, enough: int) -> float | None:
        """Drafting seconds per proposal: the slope of a line over the proposals made."""
        acc = self.sums.get(draft)
        if acc is None or acc[0] < enough - 0.5:
            return None
        n, _, _, k, kk, t, kt = acc
        var = kk - k * k / n
        if var <= 1e-6 * n:  # (one length only: no slope to read)
            return None
        return max(0.0, (kt - k * t / n) / var)

    def drafts(self, enough: int) -> list[str]:
        """The drafts with at least `enough` rows in the window."""
        return [d for d, acc in self.sums.items() if acc[0] >= enough - 0.5]


def _rest(rows: Sequence[tuple[Any, ...]], slope: float, c: int = 0) -> float:
    """The mean of (seconds - slope * context) over rows holding the context at `c` and
    the seconds after it: an iteration at an empty context (C-level sums: the meter's
    fits run on the next request's clock)."""
    if not rows:
        return 0.0
    return (sum(map(itemgetter(c + 1), rows)) - slope * sum(map(itemgetter(c), rows))) \
        / len(rows)


SLOWEST = 10.0  # the most a load is believed to slow what runs beside it


def _slowed_by(took: float, work: float, busy: float) -> float:
    """How much slower `work` ran while the loader had `busy` of loads (as the planner
    charges it, `PlanCosts.slowed`) given that it `took` this long: the whole of it where
    the loads outlasted it, else only the part beside them (measured: a 28 ms head load
    beside a 150 ms prefill cost it ~20 ms, a 10% longer prefill but 3.5x slower beside
    the load; read as 10% the plan loaded beside every prefill)."""
    extra = took - work
    if extra <= 0:
        return 1.0
    if busy >= took:
        return took / work
    return min(SLOWEST, busy / (busy - extra)) if extra < busy else SLOWEST


def _slowdown(ratios: Sequence[float], prior: float, enough: int) -> float:
    """How much slower than the lines things ran while the loader worked (the median
    ratio, less one; never below zero: a load never speeds the decoder up)."""
    if len(ratios) < enough:
        return prior
    return max(0.0, statistics.median(ratios) - 1.0)


def make_plan(policy: str, tables: Mapping[str, Table], gamma: int, interval: int,
              position: Callable[[], int], K: int = 2, costs: PlanCosts | None = None,
              prompt_len: int = 0) -> OraclePlan | None:
    """The plan an oracle policy needs (None for every other policy); `K`, `costs`
    (default: 2.7 iterations per load) and the prompt's length shape oracle-dynamic's.
    `tables` may hold the context lookup's (under LOOKUP): no draft to load, it is what
    oracle-dynamic's target-alone intervals gain."""
    lookup = tables.get(LOOKUP)
    drafts = {d: t for d, t in tables.items() if d != LOOKUP}
    if policy == "oracle-static":
        return static_plan(drafts, gamma)
    if policy == "oracle-dynamic":
        costs = costs or PlanCosts.uniform(list(drafts), 2.7)
        return dynamic_plan(drafts, gamma, interval, K, costs, position, prompt_len,
                            lookup=lookup)
    return None


def oracle_index(pool: PoolConfig, dtype: str, sets: Sequence[str] | None = None
                 ) -> OracleIndex:
    """Prompt ids -> per-draft tables and trajectory, over every prompt set traced in the
    decoder's target precision whose tables match the pool's drafts (empty when none do:
    oracle requests then get a one-line error). `sets`: only these prompt sets (a tuning
    reads dev alone)."""
    fp = pool_fingerprint(pool)
    out: OracleIndex = {}
    for which in traced_sets(pool, dtype):
        if sets is not None and which not in sets:
            continue
        tt = read_tables(tables_path(pool, which, dtype), pool.gamma, fp, dtype)
        if tt is None:
            continue
        rows = trajectory_rows(trajectories_path(pool, which, dtype), list(tt.rows))
        for pid, row in rows.items():
            out[tuple(row["prompt_ids"])] = Traced(tt.rows[pid]["tables"],
                                                   tuple(int(t) for t in row["tokens"]))
    return out


def prompt_tables(index: OracleIndex, policy: str, ids: list[int], greedy: bool,
                  lookup: int = 0, gamma: int = 4) -> dict[str, list[int | None]]:
    """This prompt's tables, or a one-line RequestError saying why an oracle cannot run;
    with the engine's context lookup on (`lookup`: its minimum suffix), the lookup's own
    table too (LOOKUP), made here for this prompt alone (~2 ms; for every traced prompt at
    once it would be seconds on the first oracle request's clock)."""
    if not greedy:
        raise RequestError(f"policy '{policy}' replays greedy acceptance tables",
                           "use temperature 0, or another policy")
    traced = index.get(tuple(ids))
    if traced is None:
        raise RequestError(f"policy '{policy}' has no acceptance tables for this prompt",
                           "run `memspec trace` and use a traced prompt "
                           "(prompts/<domain>.jsonl, prompts/train.jsonl), or another policy")
    tables: dict[str, list[int | None]] = dict(traced.tables)
    if lookup:
        tables[LOOKUP] = list(_lookup_table(tuple(ids), traced.tokens, gamma, lookup))
    return tables


@functools.lru_cache(maxsize=4096)
def _lookup_table(ids: tuple[int, ...], tokens: tuple[int, ...], gamma: int, n_min: int
                  ) -> tuple[int | None, ...]:
    """A prompt's lookup table, made once (a benchmark repeats its prompts)."""
    return tuple(lookup_table(ids, tokens, gamma, n_min))


def exact_depth(tables: Mapping[str, Sequence[int | None]], gamma: int
                ) -> Callable[[str, int], int]:
    """oracle-dynamic's proposals (`Session.propose`): for a draft or the lookup at each
    position exactly the tokens the target accepts (its table; the lookup's None and 0: a
    plain step), gamma past a table or for a draft without one. The plan prices them so
    (`PlanCosts.row`, `PlanCosts.call`)."""

    def propose(draft: str, pos: int) -> int:
        table = tables.get(draft)
        if table is None or pos >= len(table):
            return gamma
        a = table[pos]
        return 0 if a is None else min(a, gamma)

    return propose
