"""oracle-dynamic's plan: the fastest draft schedule *and its loads*, knowing the future.

An oracle that only scores drafts per interval (and leaves residency to the cache manager)
learns that it needs a draft when it is already too late: it then falls back while the
draft loads, and can lose to oracle-static. This planner knows every draft's acceptance
table and what a load costs, so it starts the load that a later interval needs early
enough for the draft to be resident by then, under the same K slots and the same one-load-
at-a-time loader as every other policy.

Dynamic programming over scheduling points. A state is (position, active draft, resident
set, the load in flight and what is left of it); a decision is which resident draft runs
the next N iterations (the target alone only while no draft is resident, as the online
policies do) and optionally which draft to start loading, evicting a resident that does
not run. Time is counted in SD iterations (`PlanCosts`): every draft iteration costs its
own cost, a target-only step `target`, a (re)activation `switch`, a load `load[d]`, and a
load lands when the time run since it started covers it (it becomes runnable at the next
scheduling point, as in the runtime). Remaining load time is rounded up to `quantum`, so a
plan never expects a draft earlier than it can land. The value is exact for the costs it
is given; oracle-static's schedule (load the best single draft at the start, run it
throughout) is one of the plans it considers, so the plan is never slower than it in its
own cost model. Pure (lists and ints); the decoder and the simulator run the same plan.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from memspec.procs.decoder.replay import Table, step_accepted

Loading = tuple[str, float] | None  # (draft, iterations left) of the load in flight
State = tuple[int, str | None, frozenset[str], Loading]  # (position, active, resident, load)


@dataclass(frozen=True)
class PlanCosts:
    """What oracle-dynamic believes things cost, in SD iterations of a draft."""

    load: Mapping[str, float]  # one load of each draft
    target: float = 1.0  # one target-only step
    switch: float = 0.25  # (re)activating a draft: its KV catch-up, fixed part
    switch_per_token: float = 0.0  # ... and per token of context it catches up on
    spec: Mapping[str, float] = field(default_factory=dict)  # per-draft iteration (default 1)
    quantum: float = 0.25  # load time is tracked in these units, rounded up
    timed: bool = False  # `target` was measured (not the prior): the speculation gate trusts it

    @classmethod
    def uniform(cls, drafts: Sequence[str], load_iters: float, **kw: float) -> PlanCosts:
        return cls(load={d: float(load_iters) for d in drafts}, **kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Step:
    run: str | None  # the draft for the next interval (None: target alone)
    load: str | None = None  # start loading this draft now
    evict: str | None = None  # ... after evicting this resident
    value: float = 0.0  # iterations to the end of the trajectory under this plan


class LoadPlanner:
    """The plan for one trajectory; `step` answers any state (memoised: re-planning after
    a late load or a state the plan did not expect costs only the new states)."""

    def __init__(self, tables: Mapping[str, Table], gamma: int, N: int, K: int,
                 costs: PlanCosts, prompt_len: int = 0) -> None:
        self.prompt_len = prompt_len
        self.tables = {d: list(t) for d, t in tables.items()}
        self.drafts = tuple(self.tables)
        self.n = min((len(t) for t in self.tables.values()), default=0)
        self.gamma, self.N, self.K, self.costs = gamma, N, max(0, K), costs
        self._interval = lru_cache(maxsize=None)(self._interval_raw)
        self._best = lru_cache(maxsize=None)(self._best_raw)

    def load_left(self, draft: str) -> float:
        """A whole load of `draft`, as the plan counts it."""
        return self.quantise(self.costs.load[draft])

    def quantise(self, left: float) -> float:
        q = self.costs.quantum
        return math.ceil(left / q - 1e-9) * q if left > 0 else 0.0

    def _interval_raw(self, run: str | None, pos: int) -> tuple[int, float]:
        """(position after, iterations of time) for one interval of `run` from `pos`."""
        t = 0.0
        for _ in range(self.N):
            if pos >= self.n:
                break
            if run is None:
                t += self.costs.target
                pos += 1
            else:
                t += self.costs.spec.get(run, 1.0)
                pos = min(pos + step_accepted(self.tables[run], pos, self.gamma) + 1, self.n)
        return pos, t

    def _choices(self, resident: frozenset[str], loading: Loading
                 ) -> list[tuple[str | None, str | None, str | None]]:
        """(run, load, evict) moves allowed in a state."""
        out: list[tuple[str | None, str | None, str | None]] = []
        # the target alone is always a choice: an upper bound must also know when not to
        # speculate (the online policies' speculation gate may choose it too)
        runs: list[str | None] = [*sorted(resident), None] if resident else [None]
        out += [(r, None, None) for r in runs]
        if loading is not None or self.K < 1:
            return out
        for d in self.drafts:
            if d in resident:
                continue
            if len(resident) < self.K:
                out += [(r, d, None) for r in runs]
            else:  # free a slot: evict a resident that does not run this interval
                for e in sorted(resident):
                    rest = sorted(resident - {e})
                    out += [(r, d, e) for r in (rest or [None])]
        return out

    def _move(self, state: State, run: str | None, load: str | None, evict: str | None
              ) -> tuple[State, float]:
        """(the next scheduling point's state, iterations of time) after a move."""
        pos, active, resident, loading = state
        res = resident - {evict} if evict else resident
        nxt, dt = self._interval(run, pos)
        if run is not None and run != active:
            dt += self.costs.switch + self.costs.switch_per_token * (self.prompt_len + pos)
        flight = loading if load is None else (load, self.load_left(load))
        if flight is not None:
            left = self.quantise(flight[1] - dt)
            res, flight = (res | {flight[0]}, None) if left <= 0 else (res, (flight[0], left))
        return (nxt, run if run is not None else active, res, flight), dt

    def _best_raw(self, state: State) -> Step:
        pos, _active, resident, loading = state
        if pos >= self.n:
            return Step(None, value=0.0)
        best: Step | None = None
        for run, load, evict in self._choices(resident, loading):
            nxt, dt = self._move(state, run, load, evict)
            value = dt + self._best(nxt).value
            # equal plans: the one that loads now (a load started early never costs here,
            # and lands earlier in the runtime than a plan can count on)
            if best is None or value < best.value - 1e-9 or \
                    (value <= best.value + 1e-9 and load is not None and best.load is None):
                best = Step(run, load, evict, value)
        assert best is not None
        return best

    def state(self, pos: int, active: str | None, resident: frozenset[str],
              loading: Loading = None) -> State:
        """A runtime state in the plan's terms (resident: runnable drafts only)."""
        resident = frozenset(d for d in resident if d in self.tables)
        if loading is not None:
            loading = (loading[0], self.quantise(max(loading[1], self.costs.quantum)))
        return min(pos, self.n), active if active in resident else None, resident, loading

    def step(self, state: State) -> Step:
        """The plan's move at a scheduling point."""
        return self._best(state)

    def initial(self) -> Step:
        """The move at request start, before the prompt prefills: the draft to start
        loading (the start state's best first load; the prefill's overlap is a bonus the
        plan does not count)."""
        move = self._best((0, None, frozenset(), None))
        return Step(None, move.load, None, move.value)

    def after(self, state: State, move: Step) -> State:
        """The state the plan expects at the next scheduling point after `move`."""
        return self._move(state, move.run, move.load, move.evict)[0]


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares y = a + b x (b clamped >= 0: costs never fall with more tokens)."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        return (sum(ys) / n if n else 0.0, 0.0)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx)
    return my - b * mx, b
