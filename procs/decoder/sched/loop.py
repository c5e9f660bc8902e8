"""The MemSpec scheduling loop (paper Alg. 3), written once for the runtime and the simulator.

A request starts as Alg. 3 does: rank the prompt (policies that use the predictor), issue
the first decision's loads and prefill the prompt, so the initial draft loads while the
target prefills. The prompt's ranking is not waited for before the prefill: the target
prefills in chunks and the loads go out between two chunks as soon as the ranking lands
(the predictor encodes on the other core meanwhile); only what is left of the ranking's
round trip after the prefill is waited for. Then every N iterations: drain what the
loader and the predictor sent, let the policy (and its cache manager, Alg. 2) decide loads
and evictions, run the best *resident* draft for N iterations, then send a snapshot for
the next ranking (unless the policy needs none: memspec's closed speculation gate). Loads
complete in the loader; the loop learns of them at scheduling points and never waits for
one (mab-sync is the one policy that chooses to block, which is what it is there to show).

Nothing here touches a socket, a model or the wall clock. Time comes from a `Clock`, the
loader and the predictor are reached through `Channels`, landed drafts are bound by
`Slots`, and iterations run on an `Executor`. The decoder process passes a monotonic
clock, ZeroMQ sockets and the engine (procs/decoder/service.py); the replay simulator
(memspec.sim.simulate) passes a simulated clock, an event queue that plays loader and
predictor, and acceptance tables priced by a cost model. Both therefore run this very
code, message handling included: stale generations, quarantine, re-issued loads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import msgspec

from memspec.common.errors import MemspecError
from memspec.common.messages import (
    Cancel,
    Error,
    Load,
    Loaded,
    LoadFailed,
    Message,
    PeerRestarted,
    Ranking,
    Snapshot,
)
from memspec.common.metrics import (
    IterationRecord,
    LoadEvent,
    RankEvent,
    RunStats,
    Summary,
    Trace,
)
from memspec.common.tuned import knob
from memspec.procs.decoder.sched.costs import LOOKUP
from memspec.procs.decoder.sched.policies import Decision, Policy, SchedView
from memspec.procs.decoder.sched.residency import Slot, SlotState, SlotTable

INITIAL_RANKING_TIMEOUT_S = 2.0  # a predictor that does not answer must not stall requests
RANKING_POLL_S = 0.05
CHUNKED_WAIT_S = knob("loop.CHUNKED_WAIT_S")  # prefill in chunks this long at most while awaiting the first ranking
RESIDENCY_POLL_S = 0.02
# the predictor's encoding time per request, as a share of its decode time: snapshots beyond
# the prompt's go out only while the rankings so far stay within it (the paper's predictor
# costs 3.9%; on a CPU it shares the decoder's cores)
PREDICTOR_SHARE = knob("loop.PREDICTOR_SHARE")  # `memspec bench tune` (tuned.json)
SNAPSHOT_STALE_S = 0.5  # a snapshot not answered by then: the predictor is not working on it
Overhead = Literal["sched", "inner", "post"]


class Clock(Protocol):
    def now(self) -> float: ...

    def overhead(self, kind: Overhead) -> None:
        """The loop's own work happens here: "sched" at a scheduling point (drain, decide,
        heartbeat), "inner" between two iterations of one interval, "post" from the last
        iteration to the reply. Real time passes by itself (a no-op); a simulated clock
        charges what the cost model measured."""


class Channels(Protocol):
    """The loader and the predictor: Load/Cancel/Snapshot out; waiting is always `poll`."""

    def send(self, msg: Load | Cancel | Snapshot) -> None: ...

    def poll(self, timeout_s: float) -> list[Message]:
        """Replies that arrived within `timeout_s` (0: only those already there)."""

    def heartbeat(self, state: str) -> None: ...


class Slots(Protocol):
    """Where loaded drafts live: slot memory bound into the engine, or the simulator's books."""

    def load_request(self, slot: int, generation: int, draft: str) -> Load: ...

    def bind(self, slot: int, generation: int, draft: str) -> None:
        """Make a landed draft runnable; a MemspecError quarantines it."""

    def unbind(self, draft: str) -> None: ...


class Executor(Protocol):
    """One request's iterations: the engine's Session, or tables priced by a cost model."""

    stats: RunStats

    @property
    def done(self) -> bool: ...

    def step(self, draft: str | None, desired: bool) -> IterationRecord:
        """One SD iteration of a resident `draft`, or a target-only step for None."""

    def recent(self, n: int) -> list[int]:
        """The last `n` generated token ids (what a snapshot carries)."""


@dataclass
class Job:
    """One request as the loop runs it.

    `prefill` opens the executor (the target prefills the prompt) and calls `between`
    between prefill chunks while it returns True; the loop issues the initial loads (Alg. 3
    lines 2-5) before it, or from `between` once the first ranking lands, so loading overlaps
    the prefill. A job may instead come with its `executor` already open (prefilled)."""

    req_id: str
    prompt: str
    policy: Policy
    executor: Executor | None
    t_start: float  # clock time the request arrived
    trace: bool = False  # keep iteration records and residency events for the summary
    prefill: Callable[[Callable[[], bool] | None], Executor] | None = None
    max_new_tokens: int = 0  # the request's budget (0: unknown): a ranking's horizon
    chunks: bool = True  # the prefill calls `between` (exact-chunk runners); else it is
    # one piece, and a policy that needs the first ranking waits for it before the prefill


@dataclass
class _Running:
    job: Job
    events: list[LoadEvent] | None
    active: str | None = None  # the draft of the last interval
    iteration: int = 0
    seq: int = 0  # last snapshot sent
    rank_seq: int = -1  # newest ranking taken
    t_loop: float = 0.0
    t_initial: float = 0.0  # waited for the first ranking (after the prefill)
    opened: bool = False  # the first decision is applied (initial loads issued)
    ranking_s: float = 0.0  # the predictor's own time for the first ranking
    sent: dict[int, float] = field(default_factory=dict)  # snapshot seq -> clock when sent
    snapshots: int = 0  # sent
    rankings: list[RankEvent] = field(default_factory=list)  # (traced requests)
    t_sent: float = -1.0  # clock when the newest snapshot went out
    encode_s: float = 0.0  # the predictor's own seconds for this request's rankings
    last_encode_s: float = 0.0  # ... for the newest one


def _quiet(_msg: str) -> None:
    pass


class Controller:
    """The slot table, the newest ranking and at most one running request.

    `start` opens a request (first snapshot, prefill, first decision), `step`
    runs one scheduling interval and returns the summary once the request is done, and
    `handle` takes any reply at any time, also between requests.
    """

    def __init__(self, drafts: Sequence[str], general: str, capacity: int, N: int, T: int,
                 clock: Clock, channels: Channels, slots: Slots, *, cold_start: bool = False,
                 log: Callable[[str], None] = _quiet) -> None:
        self.drafts, self.general, self.N, self.T = tuple(drafts), general, N, T
        self.clock, self.channels, self.slots = clock, channels, slots
        self.cold_start = cold_start
        self.log = log
        self.table = SlotTable.create(capacity)
        self.scores: dict[str, float] | None = None
        self.running: _Running | None = None
        self.on_slots_changed: Callable[[], None] | None = None
        self.load_seconds: dict[str, float] = {}  # the latest load of each draft, loader-timed
        # told before every interval (and prefill chunk) whether the predictor or the loader
        # is working now: the decoder then leaves them a core, else takes every core
        self.on_helpers: Callable[[bool], None] | None = None
        self._shared = False  # the interval runs while a helper holds a core (see threads.py)
        # whether a load in flight holds a core: yes at full storage speed; a paced
        # (edge-emulated) load mostly sleeps, its reads and checks come in ~1 ms bursts,
        # and a decoder left one core for all of it loses more than those bursts cost
        self.loads_busy = True
        self._bind_s = 0.0  # binding done so far (kept apart from scheduling time)

    # ---- replies from the loader and the predictor, and supervisor notices --------------
    def handle(self, msg: Message) -> None:
        if isinstance(msg, Loaded):
            self._on_loaded(msg)
        elif isinstance(msg, LoadFailed):
            slot = self.table.fail(msg.slot, msg.generation, msg.draft, msg.reason)
            if slot is not None:
                self._event("failed", msg.draft, msg.slot)
                if msg.reason != "cancelled":
                    self.log(f"draft '{msg.draft}' quarantined: {msg.reason}")
            self._changed()
        elif isinstance(msg, Ranking):
            run = self.running
            if run is not None and msg.req_id == run.job.req_id and msg.seq >= run.rank_seq:
                if run.rank_seq < 0:
                    run.ranking_s = msg.latency_s
                else:  # the prompt's ranking overlaps the prefill; later ones the decode
                    run.encode_s += msg.latency_s
                run.last_encode_s = msg.latency_s
                run.rank_seq = msg.seq
                self.scores = dict(zip(msg.drafts, msg.scores))
            if run is not None and msg.req_id == run.job.req_id and msg.seq in run.sent:
                run.rankings.append(RankEvent(run.sent.pop(msg.seq) - run.job.t_start, msg.seq,
                                              msg.latency_s))
        elif isinstance(msg, PeerRestarted) and msg.proc == "loader":
            self._reissue_loads()
        elif isinstance(msg, Error):
            self.log(f"peer reported: {msg.message}")

    def drain(self, timeout_s: float = 0.0) -> None:
        for msg in self.channels.poll(timeout_s):
            self.handle(msg)

    def _on_loaded(self, msg: Loaded) -> None:
        slot = self.table.complete(msg.slot, msg.generation, msg.draft)
        if slot is None:
            self.log(f"ignored stale completion slot={msg.slot} gen={msg.generation} "
                     f"({msg.draft})")
            return
        t0 = self.clock.now()
        ex = self.running.job.executor if self.running is not None else None
        try:
            self.slots.bind(slot.index, slot.generation, msg.draft)
        except MemspecError as exc:
            self.table.failed[msg.draft] = str(exc)
            self.table.release(slot)
            self.log(f"draft '{msg.draft}' quarantined: {exc}")
            self._changed()
            return
        bind_s = self.clock.now() - t0
        self._event("loaded", msg.draft, slot.index, msg.seconds, bind_s)
        if msg.seconds > 0:
            self.load_seconds[msg.draft] = msg.seconds
        if ex is not None:
            ex.stats.loads += 1
            ex.stats.bytes_loaded += msg.nbytes
            ex.stats.t_bind += bind_s
        self._bind_s += bind_s
        self._changed()

    def _reissue_loads(self) -> None:
        """A restarted loader forgot its queue: every load in flight is issued again."""
        for slot in self.table.slots:
            if slot.state == SlotState.LOADING and slot.draft:
                draft = slot.draft
                self.table.release(slot)
                new = self.table.begin_load(draft)
                if new is not None:
                    self._send_load(new)
        self.log("loader restarted: pending loads re-issued")

    def _changed(self) -> None:
        if self.on_slots_changed:
            self.on_slots_changed()

    def _event(self, kind: str, draft: str, slot: int, seconds: float = 0.0,
               bind_s: float = 0.0, at: float | None = None) -> None:
        run = self.running
        if run is not None and run.events is not None:
            t = self.clock.now() if at is None else at
            run.events.append(LoadEvent(t - run.job.t_start, kind, draft, slot, seconds, bind_s))

    # ---- residency actions ---------------------------------------------------------------
    def _send_load(self, slot: Slot) -> None:
        draft = slot.draft or ""
        self._event("load", draft, slot.index)
        self.channels.send(self.slots.load_request(slot.index, slot.generation, draft))

    def evict(self, draft: str) -> None:
        slot = self.table.where(draft)
        if slot is None:
            return
        if slot.state == SlotState.LOADING:
            self.channels.send(Cancel(slot=slot.index, generation=slot.generation))
        else:
            self.slots.unbind(draft)
            ex = self.running.job.executor if self.running is not None else None
            if ex is not None:
                ex.stats.evictions += 1
        self.table.release(slot)
        self._changed()

    def prefetch(self, draft: str) -> None:
        if draft in self.table.failed or self.table.where(draft) is not None:
            return
        slot = self.table.begin_load(draft)
        if slot is not None:
            self._send_load(slot)
            self._changed()

    def apply(self, decision: Decision) -> None:
        for d in decision.actions.cancel:
            self.evict(d)
        for d in decision.actions.evict:
            self.evict(d)
        for d in decision.actions.prefetch:
            self.prefetch(d)

    def view(self, iteration: int, active: str | None) -> SchedView:
        return SchedView(
            iteration=iteration, drafts=self.drafts, general=self.general,
            capacity=len(self.table.slots), resident=self.table.resident,
            loading=self.table.loading, failed=frozenset(self.table.failed), active=active,
            scores=self.scores)

    # ---- one request (Alg. 3) ------------------------------------------------------------
    def start(self, job: Job) -> None:
        """Open a request as Alg. 3 does: rank the prompt, issue the first decision's loads
        (the initial draft, and for memspec the rest of the predicted working set) and
        prefill while they load. A policy that needs the ranking gets it during the prefill
        (chunks, `_between_chunks`); whatever of its round trip outlasts the prefill is a
        bounded wait, booked as prediction time."""
        if self.running is not None:
            raise RuntimeError(f"request {self.running.job.req_id} is still running")
        if job.executor is None and job.prefill is None:
            raise ValueError("a job needs an executor or a prefill")
        if self.cold_start:
            for d in sorted(self.table.resident | self.table.loading):
                self.evict(d)
        self.scores = None
        run = self.running = _Running(job, [] if job.trace else None)
        # the prompt is ranked first unless the policy wants no ranking yet (a gate that
        # probes a resident draft before any load) and a draft is there to be probed, or a
        # closed gate would look at no draft anyway, or the request is too short to pay a
        # ranking back (`ranking_horizon`): then the first decision loads the policy's
        # initial draft at once, beside the prefill (waiting for the ranking put that load
        # after the prefill, and a 128-token request then also loaded the ranked domain
        # draft and rarely ran it: ~8% slower than the general draft alone on dev)
        looks = getattr(job.policy, "may_look", None)
        ranks = getattr(job.policy, "ranks_prompt", None)
        horizon = getattr(job.policy, "ranking_horizon", 0)
        short = bool(horizon and job.max_new_tokens and job.max_new_tokens < horizon)
        if job.policy.uses_predictor and (job.policy.wants_ranking() or (
                ranks is not None and ranks(job.max_new_tokens, self.drafts)) or (
                not short and not self.table.resident
                and (looks is None or looks(self.drafts)))):
            self._snapshot()
            if job.executor is not None or not job.chunks:  # nothing to overlap it with
                run.t_initial = self._wait_initial_ranking()
                self._open()
        else:
            self._open()
        loading = tuple(sorted(self.table.loading - self.table.resident))
        if job.executor is None:
            assert job.prefill is not None
            self._tell_helpers()
            # a refusal raises; the service's abort clears it
            job.executor = job.prefill(None if run.opened else self._between_chunks)
        if not run.opened:
            run.t_initial = self._wait_initial_ranking()
            self._open()
        stats = job.executor.stats
        stats.prefill_loads = loading
        stats.t_prediction += run.t_initial
        run.t_loop = self.clock.now() - job.t_start
        stats.t_pre += run.t_loop - stats.t_prefill - run.t_initial - stats.t_bind

    def _open(self) -> None:
        """The request's first decision: its loads go out now."""
        run = self.running
        assert run is not None
        self.drain()
        self.apply(run.job.policy.decide(self.view(0, None)))
        run.opened = True

    def _between_chunks(self) -> bool:
        """Called by the prefill between chunks: True while the first ranking is awaited
        (at most CHUNKED_WAIT_S: a predictor that is down must not cost a long prompt one
        extra weight pass per chunk)."""
        run = self.running
        if run is None or run.opened:
            return False
        self.drain()
        self._tell_helpers()
        if run.rank_seq < 0:
            return self.clock.now() - run.job.t_start < CHUNKED_WAIT_S
        self._open()
        return False

    def helpers_busy(self, loads: bool | None = None) -> bool:
        """The predictor is encoding this request's newest snapshot, or a load is in flight
        (the loader reads, checks and copies on the same cores); `loads=True` counts any
        load in flight, paced or not."""
        if (self.loads_busy if loads is None else loads) \
                and self.table.loading - self.table.resident:
            return True
        run = self.running
        return run is not None and run.rank_seq < run.seq and run.t_sent >= 0 \
            and self.clock.now() - run.t_sent < SNAPSHOT_STALE_S

    def _tell_helpers(self) -> None:
        self._shared = self.helpers_busy(loads=True)
        if self.on_helpers is not None:
            self.on_helpers(self.helpers_busy())

    def _ranking_in_budget(self, ex: Executor) -> bool:
        """Another snapshot keeps the predictor's encoding within PREDICTOR_SHARE of the
        request's decode time (its next ranking, and any still in flight, priced as its
        last)."""
        run = self.running
        assert run is not None
        horizon = getattr(run.job.policy, "ranking_horizon", 0)
        if horizon and run.job.max_new_tokens:  # too few tokens left to pay a switch back
            left = run.job.max_new_tokens - sum(r.emitted for r in ex.stats.records)
            if left < horizon:
                return False
        decode = sum(r.duration for r in ex.stats.records)
        # snapshots still unanswered will cost the predictor too (unless it drops them as
        # stale): counting only answered ones let a request overrun the share by a ranking
        pending = run.seq - max(run.rank_seq, 0)
        return run.encode_s + (pending + 1) * run.last_encode_s <= PREDICTOR_SHARE * decode

    def step(self) -> Summary | None:
        """One scheduling interval; the request's summary once it is done, else None."""
        run = self.running
        if run is None:
            raise RuntimeError("no request is running")
        job, ex = run.job, run.job.executor
        assert ex is not None  # opened by start()
        t_begin, bind_before, waited = self.clock.now(), self._bind_s, 0.0
        n_before, pred_before = len(ex.stats.records), ex.stats.t_prediction
        if ex.done:
            return self._finish()
        self.clock.overhead("sched")
        self.drain()
        decision = job.policy.decide(self.view(run.iteration, run.active))
        self.apply(decision)
        ex.stats.points += 1
        draft = decision.run
        if decision.wait_for is not None:
            t_wait = self.clock.now()
            waited = self._wait_resident(decision.wait_for)
            ex.stats.t_load_wait += waited
            self._event("wait", decision.wait_for, -1, waited, at=t_wait)
            if decision.wait_for in self.table.resident:
                draft = decision.wait_for
        if draft is not None and draft != LOOKUP and draft not in self.table.resident:
            draft = None  # a policy may only run resident drafts; guard, never block
        desired = draft == decision.preferred
        self._tell_helpers()
        for i in range(decision.limit or self.N):
            if i:
                self.clock.overhead("inner")
            rec = ex.step(draft, desired)
            rec.shared = self._shared
            rec.threads = getattr(self.on_helpers, "current", 0)
            job.policy.observe_iteration(rec)
            run.iteration += 1
            if ex.done:
                break
            if draft is not None and not job.policy.keeps(draft):
                draft, desired = None, True  # the target alone by choice, not a fallback
        run.active = None if draft == LOOKUP else draft  # (the lookup is no resident draft)
        if not ex.done:
            self.channels.heartbeat("busy")
            if job.policy.uses_predictor and job.policy.wants_ranking() \
                    and self._ranking_in_budget(ex):
                run.seq += 1
                t0 = self.clock.now()
                self._snapshot()
                ex.stats.t_prediction += self.clock.now() - t0
        # the interval's wall time that is neither an iteration, a wait, a bind nor the
        # snapshot: the scheduling point and the loop around the iterations
        iters = sum(r.duration for r in ex.stats.records[n_before:])
        ex.stats.t_sched += (self.clock.now() - t_begin) - iters - waited \
            - (self._bind_s - bind_before) - (ex.stats.t_prediction - pred_before)
        return self._finish() if ex.done else None

    def abort(self, req_id: str) -> bool:
        """Drop the running request `req_id` (loads in flight go on: they are slot state)."""
        if self.running is None or self.running.job.req_id != req_id:
            return False
        self.running = None
        return True

    def _snapshot(self) -> None:
        run = self.running
        assert run is not None
        ex = run.job.executor
        recent = ex.recent(self.T) if self.T and run.seq and ex is not None else []
        run.snapshots += 1
        run.t_sent = self.clock.now()
        if run.events is not None:
            run.sent[run.seq] = run.t_sent
        self.channels.send(Snapshot(req_id=run.job.req_id, seq=run.seq, prompt=run.job.prompt,
                                    recent_ids=recent))

    def _wait_initial_ranking(self) -> float:
        """The paper's Alg. 3 ranks the prompt before decoding; bounded, so a predictor
        that is down costs a request at most INITIAL_RANKING_TIMEOUT_S."""
        run = self.running
        assert run is not None
        t0 = self.clock.now()
        while run.rank_seq < 0:
            left = INITIAL_RANKING_TIMEOUT_S - (self.clock.now() - t0)
            if left <= 0:
                self.log("no initial ranking (predictor down?): continuing without one")
                break
            self.drain(min(left, RANKING_POLL_S))
        return self.clock.now() - t0

    def _wait_resident(self, draft: str) -> float:
        """Block until `draft` is resident or has failed (blocking policies only)."""
        t0 = self.clock.now()
        while draft not in self.table.resident and draft not in self.table.failed:
            if draft not in self.table.loading:
                self.prefetch(draft)
                if draft not in self.table.loading:
                    break  # no free slot and nothing to evict: give up waiting
            self.channels.heartbeat("busy")
            self.drain(RESIDENCY_POLL_S)
        return self.clock.now() - t0

    def _finish(self) -> Summary:
        run = self.running
        assert run is not None
        assert run.job.executor is not None
        job, stats = run.job, run.job.executor.stats
        t0 = self.clock.now()
        self.clock.overhead("post")
        stats.t_sched += self.clock.now() - t0
        stats.t_e2e = self.clock.now() - job.t_start
        summary = stats.report()
        summary.policy = job.policy.name
        summary.snapshots, summary.predictor_s = run.snapshots, run.encode_s
        summary.quarantined = dict(self.table.failed)
        summary.resident_at_end = sorted(self.table.resident)
        if run.events is not None:
            summary.trace = Trace(
                iterations=[msgspec.structs.replace(r, t_start=r.t_start - job.t_start)
                            for r in stats.records],
                loads=run.events, loop_start=run.t_loop, initial_prediction=run.t_initial,
                uses_predictor=job.policy.uses_predictor, ranking_s=run.ranking_s,
                rankings=run.rankings, snapshots=run.snapshots)
        self.running = None
        return summary
