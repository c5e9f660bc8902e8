"""The decoder's start-up, timed phase by phase: what a restart costs, and where.

A crashed decoder's requests wait for its restart, so the start-up is on the serving path.
The phases go out in `Ready.info.startup` (the supervisor shows them in `memspec status`
and `memspec bench faults` reports them); "process" is the interpreter's start and the
imports, counted from the supervisor's spawn (`common/child.py: SPAWNED_ENV`).
"""

from __future__ import annotations

import os
import time

from memspec.common.child import SPAWNED_ENV


class StartupClock:
    def __init__(self) -> None:
        self.split: dict[str, float] = {}
        self._t = time.monotonic()
        try:
            spawned = float(os.environ.get(SPAWNED_ENV, ""))
        except ValueError:
            spawned = None  # run by hand: no spawn time to count from
        if spawned is not None and 0 <= self._t - spawned < 3600:
            self.split["process"] = round(self._t - spawned, 4)

    def mark(self, phase: str) -> None:
        """The time since the previous mark was spent on `phase`."""
        now = time.monotonic()
        self.split[phase] = round(self.split.get(phase, 0.0) + now - self._t, 4)
        self._t = now

    @property
    def total(self) -> float:
        return sum(self.split.values())

    def line(self) -> str:
        return ", ".join(f"{k} {v:.2f}s" for k, v in self.split.items())
