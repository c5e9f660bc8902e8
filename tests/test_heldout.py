"""The test set read once: every `memspec bench --split test2` is counted before it
measures anything, a result says how many runs read its set, and the committed count
stays at one (a second read needs a new test set, not a second look). dev2, the old test
split, is a second dev set: nobody counts its reads, and a result from before the rename
reads as dev2."""

from __future__ import annotations

import json

from memspec.bench import heldout
from memspec.bench.evaluation import HELD_OUT, Sizes
from memspec.bench.heldout import current_names
from memspec.bench.report import HELD, _get, check, held_out
from memspec.zoo.prompts import READ_ONCE, SPLITS, load_prompts, split_name, split_path


def test_a_read_is_counted_before_any_figure(tmp_path):
    prov = {"commit": "a" * 40, "clean": True, "machine": "cpu", "isa": "avx2"}
    assert heldout.record_read("dev2", prov, tmp_path) is None  # a second dev set: uncounted
    assert not heldout.ledger_path("dev2", tmp_path).exists()
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
    assert held_out(r) == "test2" and held_out({}) == "dev2" == HELD
    assert _get(r, ("real", HELD, "gmean", "memspec_over_target_only")) == 1.2
    from memspec.bench.report import MUST_HOLD

    row = next(b for b in MUST_HOLD if b.label.startswith("#11 dev2: memspec / target-only"))
    got = check(row, r)
    assert got.label.startswith("#11 test2: ") and got.value == 1.2 and got.ci == [1.1, 1.3]
    old = json.loads(json.dumps({**r, "held_out": None, "real": {"test": r["real"]["test2"]}}))
    got = check(row, old)  # a result from before test2 and the rename: its "test" is dev2
    assert got.value == 1.2 and got.label.startswith("#11 dev2: ")


def test_the_old_test_split_is_dev2_and_nothing_reads_test2_by_default():
    assert "test" not in SPLITS and split_name("test") == "dev2" and split_name("dev") == "dev"
    rows = load_prompts("dev2")
    assert rows and all(r["split"] == "dev2" and r["id"].startswith("dev2-") for r in rows)
    assert not split_path("dev2").with_name("test.jsonl").exists()
    assert Sizes().held_out == "dev2" and HELD_OUT == ("dev2", "test2")
    old = {"real": {"test": {"x": 1}, "mixed": {}}, "predictor": {"test": {}, "note": "n"},
           "split": {"measured_on": ["test", "mixed"], "counts": {"dev": 1, "test": 2}}}
    new = current_names(old)
    assert new["held_out"] == "dev2" and set(new["real"]) == {"dev2", "mixed"}
    assert set(new["predictor"]) == {"dev2", "note"} and new["split"]["counts"] == {"dev": 1,
                                                                                  "dev2": 2}
    assert new["split"]["measured_on"] == ["dev2", "mixed"] and "test" in old["real"]
    assert current_names(new) == new  # today's names come back as they are


def test_no_command_reads_test2_unless_it_is_named():
    from memspec.launch.cli import build_parser
    from memspec.zoo.evaluate import EVAL_SPLITS

    parse = build_parser().parse_args
    assert parse(["trace"]).sets.split(",") == ["train", "dev", "dev2", "mixed"]
    assert parse(["zoo", "eval"]).split == "dev" and "test2" not in EVAL_SPLITS
    # bench eval falls back to dev2 (main_bench), bench headline to dev
    assert parse(["bench", "eval"]).split is None and parse(["bench", "headline"]).split is None
    assert parse(["bench", "headline", "--split", "test2"]).split == "test2"
