"""Replay one request through a policy: the runtime's own scheduling loop on a simulated clock.

`simulate` runs procs/decoder/sched/loop.py's `Controller` (the decoder's Alg. 3 loop, message
handling included) against simulated parts, so the order of events is the runtime's by
construction and only what cannot run here is modelled:

- `SimClock`: time, advanced by what the cost model says each step costs;
- `SimChannels`: an event queue that plays the loader (one load at a time in issue order,
  `Loaded` at its finish time, a cancel frees it at once) and the predictor (`Ranking` of
  a snapshot `predict_s` after it starts; the newest waiting snapshot replaces an older one
  that has not started);
- `TableExecutor`: iterations from the acceptance tables (exact for greedy decoding), timed
  by the CostModel measured on the real runtime; it also holds the simulated slots.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from memspec.common.errors import ConfigError
from memspec.common.messages import Cancel, Load, Loaded, LoadFailed, Message, Ranking, Snapshot
from memspec.common.metrics import IterationRecord, RunStats, Summary
from memspec.procs.decoder.engine import PREFILL_CHUNK, prefill_pieces
from memspec.procs.decoder.oracle.oracle import make_plan
from memspec.procs.decoder.oracle.replay import Table, step_accepted
from memspec.procs.decoder.sched.costs import LOOKUP, PlanCosts
from memspec.procs.decoder.sched.gate import GateCosts
from memspec.procs.decoder.sched.loop import Controller, Job, Overhead
from memspec.procs.decoder.sched.policies import Policy, make_policy
from memspec.sim.costmodel import CostModel
from memspec.sim.loadqueue import LoadQueue

Scores = Callable[[int], Mapping[str, float] | None]  # generated tokens -> ranking


@dataclass
class SimRequest:
    prompt_id: str
    domain: str
    prompt_len: int
    tables: Mapping[str, Table]
    scores: Scores | None = None  # the predictor's answer to a snapshot at that position

    @property
    def length(self) -> int:
        return min(len(t) for t in self.tables.values())


@dataclass
class SimConfig:
    drafts: tuple[str, ...]
    general: str
    K: int
    N: int
    gamma: int
    max_new_tokens: int | None = None  # cut trajectories (output-length sweeps)
    plan: PlanCosts | None = None  # what oracle-dynamic believes loads cost (the runtime's)
    gate: bool = True  # the speculation gate of memspec and prediction-only
    gate_costs: GateCosts | None = None  # what it believes an iteration costs (default:
    # the cost model's own lines, as the decoder's start-up calibration measures them)
    prefill_chunk: int = PREFILL_CHUNK  # the engine's where its target chunks (the native CPU
    # forward: what `memspec bench` measures); 0: a runner that prefills in one piece
    rank_horizon: int | None = None  # the pool's (None: the tuned gate.RANK_HORIZON)


class SimClock:
    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds

    def overhead(self, kind: Overhead) -> None:
        self.t += {"sched": self.cost.sched_s, "inner": self.cost.inner_s,
                   "post": self.cost.post_s}[kind]


class SimSlots:
    """The simulated slots: binding costs what it cost the decoder, and each draft's KV
    cache coverage is booked (a fresh copy starts empty)."""

    def __init__(self, cost: CostModel, clock: SimClock) -> None:
        self.cost, self.clock = cost, clock
        self.kv: dict[str, int] = {}  # draft -> tokens its KV cache covers (0 after a load)

    def load_request(self, slot: int, generation: int, draft: str) -> Load:
        return Load(slot=slot, generation=generation, draft=draft, path="", transport="sim",
                    handle="", capacity=0)

    def bind(self, slot: int, generation: int, draft: str) -> None:
        self.clock.advance(self.cost.bind_s)
        self.kv[draft] = 0

    def unbind(self, draft: str) -> None:
        self.kv.pop(draft, None)


class TableExecutor:
    """One request's iterations from the tables; opening it is the prompt's prefill."""

    def __init__(self, req: SimRequest, cost: CostModel, cfg: SimConfig, clock: SimClock,
                 slots: SimSlots | None = None, between: Callable[[], bool] | None = None
                 ) -> None:
        self.req, self.cost, self.gamma, self.clock = req, cost, cfg.gamma, clock
        self.length = req.length if cfg.max_new_tokens is None \
            else min(req.length, cfg.max_new_tokens)
        self.stats = RunStats(prompt_tokens=req.prompt_len)
        self.stats.t_prefill = cost.prefill_s(req.prompt_len)
        clock.advance(cost.pre_s)
        self._prefill(cfg.prefill_chunk if between is not None else 0, between)
        # the predictor process encodes snapshots on the decoder's cores (CPU) and slows
        # the iterations that start while it works (as the cost model was fitted)
        self.predictor_busy: Callable[[float], bool] = lambda _t: False
        self.loader_busy: Callable[[float], bool] = lambda _t: False
        self.pos = 0
        self.slots = slots or SimSlots(cost, clock)
        self.kv = self.slots.kv
        self.last: str | None = None  # the last draft that ran
        self.prev: str | None = None  # the previous iteration's draft (None: the target)

    def _prefill(self, chunk: int, between: Callable[[], bool] | None) -> None:
        """The engine's chunked prefill (`prefill_pieces`): the prefill's time in proportion
        to each piece's tokens."""
        n = max(self.req.prompt_len - 1, 0)
        for a, b in prefill_pieces(n, chunk, between):
            self.clock.advance(self.stats.t_prefill * (b - a) / n)
        if n == 0:
            self.clock.advance(self.stats.t_prefill)

    # ---- Executor -------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.pos >= self.length

    def recent(self, n: int) -> list[int]:
        return []  # the simulated predictor answers by position

    def step(self, draft: str | None, desired: bool) -> IterationRecord:
        t = self.clock.now()
        speed = 1.0 + (self.cost.predictor_slowdown if self.predictor_busy(t) else 0.0) \
            + (self.cost.load_slowdown if self.loader_busy(t) else 0.0)
        rec = self._iterate(draft, t, desired, speed)
        if draft is not None and self.last is not None and draft != self.last:
            self.stats.switches += 1
        if draft is not None:
            self.last = draft
        self.prev = draft
        self.stats.records.append(rec)
        self.pos += rec.emitted
        self.clock.advance(rec.duration)
        return rec

    def _iterate(self, run: str | None, t: float, desired: bool, speed: float
                 ) -> IterationRecord:
        cost, gamma, pos = self.cost, self.gamma, self.pos
        context = self.req.prompt_len + pos
        if run is None:
            return IterationRecord(None, 0, 0, 1, t, t_verify=cost.target_cost(context) * speed,
                                   desired=desired, context=context)
        a = step_accepted(self.req.tables[run], pos, gamma)
        emitted = min(a + 1, self.length - pos)
        missing = context - self.kv.get(run, 0)
        # the engine books a (re)activation's prefill as catch-up: a switch, or the same
        # draft after target steps
        catch = cost.catchup_s(missing) if run != self.prev else 0.0
        # the engine's draft cache invariant: it keeps what it proposed and was accepted
        self.kv[run] = min(context + min(a, gamma - 1), context + emitted - 1)
        return IterationRecord(run, gamma, a, emitted, t,
                               t_draft=cost.spec_cost(run, context) * speed,
                               t_catchup=catch, desired=desired, context=context)


class SimChannels:
    """The loader and the predictor as timed events on the simulated clock."""

    def __init__(self, clock: SimClock, cost: CostModel, req_id: str, scores: Scores | None,
                 position: Callable[[], int]) -> None:
        self.clock, self.cost, self.req_id = clock, cost, req_id
        self.scores, self.position = scores, position
        self.loader = LoadQueue(free_at=clock.now())
        self.loads: dict[tuple[int, int], str] = {}  # (slot, generation) -> draft
        self.events: list[tuple[float, int, Message]] = []  # heap: (time, order, message)
        self.waiting: list[tuple[float, float, int, int]] = []  # (ready, start, seq, position)
        self.predictor_free = clock.now()
        self._order = 0

    def heartbeat(self, state: str) -> None:
        pass

    def send(self, msg: Message) -> None:
        now = self.clock.now()
        if isinstance(msg, Load):
            self.loads[(msg.slot, msg.generation)] = msg.draft
            self.loader.issue((msg.slot, msg.generation), now, self.cost.load_s[msg.draft])
        elif isinstance(msg, Cancel):
            draft = self.loads.pop((msg.slot, msg.generation), "")
            if self.loader.cancel((msg.slot, msg.generation), now):
                self._at(now, LoadFailed(msg.slot, msg.generation, draft, "cancelled"))
        elif isinstance(msg, Snapshot):
            if msg.seq:  # the first snapshot's cost is part of the measured pre_s
                self.clock.advance(self.cost.snapshot_s)
            self._predict(self.clock.now(), msg.seq)

    def predictor_busy(self, t: float) -> bool:
        """Is the predictor encoding a snapshot at `t`?"""
        return any(start <= t < ready for ready, start, _, _ in self.waiting)

    def _predict(self, at: float, seq: int) -> None:
        """The predictor answers the newest snapshot: one still waiting is replaced."""
        if self.waiting and at < self.waiting[-1][1]:
            start = self.waiting.pop()[1]
        else:
            start = max(at, self.predictor_free)
        self.predictor_free = start + self.cost.predict_s
        self.waiting.append((self.predictor_free, start, seq, self.position()))

    def _at(self, t: float, msg: Message) -> None:
        heapq.heappush(self.events, (t, self._order, msg))
        self._order += 1

    def _next_time(self) -> float | None:
        times = [t for t in (self.loader.next_done(),
                             self.events[0][0] if self.events else None,
                             self.waiting[0][0] if self.waiting else None) if t is not None]
        return min(times, default=None)

    def poll(self, timeout_s: float) -> list[Message]:
        """What has arrived by now; waiting advances the clock to the next arrival (or the
        timeout)."""
        if timeout_s > 0:
            nxt = self._next_time()
            until = self.clock.now() + timeout_s if nxt is None \
                else min(nxt, self.clock.now() + timeout_s)
            self.clock.t = max(self.clock.t, until)
        now = self.clock.now()
        for key, done, seconds in self.loader.finished(now):
            draft = self.loads.pop(key)  # type: ignore[arg-type]
            self._at(done, Loaded(key[0], key[1], draft, 0, seconds, ""))  # type: ignore[index]
        while self.waiting and self.waiting[0][0] <= now:
            ready, _start, seq, pos = self.waiting.pop(0)
            ranked = self.scores(pos) if self.scores is not None else None
            if ranked is not None:  # None: no ranking for this position (predictor silent)
                self._at(ready, Ranking(self.req_id, seq, list(ranked),
                                        [float(v) for v in ranked.values()],
                                        self.cost.predict_s))
        out = []
        while self.events and self.events[0][0] <= now:
            out.append(heapq.heappop(self.events)[2])
        return out


def simulate(policy_name: str, req: SimRequest, cost: CostModel, cfg: SimConfig,
             ucb_c: float = 2.0, resident: Sequence[str] = ()) -> RunStats:
    """One request from `resident` (cold start: empty); returns the runtime's RunStats."""
    return _run(policy_name, req, cost, cfg, ucb_c, resident, trace=False)[1]


def simulate_traced(policy_name: str, req: SimRequest, cost: CostModel, cfg: SimConfig,
                    ucb_c: float = 2.0, resident: Sequence[str] = ()) -> Summary:
    """The same, summarised as the decoder's Done.stats of a traced request."""
    return _run(policy_name, req, cost, cfg, ucb_c, resident, trace=True)[0]


def _run(policy_name: str, req: SimRequest, cost: CostModel, cfg: SimConfig, ucb_c: float,
         resident: Sequence[str], trace: bool) -> tuple[Summary, RunStats]:
    clock = SimClock(cost)
    executor: TableExecutor | None = None

    def position() -> int:
        return executor.pos if executor is not None else 0

    if policy_name == "lookup-only" and LOOKUP not in req.tables:
        raise ConfigError("the simulator has no acceptance table of the context lookup alone",
                          "run lookup-only for real (memspec generate --policy lookup-only)")
    if cfg.gate_costs is None:
        cfg = replace(cfg, gate_costs=cost.gate_costs())
    policy = build_policy(policy_name, req, cfg, position, ucb_c)
    sim_slots = SimSlots(cost, clock)
    channels = SimChannels(clock, cost, req.prompt_id, req.scores, position)
    ctl = Controller(cfg.drafts, cfg.general, cfg.K, cfg.N, 0, clock, channels, sim_slots)
    for d in resident:  # already resident when the request arrives
        slot = ctl.table.begin_load(d)
        if slot is not None:
            ctl.table.complete(slot.index, slot.generation, d)

    def prefill(between: Callable[[], bool] | None) -> TableExecutor:
        nonlocal executor
        executor = TableExecutor(req, cost, cfg, clock, sim_slots, between)
        executor.loader_busy = channels.loader.busy
        executor.predictor_busy = channels.predictor_busy
        return executor

    ctl.start(Job(req.prompt_id, "", policy, None, t_start=0.0, trace=trace, prefill=prefill,
                  chunks=cfg.prefill_chunk > 0,
                  max_new_tokens=cfg.max_new_tokens or req.length))
    while (summary := ctl.step()) is None:
        pass
    assert executor is not None
    return summary, executor.stats


def build_policy(name: str, req: SimRequest, cfg: SimConfig, position: Callable[[], int],
                 ucb_c: float = 2.0) -> Policy:
    """The runtime's policy object, with an oracle plan over this request's tables."""
    plan = make_plan(name, req.tables, cfg.gamma, cfg.N, position, cfg.K, cfg.plan,
                     req.prompt_len)
    return make_policy(name, ucb_c=ucb_c, oracle_plan=plan, costs=cfg.plan, gate=cfg.gate,
                       gate_costs=cfg.gate_costs, rank_horizon=cfg.rank_horizon)
