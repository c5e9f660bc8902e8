"""How many CPU threads the decoder's forwards use in the three-process pipeline.

The predictor and loader each run one thread, and under memspec the predictor is busy most
of the time (a snapshot every N iterations costs about as long as N iterations on 2 cores).
A decoder spreading OpenMP work over every core then stalls at each kernel's barrier whenever
a helper holds one of them (measured on 2 cores: decode iterations 4.5x slower while the
helpers are busy), and passive OpenMP waiting instead halves decode speed. So the decoder
takes every core but one, and spins briefly between kernels as OpenMP does by default.
"""

from __future__ import annotations

import os

from memspec.common.errors import ConfigError

ENV = "MEMSPEC_DECODER_THREADS"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def decoder_threads() -> int:
    """`MEMSPEC_DECODER_THREADS`, else every usable core but one (at least one)."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return max(1, usable_cores() - 1)
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"{ENV}={raw!r} is not a positive integer",
                          f"set {ENV} to a thread count such as 1, or unset it")
    return n
