"""How many CPU threads the decoder's forwards use in the three-process pipeline.

The decoder shares the machine with the predictor and the loader. A decoder spreading
OpenMP work over every core stalls at each kernel's barrier whenever a helper holds one of
them (measured on 2 cores: decode iterations 4.5x slower while the predictor encodes), and
passive OpenMP waiting instead halves decode speed. But most of the time neither helper has
anything to do (target-only requests, a closed speculation gate, rankings spaced out, no
load in flight), and then a decoder on one core of two leaves half the machine idle.

So the threads follow the work: the scheduling loop tells the decoder before every
interval (and prefill chunk) whether a helper is busy (a snapshot not yet answered, a load
in flight), and the decoder runs on every core when none is, and leaves them one core when
one is. Switching costs ~0.1 us. ``MEMSPEC_DECODER_THREADS=N`` fixes the count instead.
"""

from __future__ import annotations

import os

import torch

from memspec.common.errors import ConfigError

ENV = "MEMSPEC_DECODER_THREADS"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def decoder_threads() -> tuple[int, int]:
    """(threads with the helpers idle, threads while one works): every usable core, and
    every core but one; `MEMSPEC_DECODER_THREADS` fixes both."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        cores = usable_cores()
        return cores, max(1, cores - 1)
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"{ENV}={raw!r} is not a positive integer",
                          f"set {ENV} to a thread count such as 1, or unset it")
    return n, n


class ThreadPlan:
    """The loop's `on_helpers` hook: every core while the helpers rest, one fewer while
    one of them works; never more than the running request's cap (`Submit.threads`)."""

    def __init__(self, idle: int, shared: int) -> None:
        self.idle, self.shared = idle, shared
        self.current = 0
        self.switches = 0
        self.cap: int | None = None
        self.busy = False

    def limit(self, cap: int | None) -> None:
        """A request's cap, applied at once (its prefill may start before the loop asks)."""
        self.cap = cap
        self(self.busy)

    def __call__(self, helpers_busy: bool) -> None:
        self.busy = helpers_busy
        n = self.shared if helpers_busy else self.idle
        if self.cap is not None:
            n = min(n, self.cap)
        if n != self.current:
            torch.set_num_threads(n)
            self.current = n
            self.switches += 1
