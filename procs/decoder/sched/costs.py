"""What the scheduler prices its choices in: one iteration of each draft, a target step,
a load, a switch (`PlanCosts`, in SD iterations), and the name the context lookup runs under.

Shared by the runtime's policies and gate, oracle-dynamic's planner and the simulator; pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# the context lookup on its own as a draft (the engine's zero-memory draft, `lookup-only`):
# always "resident", nothing to load; a name no pool draft may take
LOOKUP = "(lookup)"


@dataclass(frozen=True)
class PlanCosts:
    """What oracle-dynamic believes things cost, in SD iterations (the unit: a mean draft
    iteration). Iterations are lines in the context: `spec[d]` (default 1) or `target`, plus
    `per_token` per context token (0: `target` is the mean ratio at the contexts seen)."""

    load: Mapping[str, float]  # one load of each draft
    target: float = 1.0  # one target-only step
    switch: float = 0.25  # (re)activating a draft: its KV catch-up, fixed part
    switch_per_token: float = 0.0  # ... and per token of context it catches up on
    spec: Mapping[str, float] = field(default_factory=dict)  # per-draft iteration (default 1)
    quantum: float = 0.001  # load time is tracked in these units: fine enough that no
    # rounding adds up over many short intervals, coarse enough that equal paths meet
    timed: bool = False  # `target` was measured (not the prior): the speculation gate trusts it
    bind: float = 0.0  # the decoder binding one landed draft
    per_token: float = 0.0  # an iteration's growth per context token (spec and target alike)
    overhead: float = 0.0  # a scheduling point (drain, decide)
    inner: float = 0.0  # between two iterations of one interval
    load_slowdown: float = 0.0  # iterations run this much slower while the loader works
    prefill: float = 0.0  # request start to decode loop (the loads' head start), fixed part
    prefill_per_token: float = 0.0  # ... and per prompt token
    prefill_slowdown: float = 0.0  # the prefill runs this much slower while the loader works
    # (on two cores its reads, checks and copies stall the prefill's threads)
    unit_s: float = 0.0  # seconds in the unit where known (a calibrated prior: the meter
    # then keeps the calibration's slope and converts the prior's values)
    row: float = 0.0  # one more row in a verify, where the runtime proposes exactly the
    # tokens the target accepts (oracle-dynamic knows them): k accepted then cost a target
    # step and k rows, none a plain step (0: every verify costs spec[d] or spec[LOOKUP])
    call: Mapping[str, float] = field(default_factory=dict)  # ... and a draft's proposal
    # step (`spec[d]` is an iteration of gamma proposals: each one fewer saves a row and one)
    free: frozenset[str] = frozenset()  # drafts that run no model (datastores): as the
    # lookup, a verify alone, and a plain step where they propose nothing

    @classmethod
    def uniform(cls, drafts: Sequence[str], load_iters: float, **kw: float) -> PlanCosts:
        return cls(load={d: float(load_iters) for d in drafts}, **kw)  # type: ignore[arg-type]

    def iteration(self, run: str | None, context: int) -> float:
        """One iteration of `run` (None: a target step; LOOKUP: the context lookup's
        verify, as dear as a target step until it is known) at `context` tokens."""
        if run is None:
            base = self.target
        else:
            base = self.spec.get(run, self.target if run == LOOKUP else 1.0)
        return base + self.per_token * context

    def lookup(self, accepted: int, context: int) -> float:
        """One iteration of the context lookup where `accepted` of its proposals are."""
        if self.row > 0:
            return self.iteration(None, context) + self.row * accepted
        return self.iteration(LOOKUP, context)

    def proposing(self, run: str, context: int, k: int, gamma: int) -> float:
        """One iteration of draft `run` proposing `k` of its gamma tokens (exact
        proposals, `row`; without them every iteration proposes gamma)."""
        if self.row > 0 and run in self.free:
            return self.iteration(None, context) + self.row * k
        base = self.iteration(run, context)
        if self.row <= 0 or k >= gamma:
            return base
        return base - (gamma - max(1, k)) * (self.row + self.call.get(run, 0.0))

    def slowed(self, work: float, busy: float, slowdown: float | None = None) -> float:
        """Wall time of `work` iterations (or a prefill, at its own `slowdown`) while the
        loader has `busy` time of loads left."""
        s = 1.0 + (self.load_slowdown if slowdown is None else slowdown)
        if s == 1.0 or busy <= 0:
            return work
        return work * s if busy >= work * s else busy + (work - busy / s)
