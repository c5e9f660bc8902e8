"""Oracle plans from acceptance tables: the future knowledge behind oracle-static/-dynamic.

The plans are pure (lists and ints): the decoder and the replay simulator hand the very same
plan to `make_policy(..., oracle_plan=...)`; each passes a `position()` callable that says
how many tokens the request has committed, which is all the tables need. oracle-static
names the best single draft; oracle-dynamic follows a plan of runs *and loads*
(procs/decoder/loadplan.py) under the pool's K and loader, re-planned from whatever state
the runtime is really in at each scheduling point. At run time the tables come from
`memspec trace`'s files (traced in the decoder's target precision), looked up by the
prompt's token ids: an oracle knows the future only of a traced prompt under greedy
decoding.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Iterable, Mapping

from memspec.common.config import PoolConfig
from memspec.common.errors import RequestError
from memspec.common.metrics import IterationRecord
from memspec.procs.decoder.cache_manager import CacheActions
from memspec.procs.decoder.loadplan import Loading, LoadPlanner, PlanCosts, linear_fit
from memspec.procs.decoder.policies import Decision, OraclePlan, SchedView
from memspec.procs.decoder.replay import Table, oracle_static
from memspec.procs.decoder.tablefiles import (
    pool_fingerprint,
    read_tables,
    tables_path,
    traced_sets,
    trajectories_path,
    trajectory_rows,
)

ORACLE_POLICIES = ("oracle-static", "oracle-dynamic")
OracleIndex = dict[tuple[int, ...], dict[str, list[int]]]


def static_plan(tables: Mapping[str, Table], gamma: int) -> OraclePlan:
    """oracle-static: the single draft that finishes this trajectory in fewest iterations."""
    best, _ = oracle_static(tables, gamma)

    def plan(_view: SchedView) -> str:
        return best

    return plan


class DynamicPlan:
    """oracle-dynamic at each scheduling point: the planner's move from the state the
    runtime is really in. What is left of a load in flight is the plan's own expectation
    (a load later than expected counts as one quantum from landing)."""

    def __init__(self, planner: LoadPlanner, position: Callable[[], int]) -> None:
        self.planner, self.position = planner, position
        self.flight: Loading = None  # the load in flight as the plan expects it

    def __call__(self, view: SchedView) -> Decision | None:
        p = self.planner
        resident, in_flight = view.runnable(), sorted(view.in_flight())
        pos = self.position()
        if pos >= p.n:
            return None
        if pos == 0 and not resident and not in_flight and view.iteration == 0:
            move = p.initial()  # request start: choose the draft that loads during prefill
            self.flight = (move.load, p.load_left(move.load)) if move.load else None
            return _decision(move, view, move.load)
        loading: Loading = None
        if in_flight:
            d = in_flight[0]
            loading = (d, self.flight[1] if self.flight and self.flight[0] == d
                       else p.load_left(d))
        state = p.state(pos, view.active, resident, loading)
        move = p.step(state)
        self.flight = p.after(state, move)[3]
        return _decision(move, view, move.load or (loading[0] if loading else None))


def _decision(move, view: SchedView, waiting_for: str | None) -> Decision:
    """The move as a Decision; a draft that is not runnable (or quarantined) never runs or
    loads. Target steps while the planned draft loads are fallback, as for every policy;
    target steps the plan chose over a resident draft are not."""
    load = move.load if move.load is not None and move.load not in view.failed else None
    evict = move.evict if load is not None and move.evict in view.runnable() else None
    run = move.run if move.run in view.runnable() and move.run != evict else None
    actions = CacheActions(prefetch=(load,) if load else (), evict=(evict,) if evict else ())
    chose_target = move.run is None and bool(view.runnable() - {evict})
    return Decision(run, run if run is not None or chose_target else waiting_for, actions)


def dynamic_plan(tables: Mapping[str, Table], gamma: int, interval: int, K: int,
                 costs: PlanCosts, position: Callable[[], int], prompt_len: int = 0
                 ) -> DynamicPlan:
    """oracle-dynamic: runs and loads planned together from the tables (loadplan.py)."""
    return DynamicPlan(LoadPlanner(tables, gamma, interval, K, costs, prompt_len), position)


def plan_costs(pool: PoolConfig, draft_bytes: Mapping[str, int] | None = None) -> PlanCosts:
    """oracle-dynamic's beliefs before the decoder has measured anything: the pool's
    load/iteration ratio for the general draft (edge-emulated storage is paced to it; a
    benchmark pins the measured one), scaled by each draft's size."""
    sizes = draft_bytes or {}
    ref = sizes.get(pool.general) or 0
    load = {d.name: pool.load_iter_ratio * (sizes.get(d.name, ref) / ref if ref else 1.0)
            for d in pool.drafts}
    return PlanCosts(load=load)


class PlanCostMeter:
    """oracle-dynamic's beliefs, learnt from the decoder's own finished requests: the SD
    iteration (without catch-up) is the unit; target-only steps, catch-up (a line over the
    tokens caught up on) and each draft's load (as the loader timed it) in that unit. The
    simulator's CostModel.plan_costs() is the same thing fitted offline."""

    def __init__(self, prior: PlanCosts, window: int = 4096) -> None:
        self.prior = prior
        self.spec: deque[float] = deque(maxlen=window)
        self.target: deque[float] = deque(maxlen=window)
        self.catchup: deque[tuple[float, float]] = deque(maxlen=window)

    def observe(self, records: Iterable[IterationRecord]) -> None:
        for r in records:
            if r.draft is None:
                self.target.append(r.duration)
            else:
                self.spec.append(r.duration - r.t_catchup)
                if r.t_catchup > 0 and r.catchup_tokens > 0:
                    self.catchup.append((float(r.catchup_tokens), r.t_catchup))

    def costs(self, load_s: Mapping[str, float]) -> PlanCosts:
        """`load_s`: the latest load time of each draft the loader reported."""
        if len(self.spec) < 8:
            return self.prior
        unit = statistics.fmean(self.spec)
        load = {d: load_s[d] / unit if load_s.get(d) else v for d, v in self.prior.load.items()}
        target = statistics.fmean(self.target) / unit if self.target else self.prior.target
        switch, per_token = self.prior.switch, self.prior.switch_per_token
        if len(self.catchup) >= 5:
            a, b = linear_fit([n for n, _ in self.catchup], [t for _, t in self.catchup])
            switch, per_token = max(0.0, a) / unit, b / unit
        return PlanCosts(load=load, target=target, switch=switch, switch_per_token=per_token,
                         timed=len(self.target) >= 8)


def make_plan(policy: str, tables: Mapping[str, Table], gamma: int, interval: int,
              position: Callable[[], int], K: int = 2, costs: PlanCosts | None = None,
              prompt_len: int = 0) -> OraclePlan | None:
    """The plan an oracle policy needs (None for every other policy); `K`, `costs`
    (default: 2.7 iterations per load) and the prompt's length shape oracle-dynamic's."""
    if policy == "oracle-static":
        return static_plan(tables, gamma)
    if policy == "oracle-dynamic":
        costs = costs or PlanCosts.uniform(list(tables), 2.7)
        return dynamic_plan(tables, gamma, interval, K, costs, position, prompt_len)
    return None


def oracle_index(pool: PoolConfig, dtype: str) -> OracleIndex:
    """Prompt ids -> per-draft tables, over every prompt set traced in the decoder's target
    precision whose tables match the pool's drafts (empty when none do: oracle requests
    then get a one-line error)."""
    fp = pool_fingerprint(pool)
    out: OracleIndex = {}
    for which in traced_sets(pool, dtype):
        tt = read_tables(tables_path(pool, which, dtype), pool.gamma, fp, dtype)
        if tt is None:
            continue
        rows = trajectory_rows(trajectories_path(pool, which, dtype), list(tt.rows))
        for pid, row in rows.items():
            out[tuple(row["prompt_ids"])] = tt.rows[pid]["tables"]
    return out


def prompt_tables(index: OracleIndex, policy: str, ids: list[int], greedy: bool
                  ) -> dict[str, list[int]]:
    """This prompt's tables, or a one-line RequestError saying why an oracle cannot run."""
    if not greedy:
        raise RequestError(f"policy '{policy}' replays greedy acceptance tables",
                           "use temperature 0, or another policy")
    tables = index.get(tuple(ids))
    if tables is None:
        raise RequestError(f"policy '{policy}' has no acceptance tables for this prompt",
                           "run `memspec trace` and use a traced prompt "
                           "(prompts/<domain>.jsonl, prompts/train.jsonl), or another policy")
    return tables
