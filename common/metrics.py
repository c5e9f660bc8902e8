"""Per-iteration records and the run metrics (vLLM's names where they exist).

Pure bookkeeping: the engine, the multi-process runtime and the replay simulator all
produce :class:`IterationRecord` lists and summarise them the same way. The summary is a
typed struct (:class:`Summary`), so it travels in ``Done.stats`` validated like any other
message field, and a trace of a request is typed records, never positional lists.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from math import exp, log
from typing import Any

import msgspec

# one emitted token's log-probability under the target and its most likely alternatives:
# (token, logprob, [(token, logprob), ...]), as the engine records it
LogprobRow = tuple[int, float, list[tuple[int, float]]]


class IterationRecord(msgspec.Struct, forbid_unknown_fields=True):
    """One decode iteration: a draft proposes, the target verifies (or a target-only step)."""

    draft: str | None  # None: target-only step
    proposed: int
    accepted: int
    emitted: int  # tokens committed by this iteration
    t_start: float
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_catchup: float = 0.0
    desired: bool = True  # False: fallback execution (preferred draft not resident)
    catchup_tokens: int = 0  # tokens the draft's KV cache had to prefill on (re)activation
    context: int = 0  # tokens before the iteration (prompt + generated): what it attends to
    shared: bool = False  # a helper (a load, the predictor) held a core: the decoder ran on
    # fewer threads, so the iteration does not tell what one costs on a quiet machine
    store_led: bool = False  # a datastore's token came first: the context lookup alone
    # would have run a target step here
    match: int = 0  # the context lookup's suffix match under its first proposal (0: none)
    threads: int = 0  # the decoder's forward threads in this iteration (0: not recorded;
    # procs/decoder/forward/threads.py: fewer while a helper or another program holds a core)

    @property
    def duration(self) -> float:
        return self.t_draft + self.t_verify + self.t_catchup


class LoadEvent(msgspec.Struct, forbid_unknown_fields=True):
    """A residency event of a traced request, `t` seconds after the request started.

    kind: "load" (issued), "loaded" (`seconds` the loader took, `bind_s` the decoder took
    to bind it), "failed", or "wait" (a blocking policy waited `seconds` for `draft`).
    """

    t: float
    kind: str
    draft: str
    slot: int = -1
    seconds: float = 0.0
    bind_s: float = 0.0


class RankEvent(msgspec.Struct, forbid_unknown_fields=True):
    """A snapshot the predictor answered: sent `t` seconds after the request started, and
    the predictor's own `seconds` for it (when it competed with the decoder for the CPU)."""

    t: float
    seq: int
    seconds: float


class Trace(msgspec.Struct, forbid_unknown_fields=True):
    """What a traced request did and when (iteration `t_start`s are relative to its start)."""

    iterations: list[IterationRecord]
    loads: list[LoadEvent]
    loop_start: float  # request start -> first scheduling decision
    initial_prediction: float  # of which waiting for the first ranking (after the prefill)
    uses_predictor: bool = False
    ranking_s: float = 0.0  # the predictor's own time for the first ranking (0: none came)
    rankings: list[RankEvent] = []
    snapshots: int = 0  # sent (the first included); 0 in traces from before they were counted


class TimeBreakdown(msgspec.Struct, forbid_unknown_fields=True):
    prefill: float
    draft: float
    verify: float
    catchup: float
    desired: float
    fallback: float
    target_fallback: float
    load_wait: float
    prediction: float
    decode: float
    e2e: float
    # the rest of the wall clock, so that pre + prefill + decode + sched + bind + other = e2e
    target_alone: float = 0.0  # target steps by choice (target-only, a closed gate)
    pre: float = 0.0  # request arrival to prefill: checks, tokenising, the first decision
    sched: float = 0.0  # scheduling points: draining replies, deciding, issuing loads,
    # snapshots' bookkeeping, the loop between iterations, the reply
    bind: float = 0.0  # binding landed drafts into the engine
    other: float = 0.0  # what none of the parts measured (should stay ~0)


class Summary(msgspec.Struct, forbid_unknown_fields=True):
    """The metrics of one request under their public names (Done.stats)."""

    generated_tokens: int
    prompt_tokens: int
    iterations: int
    tokens_per_s_steady: float
    tokens_per_s_e2e: float
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    mean_acceptance_length: float
    acceptance_rate: float
    time: TimeBreakdown
    loads: int
    evictions: int
    switches: int
    bytes_loaded: int
    drafts_used: dict[str, int]
    policy: str = ""
    quarantined: dict[str, str] = {}  # draft -> why its load or bind failed
    resident_at_end: list[str] = []
    trace: Trace | None = None
    accepted_counts: list[int] = []  # [k]: draft-and-verify iterations that accepted k tokens
    snapshots: int = 0  # sent to the predictor (the prompt's included)
    predictor_s: float = 0.0  # the predictor's own encoding seconds for this request's
    # rankings after the prompt's (which overlaps the prefill): its share of decode time
    resumed: int = 0  # decoder crashes this request survived (resumed on the restarted one)
    resume_wait_s: float = 0.0  # its stream's pauses for them: crash noticed -> tokens again
    resumed_tokens: int = 0  # tokens decoded before the last crash, carried as context
    grammar_s: float = 0.0  # a constrained request's time in its grammar (masks, checks)
    forced_tokens: int = 0  # tokens the grammar forced, proposed without a draft


OUTCOMES = ("done", "failed", "cancelled", "busy", "invalid")

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards built for it read ours alike
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ACCEPTED_BUCKETS = tuple(float(k) for k in range(9))  # draft tokens a verify accepted


class Histogram(msgspec.Struct, forbid_unknown_fields=True):
    """Observations counted per bucket, as Prometheus keeps them: `counts[i]` holds the
    values in (buckets[i-1], buckets[i]], the last entry those above the largest bound."""

    buckets: list[float]
    counts: list[int] = []
    sum: float = 0.0
    count: int = 0

    @classmethod
    def of(cls, buckets: Sequence[float]) -> Histogram:
        return cls(buckets=list(buckets), counts=[0] * (len(buckets) + 1))

    def observe(self, value: float, n: int = 1) -> None:
        i = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += n
        self.sum += value * n
        self.count += n

    def cumulative(self) -> list[int]:
        """Prometheus's `_bucket` values: observations <= each bound, then +Inf."""
        out, total = [], 0
        for c in self.counts:
            total += c
            out.append(total)
        return out

    def copy(self) -> Histogram:
        return Histogram(list(self.buckets), list(self.counts), self.sum, self.count)


def _hist(buckets: Sequence[float]) -> Any:
    return msgspec.field(default_factory=lambda: Histogram.of(buckets))


class Latencies(msgspec.Struct, forbid_unknown_fields=True):
    """Per-request latency histograms of finished requests, under vLLM's metric names
    (launch/prometheus.py); every one is observed when a request is done, so each `count`
    is the number of requests served (inter-token latency: of their token messages)."""

    time_to_first_token: Histogram = _hist(TTFT_BUCKETS)  # submit -> first tokens
    inter_token_latency: Histogram = _hist(TOKEN_LATENCY_BUCKETS)  # between token messages
    time_per_output_token: Histogram = _hist(TOKEN_LATENCY_BUCKETS)  # per request, after TTFT
    e2e_request_latency: Histogram = _hist(REQUEST_LATENCY_BUCKETS)  # submit -> done
    request_queue_time: Histogram = _hist(REQUEST_LATENCY_BUCKETS)  # submit -> decoder
    request_prefill_time: Histogram = _hist(REQUEST_LATENCY_BUCKETS)  # the decoder's prefill
    # policy -> draft tokens accepted per draft-and-verify iteration
    accepted_per_iteration: dict[str, Histogram] = {}

    def copy(self) -> Latencies:
        return Latencies(**{f: getattr(self, f).copy() for f in self.__struct_fields__
                            if f != "accepted_per_iteration"},
                         accepted_per_iteration={k: h.copy() for k, h
                                                 in self.accepted_per_iteration.items()})


class Totals(msgspec.Struct, forbid_unknown_fields=True):
    """The supervisor's counters over every request it took (stdin, ZeroMQ, HTTP and
    in-process alike), so `/metrics` and `memspec status` report the same numbers. Every
    field but `queued` and `running` (gauges at the time of the snapshot) only grows."""

    requests: dict[str, int] = {}  # outcome (OUTCOMES) -> requests
    prompt_tokens: int = 0
    generation_tokens: int = 0
    iterations: int = 0
    num_drafts: int = 0  # vLLM's speculative-decoding counters
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    loads: int = 0
    evictions: int = 0
    switches: int = 0
    bytes_loaded: int = 0
    fallback_s: float = 0.0  # a non-preferred resident draft ran
    target_fallback_s: float = 0.0  # the target alone ran (nothing preferred resident)
    load_wait_s: float = 0.0
    prediction_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    e2e_s: float = 0.0
    draft_iterations: dict[str, int] = {}  # draft -> iterations it ran
    resumed: int = 0  # requests resumed on a restarted decoder (each crash survived counts)
    queued: int = 0
    running: int = 0
    latencies: Latencies = msgspec.field(default_factory=Latencies)

    def count(self, outcome: str) -> None:
        self.requests[outcome] = self.requests.get(outcome, 0) + 1

    def add(self, s: Summary) -> None:
        """A finished request's summary."""
        self.count("done")
        self.prompt_tokens += s.prompt_tokens
        self.generation_tokens += s.generated_tokens
        self.iterations += s.iterations
        self.num_drafts += s.num_drafts
        self.num_draft_tokens += s.num_draft_tokens
        self.num_accepted_tokens += s.num_accepted_tokens
        self.loads += s.loads
        self.evictions += s.evictions
        self.switches += s.switches
        self.bytes_loaded += s.bytes_loaded
        t = s.time
        self.fallback_s += t.fallback
        self.target_fallback_s += t.target_fallback
        self.load_wait_s += t.load_wait
        self.prediction_s += t.prediction
        self.prefill_s += t.prefill
        self.decode_s += t.decode
        self.e2e_s += t.e2e
        for draft, n in s.drafts_used.items():
            self.draft_iterations[draft] = self.draft_iterations.get(draft, 0) + n

    def served(self, s: Summary, times: RequestTimes, done_at: float) -> None:
        """A finished request: its summary's counters and its latencies (`done_at` on the
        clock of `times`)."""
        self.add(s)
        lat = self.latencies
        first = times.first_tokens if times.first_tokens is not None else done_at
        lat.time_to_first_token.observe(first - times.submitted)
        for gap in times.gaps:
            lat.inter_token_latency.observe(gap)
        if s.generated_tokens > 1:
            lat.time_per_output_token.observe((done_at - first) / (s.generated_tokens - 1))
        lat.e2e_request_latency.observe(done_at - times.submitted)
        dispatched = times.dispatched if times.dispatched is not None else done_at
        lat.request_queue_time.observe(dispatched - times.submitted)
        lat.request_prefill_time.observe(s.time.prefill)
        if s.accepted_counts:
            hist = lat.accepted_per_iteration.setdefault(s.policy or "",
                                                         Histogram.of(ACCEPTED_BUCKETS))
            for k, n in enumerate(s.accepted_counts):
                if n:
                    hist.observe(float(k), n)

    def snapshot(self, queued: int, running: int) -> Totals:
        """A copy that shares no container with this one (it may go to another thread)."""
        return msgspec.structs.replace(self, requests=dict(self.requests),
                                       draft_iterations=dict(self.draft_iterations),
                                       queued=queued, running=running,
                                       latencies=self.latencies.copy())

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class RequestTimes:
    """When a request was submitted, sent to the decoder and streamed (monotonic seconds,
    kept by the supervisor for the latency histograms)."""

    submitted: float
    dispatched: float | None = None
    first_tokens: float | None = None
    last_tokens: float | None = None
    gaps: list[float] = field(default_factory=list)  # between token messages

    def tokens(self, now: float) -> None:
        if self.first_tokens is None:
            self.first_tokens = now
        else:
            self.gaps.append(now - (self.last_tokens or now))
        self.last_tokens = now


@dataclass
class RunStats:
    """Everything one request produced besides its tokens."""

    records: list[IterationRecord] = field(default_factory=list)
    t_prefill: float = 0.0
    t_load_wait: float = 0.0
    t_prediction: float = 0.0
    t_e2e: float = 0.0
    t_pre: float = 0.0
    t_sched: float = 0.0
    t_bind: float = 0.0
    loads: int = 0
    evictions: int = 0
    switches: int = 0
    bytes_loaded: int = 0
    prompt_tokens: int = 0
    prefill_loads: tuple[str, ...] = ()  # the loads in flight as the prefill began (they
    # slow it)
    points: int = 0  # scheduling points (decisions) the request's decode loop made
    t_grammar: float = 0.0  # in the request's output grammar (procs/decoder/sched/constraint.py)
    forced: int = 0  # tokens the grammar forced, proposed without a draft
    token_logprobs: list[LogprobRow] = field(default_factory=list)  # per token, where asked

    def report(self) -> Summary:
        """The metrics, typed."""
        recs = self.records
        # (a context-lookup iteration that found nothing to propose is a plain target step)
        drafted = [r for r in recs if r.draft is not None and r.proposed > 0]
        num_drafts = len(drafted)
        num_draft_tokens = sum(r.proposed for r in drafted)
        num_accepted = sum(r.accepted for r in drafted)
        generated = sum(r.emitted for r in recs)
        t_desired = sum(r.duration for r in recs if r.desired)
        # fallback = a non-preferred *resident draft* runs while the preferred one loads;
        # the target alone while nothing preferred is resident (cold start) is kept apart
        t_fallback = sum(r.duration for r in recs if not r.desired and r.draft is not None)
        t_target_fb = sum(r.duration for r in recs if not r.desired and r.draft is None)
        t_decode = t_desired + t_fallback + t_target_fb + self.t_load_wait + self.t_prediction
        return Summary(
            generated_tokens=generated,
            prompt_tokens=self.prompt_tokens,
            iterations=len(recs),
            tokens_per_s_steady=generated / t_decode if t_decode > 0 else 0.0,
            tokens_per_s_e2e=generated / self.t_e2e if self.t_e2e > 0 else 0.0,
            num_drafts=num_drafts,
            num_draft_tokens=num_draft_tokens,
            num_accepted_tokens=num_accepted,
            mean_acceptance_length=1.0 + num_accepted / num_drafts if num_drafts else 1.0,
            acceptance_rate=num_accepted / num_draft_tokens if num_draft_tokens else 0.0,
            time=TimeBreakdown(
                prefill=self.t_prefill,
                draft=sum(r.t_draft for r in recs),
                verify=sum(r.t_verify for r in recs),
                catchup=sum(r.t_catchup for r in recs),
                desired=t_desired,
                fallback=t_fallback,
                target_fallback=t_target_fb,
                load_wait=self.t_load_wait,
                prediction=self.t_prediction,
                decode=t_decode,
                e2e=self.t_e2e,
                target_alone=sum(r.duration for r in recs if r.desired and r.draft is None),
                pre=self.t_pre,
                sched=self.t_sched,
                bind=self.t_bind,
                other=self.t_e2e - (self.t_pre + self.t_prefill + t_decode + self.t_sched
                                    + self.t_bind) if self.t_e2e > 0 else 0.0,
            ),
            loads=self.loads,
            evictions=self.evictions,
            switches=self.switches,
            bytes_loaded=self.bytes_loaded,
            drafts_used=dict(Counter(r.draft for r in drafted if r.draft is not None)),
            accepted_counts=_counts(r.accepted for r in drafted),
            grammar_s=self.t_grammar,
            forced_tokens=self.forced,
        )

    def summary(self) -> dict[str, Any]:
        """The metrics as plain JSON-ready data (`memspec generate --json`)."""
        return as_json(self.report())


def _counts(values: Any) -> list[int]:
    """[k]: how many of `values` equal k (non-negative integers)."""
    out: list[int] = []
    for v in values:
        if v >= len(out):
            out.extend([0] * (v + 1 - len(out)))
        out[v] += 1
    return out


def as_json(obj: Any) -> Any:
    """Structs (and containers of them) as plain dicts and lists, ready for json.dumps."""
    return msgspec.to_builtins(obj)


def gmean(values: Sequence[float]) -> float:
    """Geometric mean of the positive values (how per-domain ratios are summarised)."""
    vals = [v for v in values if v > 0]
    return exp(sum(log(v) for v in vals) / len(vals)) if vals else 0.0
