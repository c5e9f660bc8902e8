"""Oracle plans from acceptance tables: the future knowledge behind oracle-static/-dynamic.

Pure (lists and ints): the decoder's controller and the replay simulator hand the very same
plan to `make_policy(..., oracle_plan=...)`; each passes a `position()` callable that says
how many tokens the request has committed, which is all the tables need.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from memspec.procs.decoder.policies import OraclePlan, SchedView
from memspec.zoo.tables import Table, interval_utility, oracle_static


def static_plan(tables: Mapping[str, Table], gamma: int) -> OraclePlan:
    """oracle-static: the single draft that finishes this trajectory in fewest iterations."""
    best, _ = oracle_static(tables, gamma)

    def plan(_view: SchedView) -> str:
        return best

    return plan


def dynamic_plan(tables: Mapping[str, Table], gamma: int, interval: int,
                 position: Callable[[], int]) -> OraclePlan:
    """oracle-dynamic: scores = what each draft would commit over the next interval from the
    current position (tie-breaker: the next few intervals), so the cache manager keeps the
    drafts that are about to pay off resident under the same memory limit as MemSpec."""
    length = min(len(t) for t in tables.values())

    def plan(view: SchedView) -> Mapping[str, float] | None:
        pos = position()
        if pos >= length:
            return None
        usable = {d: t for d, t in tables.items() if d in view.drafts}
        scores = interval_utility(usable, pos, gamma, interval)
        # exact ties keep what is already there: a switch or a load buys nothing
        return {d: s + (2e-9 if d == view.active else 1e-9 if d in view.resident else 0.0)
                for d, s in scores.items()}

    return plan


def make_plan(policy: str, tables: Mapping[str, Table], gamma: int, interval: int,
              position: Callable[[], int]) -> OraclePlan | None:
    """The plan an oracle policy needs (None for every other policy)."""
    if policy == "oracle-static":
        return static_plan(tables, gamma)
    if policy == "oracle-dynamic":
        return dynamic_plan(tables, gamma, interval, position)
    return None
