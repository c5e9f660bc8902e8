"""Read the committed prompt sets (prompts/{train,dev,dev2,mixed,test2}.jsonl).

``train`` trains drafts and the predictor, ``dev`` tunes every knob, ``dev2`` (the old
``test`` split, read by many bench runs: a second dev set) is what ``memspec zoo eval
--split dev2`` and ``memspec bench`` measure, ``mixed`` (answers that cross domains) is
built from dev2 sources only, ``test2`` is read once. The sets are disjoint by source (see
:mod:`memspec.zoo.splits`); rows keep the file's order, which spreads each domain over
its sources, so the first ``per_domain`` rows are a fair sample.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from memspec.common.errors import ConfigError
from memspec.common.paths import PACKAGE_ROOT

DOMAINS = ("general", "code", "math", "law", "medical")  # the corpora's, in table order

PROMPTS_DIR = PACKAGE_ROOT / "prompts"
SPLITS = ("train", "dev", "dev2", "mixed", "test2")
# dev2 was called "test" until many bench runs had read it (it stopped being held out):
# results, tables and predictor sidecars written before say "test" for it (`split_name`)
OLD_NAMES = {"test": "dev2"}
# read once, by one round's headline `memspec bench --split test2` (bench/heldout.py
# counts its readers); nothing reads such a set by default
READ_ONCE = ("test2",)


def split_name(name: str) -> str:
    """A set's name today: what an older file calls "test" is dev2 (the same prompts)."""
    return OLD_NAMES.get(name, name)


def split_path(split: str, prompts_dir: Path = PROMPTS_DIR) -> Path:
    if split not in SPLITS:
        raise ConfigError(f"unknown prompt split '{split}'"
                          + (f" (now called {OLD_NAMES[split]})" if split in OLD_NAMES else ""),
                          f"use one of {', '.join(SPLITS)}")
    return Path(prompts_dir) / f"{split}.jsonl"


def load_prompts(split: str, domains: Sequence[str] | None = None,
                 per_domain: int | None = None, prompts_dir: Path = PROMPTS_DIR) -> list[dict]:
    """Rows of one split, optionally only some domains and the first ``per_domain`` of each.

    ``mixed`` is one workload whatever the pool: ``domains`` does not filter it, and its
    rows count as domain "mixed" for ``per_domain``.
    """
    path = split_path(split, prompts_dir)
    if not path.is_file():
        raise ConfigError(f"prompt file {path} missing", "run `memspec zoo corpora --prompts`")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()]
    if domains is not None and split != "mixed":
        unknown = set(domains) - {r["domain"] for r in rows}
        if unknown:
            raise ConfigError(f"no {split} prompts for domain(s) {', '.join(sorted(unknown))}",
                              "set each draft's domain to one of general, code, math, law, "
                              "medical")
        rows = [r for r in rows if r["domain"] in domains]
        rows.sort(key=lambda r: list(domains).index(r["domain"]))  # stable: file order kept
    if per_domain:
        taken: Counter = Counter()
        kept = []
        for r in rows:
            if taken[r["domain"]] < per_domain:
                taken[r["domain"]] += 1
                kept.append(r)
        rows = kept
    return rows


def row_sources(row: dict) -> list[str]:
    """Every source a row draws on (mixed rows list several)."""
    src = row["source"]
    return list(src) if isinstance(src, list) else [src]
