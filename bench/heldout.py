"""Who has read the test set that is read once: a committed ledger of `memspec bench` runs.

A held-out figure is only held out while no choice has been made by looking at it. The
old test split lost that (many runs, one change kept or reverted by its figure) and is
named for what it is now, ``dev2``, a second dev set; ``test2`` comes with a ledger: every
`memspec bench --split test2` adds a line *before* it computes anything (a run that fails
half way has still read the set), and its JSON says how many runs read the set, itself
included. The file is committed with the result, so the next session sees the count;
tests/test_heldout.py keeps it at one run.

Results written before the rename call dev2 "test"; `current_names` reads them in today's
names, so the reports and figures of a committed result keep working unchanged.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from memspec.zoo.prompts import PROMPTS_DIR, READ_ONCE, split_name

LEDGER_NAME = "{split}_reads.jsonl"
# a `memspec bench` result's sections keyed by prompt set (report.py BY_SET, and Table 2)
SET_SECTIONS = ("real", "sim", "sim_vs_real", "predictor")


def ledger_path(split: str, prompts_dir: Path = PROMPTS_DIR) -> Path:
    return Path(prompts_dir) / LEDGER_NAME.format(split=split)


def reads(split: str, prompts_dir: Path = PROMPTS_DIR) -> list[dict[str, Any]]:
    """The runs that read `split` so far, oldest first."""
    path = ledger_path(split, prompts_dir)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def record_read(split: str, prov: dict[str, Any], prompts_dir: Path = PROMPTS_DIR
                ) -> int | None:
    """Add this run to `split`'s ledger (read-once sets only) and return how many runs
    have read it, this one included; None for a set nobody counts."""
    if split not in READ_ONCE:
        return None
    row = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "commit": prov.get("commit"), "clean": prov.get("clean"),
           "machine": prov.get("machine"), "isa": prov.get("isa")}
    path = ledger_path(split, prompts_dir)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    return len(reads(split, prompts_dir))


def current_names(result: dict[str, Any]) -> dict[str, Any]:
    """`result` (a `memspec bench` JSON) in today's set names, the one alias for old
    results: one from before the rename keys dev2's sections "test", and one from before
    test2 has no "held_out" (its figures were of the then test set, dev2 now). A current
    result comes back equal. The committed JSONs stay as they were written."""
    out = {**result, "held_out": split_name(result.get("held_out") or "test")}
    for key in SET_SECTIONS:
        if isinstance(result.get(key), dict):
            out[key] = {split_name(k): v for k, v in result[key].items()}
    split = result.get("split")  # split_info: counts, shared sources per pair, sets measured
    if isinstance(split, dict):
        out["split"] = sp = dict(split)
        if isinstance(split.get("counts"), dict):
            sp["counts"] = {split_name(k): v for k, v in split["counts"].items()}
        if isinstance(split.get("shared_sources"), dict):
            sp["shared_sources"] = {"/".join(map(split_name, k.split("/"))): v
                                    for k, v in split["shared_sources"].items()}
        if isinstance(split.get("measured_on"), list):
            sp["measured_on"] = [split_name(s) for s in split["measured_on"]]
    return out
