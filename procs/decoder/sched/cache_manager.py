"""Draft model cache manager: the paper's Algorithm 2 as a pure function.

The decoder's controller and the replay simulator call the very same code, so it knows
nothing of slots, sockets or time: it maps (scores, residency) to the loads and evictions
to issue now. Everything is deterministic; score ties are broken by draft name.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CacheActions:
    """What the caller issues now: evictions first (they free slots), then loads."""

    prefetch: tuple[str, ...] = ()  # drafts to start loading, in priority order
    evict: tuple[str, ...] = ()  # residents to evict first (frees their slot)
    cancel: tuple[str, ...] = ()  # in-flight loads no longer wanted (frees their slot)

    @property
    def empty(self) -> bool:
        return not (self.prefetch or self.evict or self.cancel)


NO_ACTIONS = CacheActions()


def score_of(scores: Mapping[str, float], draft: str) -> float:
    """Unscored (or NaN-scored) drafts rank below every scored one."""
    s = scores.get(draft)
    if s is None or math.isnan(s):
        return -math.inf
    return float(s)


def rank(scores: Mapping[str, float], names: Iterable[str] | None = None) -> tuple[str, ...]:
    """`names` (default: the scored drafts) best first; ties by name so every run agrees."""
    pool = scores.keys() if names is None else names
    return tuple(sorted(set(pool), key=lambda d: (-score_of(scores, d), d)))


def lowest(scores: Mapping[str, float], names: Iterable[str]) -> str | None:
    """The last of `names` in rank order: the first to evict; None when `names` is empty."""
    ranked = rank(scores, names)
    return ranked[-1] if ranked else None


def update_cache(
    scores: Mapping[str, float],
    resident: AbstractSet[str],
    loading: AbstractSet[str],
    capacity: int,
    active: str | None,
) -> CacheActions:
    """Steer residency toward W = top-K by score without ever blocking (Alg. 2).

    For each d in W (best first) that is neither resident nor loading: free a slot by
    evicting the lowest-scored resident outside W and not active; when none exists, stop;
    then prefetch d. Loads in flight occupy a slot (and are never cancelled here).
    """
    if capacity < 1:
        return NO_ACTIONS
    working = rank(scores)[:capacity]
    protected = set(working) | ({active} if active is not None else set())
    state = _Occupancy(set(resident), set(loading) - set(resident), capacity)
    prefetch: list[str] = []
    for draft in working:
        if draft in resident or draft in loading:
            continue
        if not state.make_room(scores, protected):
            break
        state.loading.add(draft)
        prefetch.append(draft)
    return CacheActions(tuple(prefetch), tuple(state.evicted))


@dataclass
class _Occupancy:
    """Slots as planned so far within one update: who stays, who is loading, who went."""

    resident: set[str]
    loading: set[str]
    capacity: int
    evicted: list[str] = field(default_factory=list)

    def make_room(self, scores: Mapping[str, float], protected: set[str]) -> bool:
        """Free slots until one is free; False when only protected drafts occupy them."""
        while len(self.resident) + len(self.loading) >= self.capacity:
            victim = lowest(scores, self.resident - protected)
            if victim is None:
                return False
            self.resident.discard(victim)
            self.evicted.append(victim)
        return True
