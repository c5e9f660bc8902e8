"""The loader as the simulator models it: one load at a time, in issue order.

A load starts when the loader is free (or when it is issued, if later) and takes its
measured seconds; a cancel frees the loader at once. The replay simulator plays the loader
with it, and the cost-model fit rebuilds with it when the real loader was busy.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass
class _Load:
    key: Hashable
    issued: float
    seconds: float
    start: float = 0.0
    done: float = 0.0
    planned: bool = False


@dataclass
class LoadQueue:
    free_at: float = 0.0
    queue: list[_Load] = field(default_factory=list)

    def issue(self, key: Hashable, t: float, seconds: float) -> None:
        self.queue.append(_Load(key, t, seconds))
        self._plan(t)

    def _plan(self, now: float) -> None:
        free = self.free_at
        for ld in self.queue:
            if ld.planned and ld.start <= now:  # already running (or done): keeps its times
                free = ld.done
                continue
            ld.start = max(free, ld.issued)
            ld.done = ld.start + ld.seconds
            ld.planned = True
            free = ld.done

    def cancel(self, key: Hashable, t: float) -> bool:
        """Drop a queued load, or stop the running one (the loader is free at `t`)."""
        for ld in self.queue:
            if ld.key == key:
                if ld.start <= t < ld.done:
                    self.free_at = t
                self.queue.remove(ld)
                self._plan(t)
                return True
        return False

    def finished(self, t: float) -> list[tuple[Hashable, float, float]]:
        """(key, done time, seconds) of every load done by `t`, in completion order; they
        leave the queue."""
        done = sorted((ld for ld in self.queue if ld.done <= t), key=lambda ld: ld.done)
        for ld in done:
            self.queue.remove(ld)
            self.free_at = max(self.free_at, ld.done)
        return [(ld.key, ld.done, ld.seconds) for ld in done]

    def next_done(self) -> float | None:
        return min((ld.done for ld in self.queue), default=None)

    def busy(self, t: float) -> bool:
        return any(ld.start <= t < ld.done for ld in self.queue)

    def windows(self) -> list[tuple[float, float]]:
        """(start, end) of every load still in the queue."""
        return [(ld.start, ld.done) for ld in self.queue]
