"""The exact optimum schedule: a shortest path over (position, resident set, loads).

A true upper bound for every policy the simulator can run. It decides at the same
scheduling points (every N iterations, or after one: the speculation gate's probe, which
oracle-dynamic may also choose), may only run a draft that is resident at the
decision, and pays the same iteration costs, but it is relaxed in the bound's favour
everywhere else: it knows every table, loads run in parallel (the loader serialises them)
and are timed in whole units of the cheapest iteration (rounded so they land early), and
catch-up prefills, prediction and scheduling overheads are free. So its time is a lower
bound on any simulated policy's decode time, and tokens / time an upper bound on throughput.
The search is A* under the time left with every draft resident (exact, as the dynamic
programme over the same states it replaces, on far fewer of them).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from itertools import combinations, product

from memspec.procs.decoder.oracle.replay import Table, step_accepted
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
    lengths = (N, 1) if N > 1 else (N,)  # an interval, or one iteration (the gate's probe)

    @cache
    def interval(run: str | None, pos: int, length: int) -> tuple[int, float]:
        """(position after, seconds) for `length` iterations of `run` from `pos`."""
        t = 0.0
        for _ in range(length):
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
    slack = {n: cost.sched_s + cost.inner_s * max(0, n - 1) + cost.snapshot_s
             for n in lengths}

    @cache
    def shift(pending: frozenset[tuple[str, int]], n: int
              ) -> tuple[frozenset[str], frozenset[tuple[str, int]]]:
        done = frozenset(d for d, left in pending if left <= n)
        still = frozenset((d, left - n) for d, left in pending if left > n)
        return done, still

    def advance(pending: frozenset[tuple[str, int]], dt: float, length: int = N
                ) -> tuple[frozenset[str], frozenset[tuple[str, int]]]:
        if not pending:
            return frozenset(), pending
        return shift(pending, math.ceil((dt + slack[length]) / unit - EPS))

    OptState = tuple[int, frozenset[str], frozenset[tuple[str, int]], bool]

    def moves(state: OptState) -> list[tuple[tuple[str | None, ...], OptState, float]]:
        """((run,), next state, seconds) of every move; a wait (idle until the first
        pending load lands; right after a wait only loads already issued may be waited
        for: no cycles) runs nothing: ()."""
        pos, res, pending, waited = state
        out: list[tuple[tuple[str | None, ...], OptState, float]] = []
        for keep, pend, fresh, runs, first in fills(res, pending):
            for run, length in runs:
                nxt, dt = interval(run, pos, length)
                done, still = advance(pend, dt, length)
                out.append(((run,), (nxt, keep | done if done else keep, still, False), dt))
            if pend and not (waited and fresh):
                done, still = advance(pend, first * unit)
                out.append(((), (pos, keep | done, still, True), first * unit))
        return out

    @cache
    def fills(res: frozenset[str], pending: frozenset[tuple[str, int]]) -> tuple:
        """Per configuration (slots are free to fill in the relaxation: always fill them):
        the drafts kept, the loads then pending, whether any is new, the (run, length)
        moves, and the units until the first load lands. Many states share (res, pending)."""
        loading = {d for d, _ in pending}
        out = []
        for cfg in configs:
            keep = res & cfg
            new = frozenset((d, load_units[d]) for d in cfg - res - loading)
            pend = frozenset(p for p in pending if p[0] in cfg) | new
            runs = tuple(product((*sorted(keep), *((None,) if target_only or not res
                                                   else ())), lengths))
            out.append((keep, pend, bool(new), runs,
                         min(left for _, left in pend) if pend else 0))
        return tuple(out)

    # A*'s bound: the time left with every draft resident and nothing to load
    h = [0.0] * (n_tok + 1)
    for pos in range(n_tok - 1, -1, -1):
        h[pos] = min(dt + h[nxt] for run, length in product((None, *drafts), lengths)
                     for nxt, dt in [interval(run, pos, length)])

    start: OptState = (0, frozenset(list(dict.fromkeys(d for d in resident
                                                     if d in tables))[:K]), frozenset(), False)
    g = {start: 0.0}
    parent: dict[OptState, tuple[OptState, tuple[str | None, ...]]] = {}
    heap: list[tuple[float, int, float, OptState]] = [(h[0], 0, 0.0, start)]
    order = 0
    while heap:
        _f, _, at, state = heapq.heappop(heap)
        if at > g[state] + EPS:
            continue  # reached again at less cost since
        if state[0] >= n_tok:
            break
        for run, nxt, dt in moves(state):
            if at + dt < g.get(nxt, math.inf) - EPS:
                g[nxt], parent[nxt] = at + dt, (state, run)
                order += 1  # ties: the newest first (deepest)
                heapq.heappush(heap, (at + dt + h[nxt[0]], -order, at + dt, nxt))
    sched: tuple[str | None, ...] = ()
    t, node = g[state], state
    while node in parent:
        node, ran = parent[node]
        sched = ran + sched
    return Optimum(t, n_tok, sched)
