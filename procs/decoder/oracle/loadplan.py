"""oracle-dynamic's plan: the fastest draft schedule *and its loads*, knowing the future.

An oracle that only scores drafts per interval (and leaves residency to the cache manager)
learns that it needs a draft when it is already too late: it then falls back while the
draft loads, and can lose to oracle-static. This planner knows every draft's acceptance
table and what everything costs, so it queues the loads that later intervals need early
enough for the drafts to be resident by then, under the same K slots and the same loader
as every other policy: up to K loads queued at once (a queued load holds its slot), served
one after another in issue order (sim/loadqueue.py, the runtime's loader).

A shortest-path search over scheduling points. A state is (position, active draft and how
far its KV cache is behind, resident set, the load queue with what is left of its head); a
move is which resident draft runs next, or the target alone (always a choice: with the
tables the plan knows when no draft pays, the speculation gate's question answered
exactly; where the runtime runs its context lookup there, the plan counts what the lookup's
own table gains and its verifies cost, so no draft is chosen that the lookup alone beats),
for N iterations or for one (the gate's probe: the plan decides as finely as any
online policy), and which drafts to append to the queue, evicting residents that do not
run. Time is counted in SD iterations (`PlanCosts`) as the simulator and the runtime charge
it: each draft's own iteration cost and a target step, both growing with the context; a
catch-up over the whole context for a draft another ran before (or just bound), over the
tokens it missed for one resumed after target steps; the scheduling point's overhead;
iterations slowed while the loader works; and every landed draft's bind on the decoder. A
load lands when the loader's time covers it and becomes runnable at the next scheduling
point (bound there). Load time is kept in fine quanta (`PlanCosts.quantum`; coarse ones,
rounded the same way at every short interval, add up to intervals of waiting that the
runtime does not have). At request start the loads go out before the prompt prefills
(Alg. 3), so they progress during the prefill.

The search is A* under an admissible bound (the rest with the drafts held all resident, or
any draft for one more bind), so its value is exact for the costs it is given, as an
exhaustive dynamic programme's would be (tests/test_loadplan.py checks the two agree), at a
fraction of the states; a plan that leaves a slot free while the loader is idle tries no
later load (it could only have loaded sooner), which halves a request's opening search.
oracle-static's schedule (load the best single draft at the start, run it throughout) is
one of the plans it considers, so the plan is never slower than it in its own cost model. Pure (lists and ints); the decoder and the simulator run the same
plan.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations, permutations, product

from memspec.procs.decoder.oracle.replay import Table, step_accepted
from memspec.procs.decoder.sched.costs import PlanCosts

Loading = tuple[tuple[str, float], ...]  # the load queue in issue order: (draft, iterations
# left); the loader serves the first, the others wait for it
State = tuple[int, str | None, frozenset[str], Loading, int, bool]  # (position, active,
# resident, queue, tokens the active draft's KV cache is behind: it catches up on them when it
# runs, settled: the plan left a slot free when it could have filled it, so it loads no more)
EPS = 1e-9


@dataclass(frozen=True)
class Step:
    run: str | None  # the draft for the next interval (None: target alone)
    loads: tuple[str, ...] = ()  # append these to the load queue now, in this order
    evicts: tuple[str, ...] = ()  # ... after evicting these residents
    value: float = 0.0  # iterations to the end of the trajectory under this plan
    limit: int = 0  # iterations before the next scheduling point (0: N)
    lookup: bool = True  # where `run` is None, the context lookup runs (False: plain target
    # steps, where the plan knows the lookup's proposals would be rejected)


PLAIN = -2  # a move's run: the target alone with the context lookup off (-1: with it on)

Key = tuple[int, int, int, int, int, int, tuple[int, ...], int]  # a State coded for the
# search: (position, active (-1: none), its KV behind, resident bit mask, queue head (-1: none),
# its quanta left, the drafts queued behind it: they have not started, settled (0/1))
Code = tuple[int, tuple[int, ...], int, int, int, int]  # a move coded: (run (-1: target),
# loads, evict mask, quanta of the loads, quanta of the last load, iterations)
_TARGET: Code = (-1, (), 0, 0, 0, 0)


class PlanBudget(Exception):
    """A search expanded more states than its budget: the caller plans over fewer drafts
    (oracle.DynamicPlan) rather than stall the decoder, whose heartbeat waits on it."""


class LoadPlanner:
    """The plan for one trajectory; `step` answers any state (memoised: re-planning after
    a late load or a state the plan did not expect costs only the new states). The search
    runs on states coded as ints (drafts as bits and indices, load time in quanta): the
    decoder solves it when a request starts."""

    def __init__(self, tables: Mapping[str, Table], gamma: int, N: int, K: int,
                 costs: PlanCosts, prompt_len: int = 0, budget: int | None = None,
                 lookup: Sequence[int | None] | None = None, settle: bool = True) -> None:
        self.prompt_len = prompt_len
        # a plan that leaves a slot free with the loader idle loads nothing later (`_declines`;
        # False: every later load is tried too, as the tests' exhaustive programme does)
        self.settle = settle
        # the context lookup's table (`lookup.lookup_table`): where the plan runs the target
        # alone the runtime runs the lookup, whose match is a verify that may gain tokens
        self.lookup = list(lookup) if lookup is not None else None
        self.budget = budget  # states one search may expand (None: no limit); counted, not
        # timed, so the decoder and the simulator give up at the same point
        self.expanded = 0  # states expanded by every search so far
        self.tables = {d: list(tables[d]) for d in sorted(tables)}
        self.drafts = tuple(self.tables)
        self.n = min((len(t) for t in self.tables.values()), default=0)
        self.gamma, self.N, self.K, self.costs = gamma, N, max(0, K), costs
        self._ix = {d: i for i, d in enumerate(self.drafts)}
        self._full = tuple(self._units(self.load_left(d)) for d in self.drafts)
        self._memo: dict[Key, tuple[float, Code]] = {}
        self._intervals: dict[tuple[int, int, int], tuple[int, float, int, int]] = {}
        self._ones: dict[int, tuple[list[float], list[int]]] = {}  # one iteration, by run
        # an interval runs N iterations, or one (the speculation gate's probe: a scheduling
        # point after every iteration is as fine as any online policy decides)
        self.lengths = (N, 1) if N > 1 else (N,)
        # the target alone: with the lookup where it matches, or (knowing where its
        # proposals are rejected, a verify dearer than a step) with it off; where the
        # lookup proposes exactly what is accepted (`row`) a rejection costs nothing
        self._alone = (-1, PLAIN) if self.lookup is not None and costs.row <= 0 else (-1,)
        self._codes: dict[tuple[int, int, int], list[Code]] = {}
        self._h: dict[int, tuple[list[list[float]], list[list[float]]]] = {}  # relaxed
        # bounds by drafts held: (the active draft fresh, stale)
        self._env: dict[tuple[int, int], tuple[list[float], list[float], list[float]]] = {}
        self._at: dict[int, list[tuple[int, int, float]]] = {}  # intervals by position

    # ---- time -----------------------------------------------------------------------------
    def load_left(self, draft: str) -> float:
        """A whole load of `draft`, as the plan counts it."""
        return self.quantise(self.costs.load[draft])

    def quantise(self, left: float) -> float:
        """Time left of a load in whole quanta, rounded up (one at least)."""
        q = self.costs.quantum
        return max(1, math.ceil(left / q - EPS)) * q

    def _units(self, t: float) -> int:
        """Progress in `t`, in quanta to the nearest."""
        return math.floor(t / self.costs.quantum + 0.5)

    def prefill_time(self) -> float:
        """Request start to the first scheduling point: the loads' head start."""
        c = self.costs
        return max(0.0, c.prefill + c.prefill_per_token * self.prompt_len)

    def _interval(self, run: int, pos: int, length: int) -> tuple[int, float, int, int]:
        """(position after, iterations of time, iterations, tokens the draft's KV is then
        behind) for one interval of `run`: the engine keeps the accepted proposals but the
        last when all it proposed were accepted (gamma; with exact proposals, whenever one
        was), and never the bonus token."""
        got = self._intervals.get((run, pos, length))
        if got is None:
            cost, acc = self._single(run)
            t, i, p, tail, n = 0.0, 0, pos, 0, self.n
            full = 1 if self.costs.row > 0 else self.gamma  # (exact proposals: all accepted)
            while i < length and p < n:
                a = acc[p]
                t += cost[p]
                p, tail, i = p + a + 1, 2 if a >= full else 1, i + 1
            got = self._intervals[(run, pos, length)] = (min(p, n), t, i, tail)
        return got

    def _single(self, run: int) -> tuple[list[float], list[int]]:
        """(time, accepted) of one iteration of `run` at every position: made once a plan
        (the search asks for every interval from every position, the bound's hot spot)."""
        got = self._ones.get(run)
        if got is None:
            cost: list[float] = []
            acc: list[int] = []
            c, gamma, n = self.costs, self.gamma, self.n
            name = self.drafts[run] if run >= 0 else None
            table = self.tables[name] if name is not None else None
            look = self.lookup if run == -1 else None
            for p in range(n):
                ctx = self.prompt_len + p
                if table is not None:
                    a = step_accepted(table, p, gamma)
                    cost.append(c.proposing(name, ctx, a, gamma))  # type: ignore[arg-type]
                elif look is not None and p < len(look) and look[p] is not None:
                    a = min(step_accepted(look, p, gamma), n - p)  # type: ignore[arg-type]
                    cost.append(c.lookup(a, ctx))
                else:
                    a = 0
                    cost.append(c.iteration(None, ctx))
                acc.append(a)
            got = self._ones[run] = (cost, acc)
        return got

    def _serve(self, queue: list[tuple[int, int]], progress: int) -> int:
        """The loader working `progress` quanta on `queue` (in place): the landed mask."""
        landed = 0
        while queue and queue[0][1] <= progress:
            d, left = queue.pop(0)
            landed |= 1 << d
            progress -= left
        if queue and progress > 0:
            queue[0] = (queue[0][0], queue[0][1] - progress)
        return landed

    def _bind(self, landed: int, queue: list[tuple[int, int]]) -> float:
        """Binding what landed, at the next scheduling point: the loader goes on meanwhile,
        but what it finishes then is only seen at the point after (kept a quantum out)."""
        t = self.costs.bind * landed.bit_count()
        if queue and t > 0:
            queue[0] = (queue[0][0], max(1, queue[0][1] - self._units(t)))
        return t

    # ---- moves ----------------------------------------------------------------------------
    def _moves(self, res: int, queued: int, qlen: int) -> list[Code]:
        """Moves allowed with `res` resident and `queued` in the queue: each resident draft
        or the target alone (always a choice: an upper bound must also know when not to
        speculate, as the online policies' speculation gate may), with each ordered choice
        of drafts neither resident nor queued to append to the queue, evicting as few
        residents that do not run as the slots need."""
        key = (res, queued, qlen)
        got = self._codes.get(key)
        if got is not None:
            return got
        resident = [i for i in range(len(self.drafts)) if res >> i & 1]
        todo = [i for i in range(len(self.drafts)) if not (res | queued) >> i & 1]
        free = self.K - len(resident) - qlen
        out: list[Code] = []
        for run, length in product((*resident, *self._alone), self.lengths):
            out.append((run, (), 0, 0, 0, length))
            evictable = [i for i in resident if i != run]
            for n in range(1, min(len(todo), free + len(evictable)) + 1):
                for ev in combinations(evictable, max(0, n - free)):
                    mask = sum(1 << i for i in ev)
                    out += [(run, loads, mask, sum(self._full[d] for d in loads),
                             self._full[loads[-1]], length) for loads in permutations(todo, n)]
        self._codes[key] = out
        return out

    def _go(self, key: Key, code: Code, queued: int) -> tuple[Key, float] | None:
        """(the next scheduling point's state, iterations of time) after a move from `key`
        (`queued`: quanta of load time in its queue); None for a move that queues a load
        behind one the loader is still on at the next point (queueing it there instead is
        the same to the loader and keeps the slot free for the interval)."""
        pos, active, behind, res, head, left, rest, settled = key
        run, loads, evict, added, last, length = code
        settled = settled or self._declines(key, code)
        c = self.costs
        nxt, work, its, tail = self._interval(run, pos, length)
        busy = queued + added
        dt = (c.slowed(work, busy * c.quantum) if busy else work) + c.overhead \
            + c.inner * (its - 1) + self._catchup(run, active, behind, pos)
        res &= ~evict
        if busy:
            progress = self._units(dt)
            if loads and busy - last > progress:
                return None
            full = self._full
            queue = ([(head, left)] if head >= 0 else []) + [(d, full[d]) for d in (*rest, *loads)]
            if progress < queue[0][1]:
                queue[0] = (queue[0][0], queue[0][1] - progress)
            elif nxt < self.n:  # bound at the next point (there is none after the last)
                landed = self._serve(queue, progress)
                dt += self._bind(landed, queue)
                res |= landed
        else:
            queue = []
        active, behind = (run, tail) if run >= 0 else (active, behind + nxt - pos)
        # an evicted draft is no longer "active": reloaded, it catches up like any other
        if active < 0 or not res >> active & 1:
            active, behind = -1, 0
        elif behind > 2 and c.switch_per_token == 0:
            behind = 3  # (past two tokens a resume costs the same however far behind)
        return self._pack(nxt, active, behind, res, queue, settled), dt

    def _declines(self, key: Key, code: Code) -> bool:
        """`code` leaves a slot free while the loader is idle and a draft is not resident.
        A load queued now rather than at a later point lands sooner, and slows as much of
        the decoding while it runs (the same loader time), so a plan that declines here is
        no faster for loading later: the search then tries no later load (without this,
        the same load at every later point: half the states of a 128-token plan, measured;
        tests check the value against the unrestricted programme, slowdowns included).
        At the opening this holds only where a load slows the prefill no more than the
        decoding after it (`_open`)."""
        if not self.settle or code[1] or key[4] >= 0:
            return False
        res = key[3] & ~code[2]
        return res.bit_count() < self.K and res != (1 << len(self.drafts)) - 1

    def _offered(self, run: int, length: int, pos: int) -> bool:
        """Every interval is, but a plain target step only where it differs from the
        target alone with the lookup on (the lookup proposes there), and one at a time: a
        plain stretch is those steps, each at a scheduling point that costs what an
        iteration's end does."""
        return run != PLAIN or (length == 1 and self.lookup is not None
                                and pos < len(self.lookup) and self.lookup[pos] is not None)

    def _catchup(self, run: int, active: int, behind: int, pos: int) -> float:
        """A draft's KV catch-up before its interval: over the whole context when another
        ran last (or it was just bound), over the tokens the target emitted since when it
        resumes after target steps (the engine's rule: more than two)."""
        c = self.costs
        if run < 0 or (run == active and behind <= 2):
            return 0.0
        missing = behind if run == active else self.prompt_len + pos
        return c.switch + c.switch_per_token * missing

    def _queued(self, key: Key) -> int:
        """Quanta of load time left in `key`'s queue."""
        return (key[5] if key[4] >= 0 else 0) + sum(self._full[d] for d in key[6])

    @staticmethod
    def _pack(pos: int, active: int, behind: int, res: int, queue: list[tuple[int, int]],
              settled: int = 0) -> Key:
        if not queue:
            return pos, active, behind, res, -1, 0, (), settled
        return (pos, active, behind, res, queue[0][0], queue[0][1],
                tuple(d for d, _ in queue[1:]), settled)

    def successors(self, key: Key) -> list[tuple[Code, Key, float]]:
        """(move, next state, iterations of time) of every move the plan makes from a
        coded state (`_key`); the search's graph, also walked exhaustively by the tests."""
        head, rest = key[4], key[6]
        queued = sum(1 << d for d in rest) | (1 << head if head >= 0 else 0)
        units = self._queued(key)
        out = []
        for code in self._moves(key[3], queued, len(rest) + (head >= 0)):
            if (key[7] and code[1]) or not self._offered(code[0], code[5], key[0]):
                continue  # (settled: no more loads)
            moved = self._go(key, code, units)
            if moved is not None:
                out.append((code, *moved))
        return out

    def _solve(self, key: Key) -> tuple[float, Code]:
        """The fastest way on from `key` and its first move (memoised along best paths:
        the rest of a best path is the best from each of its states)."""
        got = self._memo.get(key)
        if got is None:
            self._search({key: 0.0})
            got = self._memo[key]
        return got

    def _search(self, starts: Mapping[Key, float], limit: float = math.inf) -> Key | None:
        """A* from `starts` (each reached after that much time) to the end of the
        trajectory under `_bound`: a lower bound, exact on earlier best paths. Records the
        best path's moves and returns the start it leaves from; None (nothing recorded)
        once every way on is known to take longer than `limit`. Raises PlanBudget (nothing
        recorded) past the budget."""
        g = dict(starts)
        spent = 0
        parent: dict[Key, tuple[Key, Code]] = {}
        heap = [(t + self._bound(k), -t, i, k) for i, (k, t) in enumerate(sorted(g.items()))]
        heapq.heapify(heap)
        order = len(heap)
        while True:
            if not heap:
                return None
            f, neg_g, _, key = heapq.heappop(heap)
            if -neg_g > g[key] + EPS:
                continue  # reached again at less cost since
            if f > limit:
                return None  # a lower bound on every path left already exceeds it
            if key[0] >= self.n or key in self._memo:
                break
            spent += 1
            self.expanded += 1
            if self.budget is not None and spent > self.budget:
                raise PlanBudget(f"plan search past {self.budget} states")
            gk = g[key]
            for code, nxt, dt in self.successors(key):
                ng = gk + dt
                if ng < g.get(nxt, math.inf) - EPS:
                    g[nxt], parent[nxt] = ng, (key, code)
                    order += 1
                    heapq.heappush(heap, (ng + self._bound(nxt), -ng, order, nxt))
        if key not in self._memo:
            self._memo[key] = (0.0, _TARGET)
        total = g[key] + self._memo[key][0]
        while key in parent:
            prev, code = parent[key]
            self._memo[prev] = (total - g[prev], code)
            key = prev
        return key

    def _bound(self, key: Key) -> float:
        """What is left from `key` at least (exactly, on a known best path). Either the
        plan runs only what is resident now (the rest with those drafts), or it first runs
        another draft at some later point p: not before that draft can land (the queue's
        head, or a new load behind the whole queue) and one bind, and not before the
        resident drafts can reach p; the rest from p with every draft resident (`_later`).
        At least, too: the rest with the drafts it holds or queues resident at once, or
        with any draft after one bind. (A queued load that lands is bound even where the
        plan stays with the residents, but not inside the last interval: no bind of the
        queue's is counted.)"""
        known = self._memo.get(key)
        if known is not None:
            return known[0]
        pos, a, res, head, rest = key[0], key[1] + 1, key[3], key[4], key[6]
        stale = a > 0 and key[2] > 2  # (resuming the active draft catches it up)
        now = self._relaxed(res, stale)[pos][a]
        if key[7] and head < 0:
            return now  # (settled, nothing in flight: the residents are all it will run)
        c, q = self.costs, self.costs.quantum
        queued = sum(1 << d for d in rest) | (1 << head if head >= 0 else 0)
        busy = self._queued(key) * q
        new = [self._full[d] for d in range(len(self.drafts)) if not (res | queued) >> d & 1]
        avail = min(key[5] * q if head >= 0 else math.inf,
                    busy + min(new) * q if new else math.inf)
        later = self._later(res, pos, now, avail) if avail < math.inf else math.inf
        held = self._relaxed(res | queued, stale)[pos][a]
        free = self._relaxed((1 << len(self.drafts)) - 1, stale)[pos][a] + c.bind
        return max(min(now, later), min(held, free))

    def _later(self, res: int, pos: int, now: float, avail: float) -> float:
        """The least rest that first runs a draft not in `res` at some point p >= pos, with
        `now` the rest on `res` alone and `avail` the earliest such a draft lands: the
        residents take at least now - H(p) to reach p (H(p): the most any rest from p on
        `res` takes), so the rest is at least max(avail, now - H(p)) + bind + the rest
        from p with every draft resident. Per (res, pos) the points are sorted by H, so
        each bound is one bisection."""
        env = self._env.get((res, pos))
        if env is None:
            h, full = self._relaxed(res), self._relaxed((1 << len(self.drafts)) - 1)
            runs = [0, *(d + 1 for d in range(len(self.drafts)) if res >> d & 1)]
            rows = sorted((-max(h[p][r] for r in runs), min(full[p]) + self.costs.bind)
                           for p in range(pos, self.n))  # by H, largest first
            keys = [k for k, _ in rows]
            pre, m = [], math.inf
            for _, rest in rows:
                m = min(m, rest)
                pre.append(m)  # least rest among the points with the largest H
            suf, m = [math.inf] * (len(rows) + 1), math.inf
            for i in range(len(rows) - 1, -1, -1):
                m = min(m, rows[i][0] + rows[i][1])
                suf[i] = m  # least rest - H among the points with smaller H
            env = self._env[(res, pos)] = (keys, pre, suf)
        keys, pre, suf = env
        # points whose H >= now - avail can be reached by `avail`: they wait for the load
        k = bisect.bisect_right(keys, avail - now)
        return min(avail + pre[k - 1] if k else math.inf, now + suf[k])

    def _relaxed(self, mask: int, stale: bool = False) -> list[list[float]]:
        """h[pos][active + 1]: the fastest rest with the drafts of `mask` resident from now
        and nothing to load, bind or slow down (catch-ups as the plan charges them, a
        resumed draft's at its least: over three tokens). `stale`: the active draft's KV
        cache is more than two tokens behind, so resuming it catches up; without that the
        search had to walk every (position, tokens behind) pair a resume could meet
        (measured: four in five of a 128-token plan's states once catch-up is priced per
        token). Where the target alone moves two tokens or more the draft is stale after."""
        got = self._h.get(mask)
        if got is not None:
            return got[stale]
        n, D, c = self.n, len(self.drafts), self.costs
        runs = [-1, *(d for d in range(D) if mask >> d & 1)]
        h = [[0.0] * (D + 1) for _ in range(n + 1)]
        hs = [[0.0] * (D + 1) for _ in range(n + 1)]
        resume = c.switch + c.switch_per_token * 3
        inf = math.inf
        for pos in range(n - 1, -1, -1):  # (the search's hot spot: plain loops, no min())
            switch = c.switch + c.switch_per_token * (self.prompt_len + pos)
            moves = [m for m in self._pos_moves(pos) if m[0] < 0 or mask >> m[0] & 1]
            for a in runs:
                b0 = b1 = inf
                for run, nxt, dt in moves:
                    if run >= 0:
                        v0 = dt + h[nxt][run + 1]
                        if run != a:
                            v0 += switch
                            v1 = v0
                        else:
                            v1 = v0 + resume
                    else:
                        v1 = dt + hs[nxt][a + 1]
                        v0 = v1 if a >= 0 and nxt - pos >= 2 else dt + h[nxt][a + 1]
                    if v0 < b0:
                        b0 = v0
                    if v1 < b1:
                        b1 = v1
                h[pos][a + 1], hs[pos][a + 1] = b0, b1 if a >= 0 else b0
        self._h[mask] = (h, hs)
        return hs if stale else h

    def _pos_moves(self, pos: int) -> list[tuple[int, int, float]]:
        """(run, position after, iterations of time) of every interval from `pos`, with no
        load, bind or catch-up: what `_relaxed` weighs at each position."""
        got = self._at.get(pos)
        if got is None:
            c, got = self.costs, []
            for run, length in product((*self._alone, *range(len(self.drafts))),
                                       self.lengths):
                if not self._offered(run, length, pos):
                    continue
                nxt, work, its, _tail = self._interval(run, pos, length)
                got.append((run, nxt, work + c.overhead + c.inner * (its - 1)))
            self._at[pos] = got
        return got

    # ---- the runtime's view ---------------------------------------------------------------
    def state(self, pos: int, active: str | None, resident: frozenset[str],
              queue: Loading = (), behind: int = 0, settled: bool = False) -> State:
        """A runtime state in the plan's terms (resident: runnable drafts only; a load in
        flight is at least one quantum from landing)."""
        resident = frozenset(d for d in resident if d in self.tables)
        q = self.costs.quantum
        queue = tuple((d, self.quantise(max(left, q))) for d, left in queue
                      if d in self.tables and d not in resident)
        if active not in resident:
            active, behind = None, 0
        elif active is not None:
            behind = max(1, behind)  # (a draft that ran keeps at most all but one token)
        return min(pos, self.n), active, resident, queue, max(0, behind), settled

    def coded(self, state: State) -> Key:
        """A state as the search codes it."""
        pos, active, resident, queue, behind, settled = self.state(*state)
        ix = self._ix
        items = [(ix[d], max(1, round(left / self.costs.quantum))) for d, left in queue]
        return self._pack(pos, ix[active] if active is not None else -1, behind,
                          sum(1 << ix[d] for d in resident), items, int(settled))

    def _state(self, key: Key) -> State:
        pos, active, behind, res, head, left, rest, settled = key
        names, q = self.drafts, self.costs.quantum
        queue = () if head < 0 else ((names[head], left * q),
                                     *((names[d], self._full[d] * q) for d in rest))
        resident = frozenset(d for i, d in enumerate(names) if res >> i & 1)
        return (pos, names[active] if active >= 0 else None, resident, queue, behind,
                bool(settled))

    def _step(self, code: Code, value: float) -> Step:
        run, loads, evict = code[:3]
        names = self.drafts
        return Step(names[run] if run >= 0 else None, tuple(names[d] for d in loads),
                    tuple(d for i, d in enumerate(names) if evict >> i & 1), value,
                    0 if code[5] == self.N else code[5], run != PLAIN)

    def _code(self, move: Step) -> Code:
        ix, full = self._ix, self._full
        loads = tuple(ix[d] for d in move.loads)
        run = ix[move.run] if move.run is not None else -1 if move.lookup else PLAIN
        return (run, loads,
                sum(1 << ix[d] for d in move.evicts), sum(full[d] for d in loads),
                full[loads[-1]] if loads else 0, move.limit or self.N)

    def step(self, state: State) -> Step:
        """The plan's move at a scheduling point."""
        value, code = self._solve(self.coded(state))
        return self._step(code, value)

    def after(self, state: State, move: Step) -> State:
        """The state the plan expects at the next scheduling point after `move`."""
        key = self.coded(state)
        moved = self._go(key, self._code(move), self._queued(key))
        assert moved is not None, "a move the plan does not make"
        return self._state(moved[0])

    def initial(self, resident: frozenset[str] = frozenset()) -> Step:
        """The move at request start, before the prompt prefills: the loads to queue (and
        the residents they evict), chosen with the prefill's head start counted."""
        start = self.coded((0, None, resident, ()))
        opening: dict[Key, tuple[float, Code]] = {}
        for code in self._moves(start[3], 0, 0):  # the loads (run: none yet)
            if code[0] < 0 and code[5] == self.N \
                    and code[3] - code[4] <= self._units(self.prefill_time()):
                after, dt = self._open(start, code)
                if after not in opening or dt < opening[after][0] - EPS:
                    opening[after] = (dt, code)
        first = self._search({k: dt for k, (dt, _) in opening.items()})
        assert first is not None  # the target alone always reaches the end
        best, code = opening[first][0] + self._memo[first][0], opening[first][1]
        if self.prefill_time() <= 0:  # the prefill's time unknown: what is as fast with a
            try:  # load out before it gets its start
                code = self._earlier(opening, code, best)
            except PlanBudget:
                pass  # a tie-break only: `code` is as fast
        return self._step(code, best)

    def _earlier(self, opening: Mapping[Key, tuple[float, Code]], code: Code, best: float
                 ) -> Code:
        """An opening as fast as `code` that loads more: one search from all of them at
        once, given up as soon as none can still be as fast."""
        more = {after: dt for after, (dt, other) in opening.items()
                if len(other[1]) > len(code[1])}
        first = self._search(more, best + EPS) if more else None
        return opening[first][1] if first is not None else code

    def opened(self, resident: frozenset[str], move: Step) -> State:
        """The state the plan expects at the first scheduling point after `initial`."""
        start = self.coded((0, None, resident, ()))
        return self._state(self._open(start, self._code(move))[0])

    def _open(self, start: Key, code: Code) -> tuple[Key, float]:
        """The prefill after the opening move: the loads progress (and slow it meanwhile),
        what lands is bound."""
        queue = [(d, self._full[d]) for d in code[1]]
        pre = self.prefill_time()
        if queue:
            busy = sum(left for _, left in queue) * self.costs.quantum
            pre = self.costs.slowed(pre, busy, self.costs.prefill_slowdown)
        landed = self._serve(queue, self._units(pre))
        bind = self._bind(landed, queue)
        return self._pack(0, -1, 0, (start[3] & ~code[2]) | landed, queue,
                          int(self._declines(start, code) and self.costs.prefill_slowdown
                              <= self.costs.load_slowdown)), pre + bind


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares y = a + b x (b clamped >= 0: costs never fall with more tokens)."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        return (sum(ys) / n if n else 0.0, 0.0)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx)
    return my - b * mx, b
