"""Token bucket for the ``edge-emulated`` storage profile.

The loader still does the real reads; the bucket only stretches them to the bandwidth of
the emulated device, so draft load time / SD iteration time matches that device (paper:
~2.7 on a Jetson Orin Nano). The bucket starts empty so a load of N bytes at B bytes/s
takes at least about N/B, with no free initial burst.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    """``rate`` bytes/s, holding at most ``burst`` bytes of credit."""

    def __init__(self, rate: float, burst: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("rate and burst must be positive")
        self.rate = float(rate)
        self.burst = float(burst)
        self._clock = clock
        self._tokens = 0.0
        self._last = clock()

    def reserve(self, n: int) -> float:
        """Spend ``n`` bytes (credit may go negative); return the seconds to wait."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= n
        return max(0.0, -self._tokens / self.rate)
