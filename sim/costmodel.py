"""What each runtime action costs, measured on the real multi-process runtime.

Fitted from traced requests (`Submit(trace=True)`, `Summary.trace`): every iteration
record, every load the loader timed, the predictor's answer latency and the decoder's gaps
between intervals. The simulator charges exactly these, so its error against real runs says
how complete the model is, not how lucky a constant was.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from memspec.common.metrics import LoadEvent, RankEvent, Summary
from memspec.procs.decoder.oracle.loadplan import linear_fit
from memspec.procs.decoder.sched.costs import PlanCosts
from memspec.procs.decoder.sched.gate import GateCosts
from memspec.sim.loadqueue import LoadQueue


@dataclass
class CostModel:
    spec_s: dict[str, float]  # one SD iteration of each draft at an empty context
    target_s: float  # one target-only step at an empty context
    catchup_base_s: float  # (re)activating a draft: fixed part of its KV prefill
    catchup_per_token_s: float  # ... and per missing token
    load_s: dict[str, float]  # one draft load under the storage profile (loader-timed)
    predict_s: float  # the predictor's time per ranking (it answers `predict_s` after it
    # starts on a snapshot; messaging is well under a millisecond)
    snapshot_s: float  # building and sending one snapshot (on the critical path)
    sched_s: float  # decoder work between intervals (drain, bind, decide, heartbeat)
    inner_s: float = 0.0  # between two iterations of one interval (observe, loop)
    prefill_base_s: float = 0.0  # target prefill of the prompt, fixed part
    prefill_per_token_s: float = 0.0
    per_context_token_s: float = 0.0  # both grow with the context (attention, streaming)
    mean_iteration_s: float = 0.0  # mean SD iteration seen (load/iteration reference)
    mean_target_s: float = 0.0  # mean target-only step seen (context included)
    load_slowdown: float = 0.0  # iterations run this much slower while the loader reads,
    # checksums and copies a draft on the same cores
    bind_s: float = 0.0  # decoder binding a landed draft (at the next drain)
    predictor_slowdown: float = 0.0  # iterations are this much slower while the predictor
    # process encodes snapshots on the same cores (CPU); ~0 with a GPU decoder
    pre_s: float = 0.0  # request start -> decode loop, besides prefill and first ranking
    post_s: float = 0.0  # last iteration -> reply
    source: dict[str, Any] = field(default_factory=dict)


    def spec_cost(self, draft: str, context: int) -> float:
        return self.spec_s[draft] + self.per_context_token_s * context

    def target_cost(self, context: int) -> float:
        return self.target_s + self.per_context_token_s * context

    def catchup_s(self, tokens: int) -> float:
        return self.catchup_base_s + self.catchup_per_token_s * max(0, tokens)

    def prefill_s(self, prompt_len: int) -> float:
        return self.prefill_base_s + self.prefill_per_token_s * prompt_len

    def with_load_ratio(self, ratio: float, reference: str) -> CostModel:
        """The same runtime with storage `ratio` x one `reference` iteration per draft load
        (the sweeps' knob); drafts keep their size ratios to the reference."""
        base = self.load_s[reference]
        it = self.mean_iteration_s or self.spec_s[reference]
        scale = ratio * it / base if base > 0 else 0.0
        return CostModel(**{**asdict(self), "load_s": {d: s * scale
                                                       for d, s in self.load_s.items()}})

    def load_over_iteration(self, draft: str) -> float:
        """A load of `draft` in SD iterations (the edge-emulated profile's ratio)."""
        return self.load_s[draft] / (self.mean_iteration_s or self.spec_s[draft])

    def plan_costs(self) -> PlanCosts:
        """oracle-dynamic's beliefs in SD iterations, as the decoder learns them from its
        own finished requests (procs/decoder/oracle/oracle.py:PlanCostMeter): everything this model
        charges a decision for (iterations as the lines the simulator charges, each draft's
        own intercept and one slope; catch-ups, binds, scheduling, the loads' head start
        during the prefill), so the plan matches the simulator's clock but for a switch back
        to a draft that ran earlier (charged as a fresh one's catch-up) and the loader's
        slowdown (spread over an interval, not charged per iteration). The unit is the mean
        iteration."""
        unit = self.mean_iteration_s or sum(self.spec_s.values()) / max(1, len(self.spec_s))
        return PlanCosts(load={d: s / unit for d, s in self.load_s.items()},
                         spec={d: s / unit for d, s in self.spec_s.items()},
                         target=self.target_s / unit, per_token=self.per_context_token_s / unit,
                         switch=self.catchup_base_s / unit,
                         switch_per_token=self.catchup_per_token_s / unit,
                         bind=self.bind_s / unit, overhead=self.sched_s / unit,
                         inner=self.inner_s / unit,
                         load_slowdown=self.load_slowdown,
                         prefill=(self.pre_s + self.prefill_base_s) / unit,
                         prefill_per_token=self.prefill_per_token_s / unit, timed=True)

    def gate_costs(self) -> GateCosts:
        """The speculation gate's lines, as the decoder's start-up calibration gives them."""
        slope = self.per_context_token_s
        return GateCosts(target=(self.target_s, slope),
                         spec={d: (s, slope) for d, s in self.spec_s.items()})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> CostModel:
        return cls(**dict(raw))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2))

    @classmethod
    def load(cls, path: Path) -> CostModel:
        return cls.from_json(json.loads(path.read_text()))


def _mean(xs: Sequence[float], default: float = 0.0) -> float:
    return statistics.fmean(xs) if xs else default


def _median(xs: Sequence[float], default: float = 0.0) -> float:
    return statistics.median(xs) if xs else default


def _waits_between(waits: Sequence[tuple[float, float]], a: float, b: float) -> float:
    return sum(sec for t, sec in waits if a <= t < b)


def load_windows(events: Sequence[LoadEvent]) -> list[tuple[float, float]]:
    """When the loader was busy: the traced loads replayed through the simulator's loader,
    each for the seconds it reported (cancelled loads are left out: they stop within a
    chunk)."""
    landed: dict[tuple[str, int], list[float]] = {}
    for ev in events:
        if ev.kind == "loaded":
            landed.setdefault((ev.draft, ev.slot), []).append(ev.seconds)
    queue = LoadQueue()
    for i, ev in enumerate(e for e in events if e.kind == "load"):
        secs = landed.get((ev.draft, ev.slot))
        if secs:
            queue.issue(i, ev.t, secs.pop(0))
    return queue.windows()


def predictor_windows(events: Sequence[RankEvent]) -> list[tuple[float, float]]:
    """When the predictor was encoding: each answered snapshot from when it was sent (or
    the previous one finished) for the seconds the predictor reported."""
    out: list[tuple[float, float]] = []
    end = float("-inf")
    for ev in sorted(events, key=lambda e: e.t):
        start = max(ev.t, end)
        end = start + ev.seconds
        out.append((start, end))
    return out


def busy_at(windows: Sequence[tuple[float, float]], t: float) -> bool:
    return any(s <= t < e for s, e in windows)


def _busy(windows: Sequence[tuple[float, float]], a: float, b: float) -> bool:
    return any(s < b and a < e for s, e in windows)


def fit(runs: Iterable[Summary], N: int, catchup: Sequence[tuple[int, float]],
        predict_s: float, drafts: Sequence[str], arch: Mapping[str, str] | None = None
        ) -> CostModel:
    """Fit from traced request summaries (`Summary.trace`) plus two direct measurements:
    `catchup` = (tokens, seconds) prefill timings of a draft, `predict_s` = the predictor's
    measured time per ranking. Drafts of one architecture (`arch`: draft -> key; default: all
    alike) share one iteration cost: which policy happened to run a draft, and where in a
    request, would otherwise leak into its cost."""
    spec: list[tuple[str, float, float]] = []  # (draft, context tokens, seconds), loader idle
    with_pred: list[tuple[str, float, float]] = []  # the same in predictor-driven runs
    during_load: list[tuple[str, float, float]] = []  # no predictor, loader busy
    target: list[tuple[float, float]] = []
    loads: dict[str, list[float]] = {d: [] for d in drafts}
    sched: list[float] = []
    inner: list[float] = []
    snaps: list[float] = []
    bind_all: list[float] = []
    traced_catch: list[tuple[float, float]] = []  # (missing tokens, seconds) from the runtime
    pre: list[float] = []
    post: list[float] = []
    prefill_x: list[float] = []
    prefill_y: list[float] = []
    n_runs = 0
    for st in runs:
        tr, t = st.trace, st.time
        if tr is None:
            raise ValueError("fit needs traced requests (Submit(trace=True))")
        n_runs += 1
        its = tr.iterations
        waits = [(ev.t, ev.seconds) for ev in tr.loads if ev.kind == "wait"]
        binds = [(ev.t, ev.bind_s) for ev in tr.loads if ev.kind == "loaded"]
        bind_all += [b for _, b in binds]
        for ev in tr.loads:
            if ev.kind == "loaded" and ev.draft in loads:
                loads[ev.draft].append(ev.seconds)
        uses_predictor = tr.uses_predictor or tr.initial_prediction > 0
        busy = load_windows(tr.loads)
        # iterations that began while the predictor encoded pay its slowdown; traces from
        # before rankings were recorded (no `uses_predictor`) count every iteration of a
        # predictor run
        encoding = predictor_windows(tr.rankings)
        timed_rankings = tr.uses_predictor
        ctx = float(st.prompt_tokens)
        for it in its:
            d, dur, catch = it.draft, it.duration, it.t_catchup
            if catch > 0 and it.catchup_tokens > 0:
                traced_catch.append((float(it.catchup_tokens), catch))
            loading = _busy(busy, it.t_start, it.t_start + dur)
            if d is None:
                if not uses_predictor and not loading:
                    target.append((ctx, dur))
            elif d in loads:
                sample = (d, ctx, dur - catch)
                predicting = uses_predictor and (busy_at(encoding, it.t_start)
                                                 or not timed_rankings)
                if loading:
                    if not uses_predictor:
                        during_load.append(sample)
                else:
                    (with_pred if predicting else spec).append(sample)
            ctx += it.emitted
        if not its:
            continue
        prev_end = tr.loop_start
        for i, it in enumerate(its):
            gap = it.t_start - prev_end - _waits_between(waits, prev_end, it.t_start) \
                - _waits_between(binds, prev_end, it.t_start)
            (sched if i % N == 0 else inner).append(gap)
            prev_end = it.t_start + it.duration
        pre.append(tr.loop_start - t.prefill - tr.initial_prediction)
        post.append(t.e2e - prev_end)
        prefill_x.append(float(st.prompt_tokens))
        prefill_y.append(t.prefill)
        n_snap = tr.snapshots - 1 if tr.snapshots else (len(its) - 1) // N  # after the first
        if uses_predictor and n_snap:
            snaps.append(max(0.0, t.prediction - tr.initial_prediction) / n_snap)
    # one line over context for every draft's iterations (same verify, same streaming), then
    # each draft's mean offset from it
    a_it, per_tok = linear_fit([c for _, c, _ in spec], [x for *_, x in spec])
    group = {d: (arch or {}).get(d, "") for d in drafts}
    spec_s = {}
    for d in drafts:
        res = [x - per_tok * c for dd, c, x in spec if group.get(dd) == group[d]]
        spec_s[d] = _mean(res, a_it)
    target_s = _mean([x - per_tok * c for c, x in target], 0.5 * a_it)
    # >= 0: a predictor process never speeds the decoder up (negative values are noise)
    ratios = [x / (spec_s[d] + per_tok * c) for d, c, x in with_pred]
    slowdown = max(0.0, _mean(ratios) - 1) if ratios and spec else 0.0
    during = [x / (spec_s[d] + per_tok * c) for d, c, x in during_load]
    load_slowdown = max(0.0, _mean(during) - 1) if during and spec else 0.0
    seen = [x for *_, x in spec]
    seen_loads = [x for xs in loads.values() for x in xs]
    # catch-up as the runtime paid it when there are enough traced switches, else the
    # in-process prefill timings
    points = traced_catch if len(traced_catch) >= 5 else [(float(n), t) for n, t in catchup]
    a, b = linear_fit([n for n, _ in points], [t for _, t in points])
    pa, pb = linear_fit(prefill_x, prefill_y)
    return CostModel(
        spec_s=spec_s, target_s=target_s, per_context_token_s=per_tok,
        mean_iteration_s=_mean(seen), mean_target_s=_mean([x for _, x in target]),
        catchup_base_s=a, catchup_per_token_s=b,
        load_s={d: _median(xs, _median(seen_loads)) for d, xs in loads.items()},
        predict_s=predict_s, snapshot_s=_median(snaps), sched_s=_mean(sched),
        inner_s=_mean(inner), prefill_base_s=pa, prefill_per_token_s=pb,
        pre_s=_mean(pre), post_s=_mean(post), predictor_slowdown=slowdown,
        bind_s=_mean(bind_all), load_slowdown=load_slowdown,
        source={"runs": n_runs,
                "iterations": len(seen) + len(target) + len(with_pred) + len(during_load),
                "iterations_during_loads": len(during_load),
                "loads": len(seen_loads), "catchup_points": len(points),
                "catchup_from": "traced switches" if points is traced_catch else "prefill timing"})
