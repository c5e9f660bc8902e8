"""The test set read once: every `memspec bench --split test2` is counted before it
measures anything, a result says how many runs read its set, and the committed count
stays at one (a second read needs a new test set, not a second look)."""

from __future__ import annotations

import json

from memspec.bench import heldout
from memspec.bench.report import _get, check, held_out
from memspec.zoo.prompts import READ_ONCE, load_prompts


def test_a_read_is_counted_before_any_figure(tmp_path):
    prov = {"commit": "a" * 40, "clean": True, "machine": "cpu", "isa": "avx2"}
    assert heldout.record_read("test", prov, tmp_path) is None  # a second dev set: uncounted
    assert not heldout.ledger_path("test", tmp_path).exists()
    assert heldout.record_read("test2", prov, tmp_path) == 1
    assert heldout.record_read("test2", {**prov, "clean": False}, tmp_path) == 2
    rows = heldout.reads("test2", tmp_path)
    assert [r["clean"] for r in rows] == [True, False] and rows[0]["commit"] == "a" * 40


def test_the_committed_test2_was_read_at_most_once():
    rows = heldout.reads("test2")
    assert len(rows) <= 1, ("test2 has been read by more than one `memspec bench` run: it is "
                            "no longer held out; build a new test set", rows)
    assert all(r.get("commit") for r in rows)
    assert READ_ONCE == ("test2",) and load_prompts("test2")


def test_a_result_on_test2_reads_and_labels_its_own_set():
    r = {"held_out": "test2", "held_out_reads": 1,
         "real": {"test2": {"gmean": {"memspec_over_target_only": 1.2},
                            "ci95": {"memspec_over_target_only": [1.1, 1.3]}}}}
    assert held_out(r) == "test2" and held_out({}) == "test"
    assert _get(r, ("real", "test", "gmean", "memspec_over_target_only")) == 1.2
    from memspec.bench.report import MUST_HOLD

    row = next(b for b in MUST_HOLD if b.label.startswith("#11 test: memspec / target-only"))
    got = check(row, r)
    assert got.label.startswith("#11 test2: ") and got.value == 1.2 and got.ci == [1.1, 1.3]
    old = json.loads(json.dumps({**r, "held_out": None, "real": {"test": r["real"]["test2"]}}))
    assert check(row, old).value == 1.2  # a result from before test2 reads as it did
