"""Slot generations make load completions idempotent: stale or cancelled loads never land."""

from __future__ import annotations

from memspec.procs.decoder.sched.residency import SlotState, SlotTable


def test_stale_completion_is_ignored():
    t = SlotTable.create(2)
    slot = t.begin_load("code")
    gen = slot.generation
    t.release(slot)  # evicted / cancelled while the loader was still writing
    again = t.begin_load("math")
    assert again.index == slot.index and again.generation > gen
    assert t.complete(slot.index, gen, "code") is None  # old generation: ignored
    assert t.complete(slot.index, gen, "math") is None  # right draft name, stale generation
    assert t.complete(again.index, again.generation, "math") is again
    assert t.resident == {"math"}


def test_cancelled_load_never_becomes_resident():
    t = SlotTable.create(1)
    slot = t.begin_load("law")
    gen = slot.generation
    assert t.fail(slot.index, gen, "law", "cancelled") is slot
    assert slot.state == SlotState.FREE and "law" not in t.failed
    assert t.complete(slot.index, gen, "law") is None
    assert t.resident == frozenset()


def test_failed_load_quarantines_and_frees_the_slot():
    t = SlotTable.create(1)
    slot = t.begin_load("medical")
    assert t.fail(slot.index, slot.generation, "medical", "checksum mismatch") is slot
    assert t.failed == {"medical": "checksum mismatch"}
    assert t.begin_load("general") is not None  # the slot is usable again


def test_full_table_and_bad_indices():
    t = SlotTable.create(1)
    assert t.begin_load("a") is not None
    assert t.begin_load("b") is None
    assert t.complete(7, 1, "a") is None and t.fail(-1, 1, "a", "x") is None
