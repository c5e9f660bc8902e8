"""The decoder's authoritative slot table: which draft each slot holds, and in what state.

Generations make completions idempotent: every eviction, cancel or new load bumps the
slot's generation, so a ``Loaded`` for an older generation (a stale or cancelled load, or
one from a loader that has since restarted) is recognised and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class SlotState(str, Enum):
    FREE = "free"
    LOADING = "loading"
    RESIDENT = "resident"


@dataclass
class Slot:
    index: int
    generation: int = 0
    state: SlotState = SlotState.FREE
    draft: str | None = None

    def as_dict(self) -> dict:
        return {"slot": self.index, "generation": self.generation, "state": self.state.value,
                "draft": self.draft}


@dataclass
class SlotTable:
    slots: list[Slot]
    failed: dict[str, str] = field(default_factory=dict)  # quarantined draft -> reason

    @classmethod
    def create(cls, k: int) -> SlotTable:
        return cls([Slot(i) for i in range(k)])

    def where(self, draft: str) -> Slot | None:
        return next((s for s in self.slots if s.draft == draft and s.state != SlotState.FREE),
                    None)

    def in_state(self, state: SlotState) -> frozenset[str]:
        return frozenset(s.draft for s in self.slots if s.state == state and s.draft)

    @property
    def resident(self) -> frozenset[str]:
        return self.in_state(SlotState.RESIDENT)

    @property
    def loading(self) -> frozenset[str]:
        return self.in_state(SlotState.LOADING)

    def begin_load(self, draft: str) -> Slot | None:
        """Claim a free slot for ``draft``; None when every slot is taken."""
        slot = next((s for s in self.slots if s.state == SlotState.FREE), None)
        if slot is not None:
            slot.generation += 1
            slot.state, slot.draft = SlotState.LOADING, draft
        return slot

    def release(self, slot: Slot) -> None:
        """Evict or cancel: the bytes become garbage and any completion in flight is stale."""
        slot.generation += 1
        slot.state, slot.draft = SlotState.FREE, None

    def complete(self, index: int, generation: int, draft: str) -> Slot | None:
        """The slot a ``Loaded`` refers to, if it is current; None for a stale completion."""
        if not 0 <= index < len(self.slots):
            return None
        slot = self.slots[index]
        if slot.generation != generation or slot.state != SlotState.LOADING or slot.draft != draft:
            return None
        slot.state = SlotState.RESIDENT
        return slot

    def fail(self, index: int, generation: int, draft: str, reason: str) -> Slot | None:
        if not 0 <= index < len(self.slots):
            return None
        slot = self.slots[index]
        if slot.generation != generation or slot.state != SlotState.LOADING:
            return None
        if reason != "cancelled":
            self.failed[draft] = reason
        self.release(slot)
        return slot
