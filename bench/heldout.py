"""Who has read the test set that is read once: a committed ledger of `memspec bench` runs.

A held-out figure is only held out while no choice has been made by looking at it. The
old test split lost that (many runs, one change kept or reverted by its figure), so
``test2`` comes with a ledger: every `memspec bench --split test2` adds a line *before*
it computes anything (a run that fails half way has still read the set), and its JSON
says how many runs read the set, itself included. The file is committed with the result,
so the next session sees the count; tests/test_heldout.py keeps it at one run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from memspec.zoo.prompts import PROMPTS_DIR, READ_ONCE

LEDGER_NAME = "{split}_reads.jsonl"


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
