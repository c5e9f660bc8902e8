"""The exact optimum schedule: dynamic programming over (position, resident set, loads).

A true upper bound for every policy the simulator can run. It decides at the same
scheduling points (every N iterations), may only run a draft that is resident at the
decision, and pays the same iteration costs, but it is relaxed in the bound's favour
everywhere else: it knows every table, loads run in parallel (the loader serialises them)
and are timed in whole units of the cheapest iteration (rounded so they land early), and
catch-up prefills, prediction and scheduling overheads are free. So its time is a lower
bound on any simulated policy's decode time, and tokens / time an upper bound on throughput.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from itertools import combinations

from memspec.procs.decoder.replay import Table, step_accepted
from memspec.sim.costmodel import CostModel

EPS = 1e-9


@dataclass(frozen=True)
class Optimum:
    time_s: float  # minimal decode time (steady state)
    length: int  # tokens
    schedule: tuple[str | None, ...]  # draft per interval ("wait" intervals are omitted)

    @property
    def tokens_per_s(self) -> float:
        return self.length / self.time_s if self.time_s > 0 else 0.0


def optimum(tables: Mapping[str, Table], cost: CostModel, K: int, N: int, gamma: int,
            length: int | None = None, resident: Sequence[str] = (), prompt_len: int = 0,
            target_only: bool = True) -> Optimum:
    """Minimal decode time to commit the trajectory, starting from `resident`.

    `target_only=False` restricts the schedule to speculative intervals whenever a draft is
    resident (the space the paper's policies choose from); True is the true upper bound.
    """
    drafts = tuple(tables)
    n_tok = min(len(t) for t in tables.values())
    n_tok = n_tok if length is None else min(n_tok, length)
    K = max(0, min(K, len(drafts)))
    configs = [frozenset(c) for c in combinations(drafts, K)] if K else [frozenset()]

    @cache
    def interval(run: str | None, pos: int) -> tuple[int, float]:
        """(position after, seconds) for N iterations of `run` from `pos`."""
        t = 0.0
        for _ in range(N):
            if pos >= n_tok:
                break
            if run is None:
                t += cost.target_cost(prompt_len + pos)
                pos += 1
            else:
                t += cost.spec_cost(run, prompt_len + pos)
                pos = min(pos + step_accepted(tables[run], pos, gamma) + 1, n_tok)
        return pos, t

    # Loads are tracked in whole units of the cheapest iteration, rounded in the bound's
    # favour (a load's length down, elapsed time up): few distinct states, still a bound.
    unit = min([cost.target_cost(prompt_len), *(cost.spec_cost(d, prompt_len) for d in drafts)])
    load_units = {d: int(cost.load_s[d] // unit + EPS) for d in drafts}

    # loads also progress during time the steady clock does not charge (scheduling,
    # binding, catch-up): credit an interval's share of it to every pending load
    slack = cost.sched_s + cost.inner_s * max(0, N - 1) + cost.snapshot_s

    def advance(pending: frozenset[tuple[str, int]], dt: float
                ) -> tuple[frozenset[str], frozenset[tuple[str, int]]]:
        n = math.ceil((dt + slack) / unit - EPS)
        done = frozenset(d for d, left in pending if left <= n)
        still = frozenset((d, left - n) for d, left in pending if left > n)
        return done, still

    @cache
    def best(pos: int, res: frozenset[str], pending: frozenset[tuple[str, int]],
             waited: bool = False) -> tuple[float, tuple[str | None, ...]]:
        """Right after a wait only loads already issued may be waited for: no cycles."""
        if pos >= n_tok:
            return 0.0, ()
        loading = {d for d, _ in pending}
        out: tuple[float, tuple[str | None, ...]] = (float("inf"), ())
        for cfg in configs:  # slots are free to fill in the relaxation: always fill them
            keep = res & cfg
            keep_pending = frozenset(p for p in pending if p[0] in cfg)
            new = frozenset((d, load_units[d]) for d in cfg - res - loading)
            pend = keep_pending | new
            for run in (*sorted(keep), *((None,) if target_only or not res else ())):
                nxt, dt = interval(run, pos)
                done, still = advance(pend, dt)
                t_rest, sched = best(nxt, keep | done, still)
                if dt + t_rest < out[0]:
                    out = (dt + t_rest, (run, *sched))
            if pend and not (waited and new):  # or idle until the first pending load lands
                dt = min(left for _, left in pend) * unit
                done, still = advance(pend, dt)
                t_rest, sched = best(pos, keep | done, still, True)
                if dt + t_rest < out[0]:
                    out = (dt + t_rest, sched)
        return out

    start = frozenset(list(dict.fromkeys(d for d in resident if d in tables))[:K])
    t, sched = best(0, start, frozenset())
    return Optimum(t, n_tok, sched)
