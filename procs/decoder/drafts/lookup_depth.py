"""How many tokens the context lookup proposes in an iteration: as many as pay for their rows.

The lookup (lookup.py) finds what followed the context's suffix before and could propose up
to gamma tokens of it. Each proposed token is one more row in the verify, and what a row
costs depends on the CPU: on 2 cores, int4, a 5-row verify costs 1.6 target steps with the
AVX-512 kernels but 2.0-2.2 with AVX2 alone, while the lookup's proposals are accepted
mostly whole or not at all (dev: 57% of its first tokens, then ~75% of each next one given
the last). Proposing all gamma tokens then pays on AVX-512 and loses on AVX2, where two
pay best. So each proposal's length is the one that brings the most tokens per unit of
verify cost, from

- what a verify of r rows costs, relative to a target step at the current context: the
  decoder's calibrated lines (a step and a verify of gamma+1 rows), rows in between on the
  straight line between them (measured, the middle rows cost a little less: the choice
  errs towards proposing more);
- how often the lookup's j-th token is accepted once the first j-1 were (q_j), by how long
  the context suffix under its first token matched: a prior from dev per match bucket,
  worth ``weight`` observations, then this request's own verifies in that bucket (a text
  that repeats whole clauses earns longer proposals, one that repeats single words
  shorter). A match of the shortest length the lookup takes is weak evidence (dev,
  lookup-only, 4-token proposals: a 2-token match's first token was accepted 47% of the
  time, 1.18 tokens per verify; an 8-token match's 82%, 2.80), so it earns short
  proposals while a long one earns gamma.

Greedy verification accepts the same tokens whatever the length (a shorter proposal is a
prefix of the longer one): the output stays the target's own. Pure logic, no clock.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from memspec.common.tuned import knob
from memspec.procs.decoder.sched.gate import Line

Prior = Sequence[float] | Sequence[tuple[int, Sequence[float]]]


def buckets(prior: Prior) -> list[tuple[int, list[float]]]:
    """``[(smallest match, q)]`` ascending from a tuned prior: a flat q list (one bucket for
    every match) or ``[[smallest match, q], ...]``."""
    items = list(prior)
    if not items or not isinstance(items[0], (list, tuple)):
        return [(0, [float(p) for p in items])]
    return sorted((int(m), [float(p) for p in q]) for m, q in items)


class LookupDepth:
    """Chooses the lookup's proposal length per iteration and learns from its verifies."""

    # q_j on dev per match bucket (the lookup's proposals of gamma tokens, lookup-only) and
    # what that prior weighs in observations (None: every proposal is gamma tokens),
    # `memspec bench tune`'s lookup_depth section (tuned.json)
    PRIOR = knob("lookup.DEPTH_PRIOR")
    WEIGHT = knob("lookup.DEPTH_WEIGHT")

    @classmethod
    def tuned(cls, step: Line, verify: Line, gamma: int) -> LookupDepth | None:
        """One for a request, with the tuned prior; None where the tuning turned it off."""
        if cls.WEIGHT is None:
            return None
        return cls(step, verify, gamma, cls.PRIOR, float(cls.WEIGHT))

    def __init__(self, step: Line, verify: Line, gamma: int, prior: Prior,
                 weight: float) -> None:
        if gamma < 1:
            raise ValueError("gamma must be >= 1")
        self.step, self.verify, self.gamma = step, verify, gamma
        self.edges: list[int] = []
        self.hits: list[list[float]] = []  # per bucket, pseudo-observations: accepted at
        self.tries: list[list[float]] = []  # depth j ... of reached depth j
        for edge, qs in buckets(prior):
            q = [min(0.999, max(0.001, p)) for p in qs] or [0.5]
            q = (q + [q[-1]] * gamma)[:gamma]  # a pool with a longer gamma: the last depth's
            self.edges.append(edge)
            self.hits.append([weight * p for p in q])
            self.tries.append([float(weight)] * gamma)

    def bucket(self, match: int) -> int:
        """The bucket of a suffix match of ``match`` tokens (below every edge: the first)."""
        return max(0, bisect_right(self.edges, match) - 1)

    def q(self, j: int, match: int = 0) -> float:
        """P(the j-th proposed token is accepted | the j-1 before it were), j from 1."""
        b = self.bucket(match)
        tries = self.tries[b][j - 1]
        return self.hits[b][j - 1] / tries if tries > 0 else 0.5

    def rows_cost(self, rows: int, context: int) -> float:
        """A verify of `rows` rows over a target step, at `context`."""
        s = self.step[0] + self.step[1] * context
        v = self.verify[0] + self.verify[1] * context
        if s <= 0:
            return float(rows)
        return (s + (v - s) * (rows - 1) / self.gamma) / s

    def choose(self, context: int, match: int = 0) -> int:
        """The proposal length (1..gamma) with the most expected tokens per verify cost."""
        best_k, best_rate = 1, -1.0
        reach, expected = 1.0, 1.0  # the verify's own token always comes
        for k in range(1, self.gamma + 1):
            reach *= self.q(k, match)
            expected += reach
            rate = expected / self.rows_cost(k + 1, context)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def observe(self, proposed: int, accepted: int, match: int = 0) -> None:
        """A verify of `proposed` tokens accepted the first `accepted`: depth j was reached
        for j <= accepted + 1 and passed for j <= accepted."""
        b = self.bucket(match)
        for j in range(1, min(proposed, accepted + 1) + 1):
            self.tries[b][j - 1] += 1.0
            if j <= accepted:
                self.hits[b][j - 1] += 1.0
