"""Replay one request through a policy: the controller's loop (Alg. 3) on a simulated clock.

Same `Policy` objects and cache manager as procs/decoder/controller.py, same ordering of
events: a scheduling point drains finished loads and the newest ranking, asks the policy,
issues evictions/cancels/loads, runs N iterations of the chosen resident draft (catch-up on
(re)activation), then sends a snapshot. Acceptance comes from the tables (exact for greedy
decoding); time comes from a CostModel measured on the real runtime. The loader serves
loads one at a time in issue order; the predictor answers the newest snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from memspec.common.metrics import IterationRecord, RunStats
from memspec.procs.decoder.oracle import make_plan
from memspec.procs.decoder.policies import Decision, Policy, SchedView, make_policy
from memspec.sim.costmodel import CostModel
from memspec.zoo.tables import Table, step_accepted

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


@dataclass
class _Load:
    draft: str
    issued: float
    start: float = 0.0
    done: float = 0.0


@dataclass
class _Loader:
    """FIFO, one load at a time; a cancel frees the loader at once."""

    cost: CostModel
    queue: list[_Load] = field(default_factory=list)
    free_at: float = 0.0

    def issue(self, draft: str, t: float) -> None:
        self.queue.append(_Load(draft, t))
        self._plan(t)

    def _plan(self, now: float) -> None:
        free = self.free_at
        for ld in self.queue:
            if ld.done and ld.start <= now:  # already running: keeps its times
                free = ld.done
                continue
            ld.start = max(free, ld.issued)
            ld.done = ld.start + self.cost.load_s[ld.draft]
            free = ld.done

    def cancel(self, draft: str, t: float) -> None:
        for ld in self.queue:
            if ld.draft == draft:
                if ld.start <= t < ld.done:
                    self.free_at = t
                self.queue.remove(ld)
                break
        self._plan(t)  # landed loads were drained just before this decision

    def queue_done_before(self, t: float) -> list[str]:
        done = [ld for ld in self.queue if ld.done <= t]
        for ld in done:
            self.queue.remove(ld)
            self.free_at = max(self.free_at, ld.done)
        return [ld.draft for ld in done]

    def busy(self, t: float) -> bool:
        return any(ld.start <= t < ld.done for ld in self.queue)

    def done_time(self, draft: str) -> float | None:
        return next((ld.done for ld in self.queue if ld.draft == draft), None)

    @property
    def loading(self) -> frozenset[str]:
        return frozenset(ld.draft for ld in self.queue)


def simulate(policy_name: str, req: SimRequest, cost: CostModel, cfg: SimConfig,
             ucb_c: float = 2.0, resident: Sequence[str] = ()) -> RunStats:
    """One request from `resident` (cold start: empty); returns the runtime's RunStats."""
    where = {"pos": 0}
    policy = build_policy(policy_name, req, cfg, lambda: where["pos"], ucb_c)
    length = req.length if cfg.max_new_tokens is None else min(req.length, cfg.max_new_tokens)
    policy.reset()
    stats = RunStats(prompt_tokens=req.prompt_len)
    stats.t_prefill = cost.prefill_s(req.prompt_len)
    t = cost.pre_s + stats.t_prefill
    res: set[str] = set(resident)
    loader = _Loader(cost, free_at=t)
    kv: dict[str, int] = {}  # draft -> tokens its KV cache covers (0 after a (re)load)
    pos, last_draft = 0, None
    rankings: list[tuple[float, int]] = []  # (available at, snapshot position)
    pred_free = t

    def snapshot(at: float, p: int) -> None:
        """The predictor answers the newest snapshot: one that waits is replaced."""
        nonlocal pred_free
        if rankings and at < rankings[-1][0] - cost.predict_s:  # last one not started yet
            start = rankings.pop()[0] - cost.predict_s
        else:
            start = max(at, pred_free)
        pred_free = start + cost.predict_s
        rankings.append((pred_free, p))

    def drain(now: float) -> float:
        """Landed loads become runnable; binding each costs the decoder bind_s."""
        spent = 0.0
        for d in loader.queue_done_before(now):
            res.add(d)
            kv[d] = 0
            stats.loads += 1
            spent += cost.bind_s
        return spent

    speed = 1.0 + (cost.predictor_slowdown if policy.uses_predictor else 0.0)
    if policy.uses_predictor and req.scores is not None:
        snapshot(t, 0)
        stats.t_prediction += cost.predict_s
        t += cost.predict_s
    active: str | None = None
    iteration = 0
    while pos < length:
        t += cost.sched_s
        t += drain(t)
        ready = [p for at, p in rankings if at <= t]
        scores = req.scores(ready[-1]) if ready and req.scores is not None else None
        view = SchedView(iteration=iteration, drafts=cfg.drafts, general=cfg.general,
                         capacity=cfg.K, resident=frozenset(res), loading=loader.loading,
                         failed=frozenset(), active=active,
                         scores=dict(scores) if scores is not None else None)
        decision: Decision = policy.decide(view)
        for d in (*decision.actions.cancel, *decision.actions.evict):
            if d in res:
                res.discard(d)
                kv.pop(d, None)
                stats.evictions += 1
            else:
                loader.cancel(d, t)
        for d in decision.actions.prefetch:
            if d not in res and d not in loader.loading and len(res) + len(loader.loading) < cfg.K:
                loader.issue(d, t)
        run = decision.run
        if decision.wait_for is not None:
            done = loader.done_time(decision.wait_for)
            if done is not None and decision.wait_for not in res:
                t_wait = max(t, done)
                t_wait += drain(t_wait)  # the bind happens inside the wait
                stats.t_load_wait += t_wait - t
                t = t_wait
            if decision.wait_for in res:
                run = decision.wait_for
        if run is not None and run not in res:
            run = None
        desired = run == decision.preferred
        for i in range(cfg.N):
            if i:
                t += cost.inner_s
            slow = speed + (cost.load_slowdown if loader.busy(t) else 0.0)
            rec = _iterate(run, pos, length, req, cost, cfg, kv, last_draft, t, desired, slow)
            if run is not None and last_draft is not None and run != last_draft:
                stats.switches += 1
            if run is not None:
                last_draft = run
            stats.records.append(rec)
            policy.observe(run, rec.proposed, rec.accepted)
            pos += rec.emitted
            where["pos"] = pos
            t += rec.duration
            iteration += 1
            if pos >= length:
                break
        active = run
        if pos >= length:
            break
        if policy.uses_predictor and req.scores is not None:
            t += cost.snapshot_s
            stats.t_prediction += cost.snapshot_s
            snapshot(t, pos)
    stats.t_e2e = t + cost.post_s
    return stats


def _iterate(run: str | None, pos: int, length: int, req: SimRequest, cost: CostModel,
             cfg: SimConfig, kv: dict[str, int], last_draft: str | None, t: float,
             desired: bool, speed: float = 1.0) -> IterationRecord:
    context = req.prompt_len + pos
    if run is None:
        return IterationRecord(None, 0, 0, 1, t, t_verify=cost.target_cost(context) * speed,
                               desired=desired)
    a = step_accepted(req.tables[run], pos, cfg.gamma)
    emitted = min(a + 1, length - pos)
    missing = context - kv.get(run, 0)
    catch = draft_extra = 0.0
    if run != last_draft:  # the engine books a (re)activation's prefill as catch-up
        catch = cost.catchup_s(missing)
    elif missing > 2:  # same draft after target-only steps: a longer prefill, booked as draft
        draft_extra = cost.catchup_s(missing)
    kv[run] = min(context + min(a, cfg.gamma - 1), context + emitted - 1)
    return IterationRecord(run, cfg.gamma, a, emitted, t,
                           t_draft=cost.spec_cost(run, context) * speed + draft_extra,
                           t_catchup=catch,
                           desired=desired)


def build_policy(name: str, req: SimRequest, cfg: SimConfig, position: Callable[[], int],
                 ucb_c: float = 2.0) -> Policy:
    """The runtime's policy object, with an oracle plan over this request's tables."""
    plan = make_plan(name, req.tables, cfg.gamma, cfg.N, position)
    return make_policy(name, ucb_c=ucb_c, oracle_plan=plan)
