"""The speculation gate: speculate only while it pays, from a decoder's very first request.

Lossless speculation is not free: an iteration costs gamma draft steps and a verify of
gamma+1 rows, so a draft must average more tokens per iteration than that costs in target
steps, or decoding gets *slower* than the target alone (on a 2-core CPU, int4: ~2 target
steps per iteration). The gate wraps any drafting policy (``Gated``) and lets its chosen
draft run an interval only while this request's tokens per iteration of that draft pay for
what an iteration costs at the current context length.

Costs (``GateCosts``, seconds as lines in the context length) are known before the first
request: the decoder measures a target step and a verify at start (calibration.py, cached
per machine, kernel path, target and code version), the simulator takes its cost model's.
Every iteration of the request refines them (measured over predicted, per draft and for the
target); nothing is learnt from other requests or other policies.

What the gate does not know yet it probes with single iterations: the first look at a draft
is up to FIRST_LOOK iterations while its record stays near break-even, not an interval, and
it is free only on a machine where the pool's drafts could pay (an iteration costs fewer
target steps than they bring on dev, PRIOR_TAU; elsewhere it comes from the share); a
draft let run stops at the first iteration after which it no longer pays (not at the end
of its interval); and a closed gate probes again only while the probes' worst-case extra
cost (a probe that accepts nothing still emits the token a target step would) stays under
``PROBE_SHARE`` of the request's decode time so far. A closed gate asks for no rankings (the predictor rests), and until a draft has paid only the draft the gate
would look at is loaded, not the policy's whole working set.

Pure logic, shared by the decoder's loop and the replay simulator.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from memspec.common.metrics import IterationRecord
from memspec.common.tuned import knob
from memspec.procs.decoder.sched.cache_manager import CacheActions
from memspec.procs.decoder.sched.costs import LOOKUP

Line = tuple[float, float]  # seconds = a + b * context tokens
Verdict = Literal["run", "probe", "skip"]


@dataclass(frozen=True)
class GateCosts:
    """What an iteration costs before this request has run one: a target step, and per
    draft a whole speculative iteration (gamma draft steps, the verify, acceptance), each
    a line in the context length. A draft without its own line costs the verify line plus
    ``draft_prior_s`` (gamma steps of a typical draft)."""

    target: Line
    verify: Line | None = None
    spec: Mapping[str, Line] = field(default_factory=dict)
    draft_prior_s: float = 0.0
    gamma: int = 4  # rows of `verify` minus one
    free: frozenset[str] = frozenset()  # drafts that run no model (datastores), as LOOKUP
    prefill: Line | None = None  # a prompt's prefill, a line in its tokens (calibrated)

    def target_s(self, context: int) -> float:
        return self.target[0] + self.target[1] * context

    def model_free(self, draft: str) -> bool:
        """Its iteration is the verify alone, and one that proposes nothing a target step."""
        return draft == LOOKUP or draft in self.free

    def spec_line(self, draft: str) -> Line:
        if draft in self.spec:
            return self.spec[draft]
        verify = self.verify or (2.0 * self.target[0], self.target[1])
        if self.model_free(draft):  # no model runs: the verify is the whole iteration
            return verify
        return verify[0] + self.draft_prior_s, verify[1]

    def with_draft(self, draft: str, gamma_steps_s: float) -> GateCosts:
        """A draft measured at bind: its iteration is the verify plus its gamma steps."""
        verify = self.verify or (2.0 * self.target[0], self.target[1])
        return replace(self, spec={**self.spec, draft: (verify[0] + gamma_steps_s, verify[1])})


class _Estimate:
    """Tokens per iteration: a running mean that turns into an EMA after 1/alpha samples:
    the first iterations decide quickly, later ones track a changing text."""

    def __init__(self, alpha: float) -> None:
        self.alpha, self.n, self.value = alpha, 0, 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.value += max(self.alpha, 1.0 / self.n) * (x - self.value)

    def seed(self, value: float, weight: int) -> _Estimate:
        """Start from a prior worth `weight` iterations."""
        self.value, self.n = float(value), int(weight)
        return self


class _RecentMedian:
    """A cost: the median of the last few timings (and the calibration's, while there are
    few). Other work on the machine makes single iterations many times slower (measured:
    0.5 s for a 10 ms iteration beside a second pipeline); a median ignores such outliers
    where a mean would let one of them flip the gate's arithmetic."""

    WINDOW = 9

    def __init__(self, prior: float | None = None) -> None:
        self.prior, self.n = prior, 0
        self.recent: deque[float] = deque(maxlen=self.WINDOW)

    def add(self, x: float) -> None:
        self.n += 1
        self.recent.append(x)

    @property
    def value(self) -> float:
        xs = list(self.recent)
        if self.prior is not None and len(xs) < 3:
            xs.append(self.prior)
        return statistics.median(xs) if xs else 0.0


class SpecGate:
    # Every constant here is chosen on dev by `memspec bench tune` (tuned.json names the
    # grid and the dev figure): over iterations that cost 1.7-3.1 target steps, the setting
    # that gains the most while no cost's geometric mean falls below 0.975 and no prompt
    # below 0.92 (a one-iteration look closed the gate on drafts that pay on average:
    # acceptance swings 0-4 from one iteration to the next).
    ALPHA = knob("gate.ALPHA")  # tokens per iteration: weight of one iteration, warmed up
    PROBE_SHARE = knob("gate.PROBE_SHARE")  # probes' worst-case extra cost / decode time
    FIRST_LOOK = knob("gate.FIRST_LOOK")  # single iterations a draft gets, free, before its
    NEAR_MISS = knob("gate.NEAR_MISS")  # record decides, each after the first while that
    # record is within NEAR_MISS of break-even
    PRIOR_TAU = knob("gate.PRIOR_TAU")  # tokens per iteration the pool's drafts reach on dev
    # before a request has a record of its own: a draft's first look is free only where that
    # could pay (break-even at or below it); on a machine whose iterations cost more, its
    # looks come from PROBE_SHARE like any later probe (a look that cannot pay still costs
    # the catch-up over the prompt and a wide verify: ~4 target steps on 2 cores)
    STOP_INSIDE = knob("gate.STOP_INSIDE")  # a running draft whose record has fewer
    # iterations than this stops at the first iteration after which it no longer pays, not
    # at its interval's end (the sweep weighs 0, 8 and always; tuned.json has its choice)
    # A ranking is worth asking for only with this many tokens still to come: what it sets
    # off (the predictor's encoding with the decoder on one core, the load of the draft it
    # ranks first, that draft's first look over the context) costs ~6.5 target steps on a
    # 2-core CPU, and the pool's domain heads accept ~2% more than the general head on
    # their own domains; on dev a horizon under the request's length loses 6% (tuned.json)
    RANK_HORIZON = knob("gate.RANK_HORIZON")
    LED_LOOKS = 3  # a datastore's iterations led by its own token before those alone judge
    # it, and the lookup's proposals before a head is judged against them (hand-set)
    # the context lookup's proposing iterations before its record judges it, chosen in
    # real runs on dev (tuned.json's lookup_gate section: with proposal lengths chosen per
    # cost and heads judged against the lookup, from its first look)
    LOOKUP_LOOKS = knob("gate.LOOKUP_LOOKS")
    # ... unless after this many it accepts under this many tokens per iteration (None:
    # never early): a context that repeats words but never what follows them costs a
    # verify (~1.7 target steps on 2 cores) per proposal
    LOOKUP_FAILING = knob("gate.LOOKUP_FAILING")
    # with LOOKUP_FIRST, a model draft's record starts from [tokens an iteration, weight]:
    # what the pool's general head brings on dev where the lookup has nothing, worth that
    # many iterations (None: no prior). There acceptance swings between 1 and 5 tokens, and
    # two early iterations of one token each closed, for the rest of a request, heads that
    # pay ~12% there on average (tuned.json's head_prior section; the default pool's
    # figure, which a pool of small draft models gets too)
    HEAD_PRIOR = knob("gate.HEAD_PRIOR")

    def __init__(self, costs: GateCosts | None, lookup: bool = False,
                 rank_horizon: int | None = None, lookup_first: bool = False) -> None:
        self.costs = costs
        self.lookup = lookup  # the engine runs the context lookup (LOOKUP) when asked
        # ... and in place of a model draft's iteration wherever the context repeats
        # (engine.LOOKUP_FIRST): a draft then runs only where the lookup has nothing
        self.lookup_first = lookup_first
        self.rank_horizon = rank_horizon  # the pool's (None: RANK_HORIZON, tuned on heads)
        self.reset()

    @property
    def horizon(self) -> int:
        """Tokens still to come for a ranking to be worth asking for: the pool's own where
        it sets one (its drafts' spread decides what a right choice gains per token)."""
        return self.RANK_HORIZON if self.rank_horizon is None else self.rank_horizon

    def reset(self) -> None:
        """A new request: nothing of the last one carries over (costs are re-refined)."""
        self.tau: dict[str, _Estimate] = {}
        self.led: dict[str, _Estimate] = {}  # a datastore's iterations its own token led
        self.spec_a: dict[str, _RecentMedian] = {}  # intercepts refined from this request
        self.target_a: _RecentMedian | None = None
        self.verify_ratio: _RecentMedian | None = None  # measured over calibrated verifies
        self.context = 0
        self.elapsed = 0.0  # decode seconds of this request's iterations
        self.probe_cost = 0.0  # worst-case extra seconds of the probes so far
        self.probes = 0
        self.closed = False  # the last verdict ran the target alone by choice
        self.probing = False  # the last verdict was a probe (booked when it runs)...
        self.probed: str | None = None  # ... of this draft
        self.budgeted = False  # ... paid from the share (not a draft's free first look)
        self.last: str | None = None  # the draft the policy chose last
        self.seen: dict[str, int] = {}  # context each draft's cache has caught up to
        self.catch_token: _RecentMedian | None = None  # seconds per token caught up on

    # ---- what this request has measured -------------------------------------------------
    def observe(self, rec: IterationRecord) -> None:
        self.elapsed += rec.duration
        self.context = rec.context + rec.emitted
        if self.costs is None:
            return
        if rec.draft is None or (self.costs.model_free(rec.draft) and rec.proposed == 0):
            if rec.shared:  # a step on fewer cores (a load in flight): not what the target
                return  # alone costs when the gate closes, and it would open the gate
            a, b = self.costs.target
            if self.target_a is None:
                self.target_a = _RecentMedian(a)
            self.target_a.add(rec.duration - b * rec.context)
            return
        tau = self.tau.get(rec.draft)
        # a probe is booked when its draft runs (a verdict may go unused, and with
        # LOOKUP_FIRST the engine may run the lookup in its place)
        if self.probing and rec.draft == self.probed:
            if self.budgeted:
                self.probe_cost += self._probe_extra(rec.draft)
            self.probes += 1
            self.probing = False
        self.seen[rec.draft] = rec.context
        if not rec.shared:  # (timings on fewer cores, a load in flight, price nothing: a
            self._observe_costs(rec)  # head's few iterations beside its neighbour's load
            # once priced it at 1.7 target steps and closed it for the rest of a request)
        if tau is None:  # the draft's own iterations decide, from the first (or a prior)
            tau = self.tau[rec.draft] = _Estimate(self.ALPHA)
            if self.lookup_first and self.HEAD_PRIOR and not self.costs.model_free(rec.draft):
                tau.seed(*self.HEAD_PRIOR)
        tau.add(rec.accepted + 1.0)
        if rec.store_led:
            self.led.setdefault(rec.draft, _Estimate(self.ALPHA)).add(rec.accepted + 1.0)

    def _observe_costs(self, rec: IterationRecord) -> None:
        assert self.costs is not None and rec.draft is not None
        if rec.catchup_tokens > 0 and rec.t_catchup > 0:
            if self.catch_token is None:
                self.catch_token = _RecentMedian()
            self.catch_token.add(rec.t_catchup / rec.catchup_tokens)
        a, b = self.costs.spec_line(rec.draft)
        est = self.spec_a.setdefault(rec.draft, _RecentMedian(a))
        est.add(rec.duration - rec.t_catchup - b * rec.context)
        verify = self.costs.verify
        if verify is not None and rec.t_verify > 0 and rec.proposed == self.costs.gamma:
            if self.verify_ratio is None:  # this machine now against the calibration:
                self.verify_ratio = _RecentMedian()  # scales the target's
            self.verify_ratio.add(rec.t_verify / (verify[0] + verify[1] * rec.context))

    def target_s(self, context: int) -> float:
        """A target step at `context`: measured in this request once it has run some; before
        that the calibration's, scaled as this request's verifies compare with the
        calibration's (a calibration taken on a busier or quieter machine moves both alike,
        so the gate's ratio stays right)."""
        assert self.costs is not None
        a, b = self.costs.target
        measured = self.target_a
        if measured is not None and (measured.n >= 3 or self.verify_ratio is None
                                     or self.verify_ratio.n < 3):
            return measured.value + b * context
        # two target steps and the calibration's, against this request's many verifies:
        # the verifies say more (a resident head looked at after two steps was priced on
        # the calibration's step, ran at 2.4 target steps an iteration, and paid on paper)
        scale = self.verify_ratio.value if self.verify_ratio is not None else 1.0
        return scale * (a + b * context)

    def scale(self) -> float:
        """This request's machine against the calibration's: its verifies over the
        calibrated verify where a draft has run a full one, else its target steps over the
        calibrated step at this context. A calibration taken on a busier (or quieter)
        machine moves every line alike, intercept and slope, so a draft not measured yet is
        priced at its whole calibrated line times this: unscaled, a calibration cached while
        the machine was loaded made a 1.5-step verify look like 3.7 target steps against
        this request's measured target, and one with only its intercept scaled still priced
        the lookup at 2.3 steps 500 tokens in (its slope, 3x too steep, stayed), so the gate
        never looked at it."""
        assert self.costs is not None
        if self.verify_ratio is not None:
            return self.verify_ratio.value
        calibrated = self.costs.target_s(self.context)
        if self.target_a is not None and calibrated > 0:
            return max(0.0, self.target_s(self.context)) / calibrated
        return 1.0

    def spec_s(self, draft: str, context: int) -> float:
        assert self.costs is not None
        a, b = self.costs.spec_line(draft)
        est = self.spec_a.get(draft)
        return est.value + b * context if est else self.scale() * (a + b * context)

    def break_even(self, draft: str) -> float:
        """Tokens per iteration at which `draft` and the target alone decode equally fast."""
        t = self.target_s(self.context)  # an iteration emits at least the token a step
        return max(1.0, self.spec_s(draft, self.context) / t) if t > 0 else 1.0  # would

    def any_paid(self) -> bool:
        """Some draft's record in this request pays (its working set is worth loading; the
        context lookup loads nothing, so its record does not count)."""
        return any(self.pays(d) for d in self.tau if d != LOOKUP)

    def pays(self, draft: str) -> bool:
        tau = self.tau.get(draft)  # a draft that accepts nothing pays on no machine
        return tau is not None and tau.value > 1.0 and tau.value >= self.bar(draft) \
            and self.store_pays(draft)

    def bar(self, draft: str) -> float:
        """Tokens per iteration `draft` must bring: the higher of break-even with the target
        alone and the lookup's record (`lookup_bar`), since what the gate runs instead of a
        draft is the lookup. Judged against the target only, a head that paid was kept where
        the lookup alone was faster (dev, law: 3.59 tokens an iteration with the head and
        its draft steps, 3.93 with the lookup's verifies alone; 332 against 429 tok/s)."""
        return max(self.break_even(draft), self.lookup_bar(draft))

    def lookup_bar(self, draft: str) -> float:
        """Tokens per iteration `draft` needs to match the lookup's record in this request,
        once that record has LED_LOOKS proposals and pays (0: no such record, or `draft`
        is model-free). A resident head's free first look came after three proposals;
        FIRST_LOOK's eight were never reached."""
        if not self.lookup or self.lookup_first or self.costs is None \
                or self.costs.model_free(draft):
            return 0.0  # (with LOOKUP_FIRST a draft runs only where the lookup has nothing:
            # what it competes with there is a target step)
        look = self.tau.get(LOOKUP)
        if look is None or look.n < self.LED_LOOKS or not self.pays(LOOKUP):
            return 0.0
        c = self.context
        spec = self.spec_s(LOOKUP, c)
        return look.value * self.spec_s(draft, c) / spec if spec > 0 else 0.0

    def store_pays(self, draft: str) -> bool:
        """A datastore's own proposals pay for their verify, against the context lookup
        alone: where both propose they propose the same (the lookup's token goes first), so
        only the iterations the store led tell them apart, and there the lookup alone would
        have run a target step. A store whose led iterations do not pay is worse than the
        lookup alone (on dev the general store was 5% slower than it, in process, while a
        domain's own store was 5% faster), so the gate runs the lookup instead. Judged
        after LED_LOOKS led iterations (the first say little; an unjudged store runs on
        its whole record)."""
        led = self.led.get(draft)
        if not self.lookup or led is None or led.n < self.LED_LOOKS:
            return True
        return led.value > 1.0 and led.value >= self.break_even(draft)

    # ---- the choice ---------------------------------------------------------------------
    def verdict(self, draft: str) -> Verdict:
        """Run `draft` for an interval, probe it for one iteration, or skip (target alone)."""
        if self.costs is None:
            return "run"
        if self.pays(draft) or self._lookup_young(draft):
            self.closed = self.probing = False
            return "run"
        self.probing = self.may_look(draft)
        self.probed = draft
        self.budgeted = self.probing and not self._free_look(draft)
        self.closed = not self.probing
        return "probe" if self.probing else "skip"

    def keeps(self, draft: str) -> bool:
        """Inside an interval the gate let `draft` run: go on only while it pays."""
        if self.costs is None or self._lookup_young(draft):
            return True
        if self.costs.model_free(draft):  # a probe goes on until it has proposed; a draft
            return self.probing or self.pays(draft)  # with no model costs a target step else
        tau = self.tau.get(draft)
        young = tau is not None and tau.n < self.STOP_INSIDE
        return not young or self.pays(draft)

    def _lookup_young(self, draft: str) -> bool:
        """The context lookup runs unjudged for its first LOOKUP_LOOKS proposals: it costs
        nothing where the context does not repeat, and its worth can come in bursts (a
        list, a restated clause). After LOOKUP_LOOKS proposals a lookup that does not pay
        (a text that repeats words but not what follows them) is gated like any draft, and
        after LOOKUP_FAILING's first count one that accepts almost nothing is. Both are
        chosen in real runs on dev (`memspec bench tune`'s lookup_gate section; the figures
        are in tuned.json and docs/DESIGN.md)."""
        if draft != LOOKUP:
            return False
        tau = self.tau.get(LOOKUP)
        if tau is None:
            return True
        failing = self.LOOKUP_FAILING
        return tau.n < self.LOOKUP_LOOKS and not (
            failing is not None and tau.n >= failing[0] and tau.value < failing[1])

    def _probe_extra(self, draft: str) -> float:
        """What a probe costs over a target step: as measured in this request, and never
        below the calibration's (its fastest timings, scaled to this request's machine), so that noisy
        timings never make probes look free; plus the draft's catch-up on the tokens
        committed since it last ran (a head re-reads each with the target's features: on
        2 cores ~80 tokens cost more than the probe's own iteration)."""
        assert self.costs is not None
        c = self.context
        a, b = self.costs.spec_line(draft)
        calibrated = (a + b * c - self.costs.target_s(c)) * self.scale()
        extra = max(0.0, calibrated, self.spec_s(draft, c) - self.target_s(c))
        behind = c - self.seen.get(draft, c)
        if self.catch_token is not None and behind > 0:
            extra += self.catch_token.value * behind
        return extra

    def may_look(self, draft: str) -> bool:
        """The first look at a draft is free where the pool's drafts could pay (PRIOR_TAU):
        up to FIRST_LOOK iterations while its record stays within NEAR_MISS of break-even
        (nothing is known yet, and it is what lets a draft in at all). Other probes stay
        within PROBE_SHARE of the decode time so far."""
        if self._free_look(draft):
            return True
        extra = self._probe_extra(draft)
        return self.probe_cost + extra <= self.PROBE_SHARE * self.elapsed

    def _free_look(self, draft: str) -> bool:
        """Against `bar` (a head that cannot beat a paying lookup is not looked at for
        free)."""
        tau = self.tau.get(draft)
        bar = self.bar(draft)
        if tau is None:
            return bar <= self.PRIOR_TAU
        if tau.n >= self.FIRST_LOOK or (tau.n >= 2 and tau.value <= 1.0):
            return False  # looked enough; or two looks without one token: pays nowhere
        return tau.value >= self.NEAR_MISS * bar


def gate_decision(gate: SpecGate, decision, resident: bool = False):  # noqa: ANN001
    """`decision` (a policies.Decision) as the gate lets it run: unchanged while its draft
    pays, cut to a one-iteration probe (``limit=1``), or the target alone by choice
    (preferred None: not a fallback). Until a draft has paid in this request nothing is
    loaded while some draft is `resident` to be probed (a load costs the loader's reads
    and checks on the decoder's cores, and a draft that has not paid yet rarely pays them
    back within the request); with none resident, only the draft the gate would look at
    now (none while its probes are not affordable)."""
    run = decision.run
    gate.last = run or decision.preferred
    if decision.wait_for is not None:
        return decision
    verdict = gate.verdict(run) if run is not None else None
    if verdict == "run":
        return decision
    if not gate.any_paid() and gate.costs is not None:
        want = decision.preferred  # loaded only to be looked at now (a load takes a core)
        # a model-free draft (a datastore, ~0.5 MB) needs no catch-up over the context and
        # loads in ~2 ms from a local disk: the ranking's choice replaces a resident one at once
        blocked = resident and not (want is not None and gate.costs.model_free(want))
        keep = None if blocked or want is None or not gate.may_look(want) else want
        decision = replace(decision, actions=_only(decision.actions, keep))
        if verdict is None and keep is None and want is not None:  # nothing to run, and
            gate.closed = True  # nothing loads to be looked at: the target alone by choice
            return _or_lookup(gate, replace(decision, run=None, preferred=None))  # (not a
            # fallback)
    if verdict == "probe":
        return replace(decision, limit=1)
    if verdict == "skip":
        decision = replace(decision, run=None, preferred=None)
    return _or_lookup(gate, decision)


def _or_lookup(gate: SpecGate, decision):  # noqa: ANN001, ANN202
    """An interval the target would run alone runs the context lookup instead, under the
    same gate as a draft: it proposes only where the context repeats itself (else its
    iteration is a plain target step), and a lookup whose record does not pay for its
    wider verifies stops, is probed within the share, or is skipped. What the target
    would have run by choice stays booked as chosen; a fallback (a wanted draft still
    loading) stays a fallback."""
    if decision.run is not None or not gate.lookup or gate.costs is None \
            or decision.wait_for is not None:
        return decision
    closed = gate.closed  # the drafts' gate: the lookup's verdict does not reopen it
    verdict = gate.verdict(LOOKUP)
    gate.closed = closed
    if verdict == "skip":
        return decision
    # a probe of the lookup is no one-iteration interval: its iterations cost a target
    # step until the context repeats, and `keeps` ends it after its first proposal
    return replace(decision, run=LOOKUP,
                   preferred=LOOKUP if decision.preferred is None else decision.preferred)


def _only(actions: CacheActions, draft: str | None) -> CacheActions:
    keep = tuple(d for d in actions.prefetch if d == draft)
    return CacheActions(prefetch=keep, evict=actions.evict if keep else (),
                        cancel=actions.cancel)
