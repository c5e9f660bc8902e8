"""The README's results table: every row names its JSON, the commit and kernel path it was
measured on, and its bold figures are in that JSON (a figure no file holds, or a file of
another commit, is a claim nobody can check)."""

from __future__ import annotations

import json
import re
from typing import Any

from memspec.bench.results_index import NOT_RECORDED, describe
from memspec.common.isa import ISAS
from memspec.common.paths import PACKAGE_ROOT

CITED = re.compile(r"docs/results/[A-Za-z0-9_.-]+\.json")
BOLD = re.compile(r"\*\*(-?\d+(?:\.\d+)?)")


def _rows() -> list[str]:
    text = (PACKAGE_ROOT / "README.md").read_text()
    block = text.split("\n## Results\n", 1)[1].split("\n\n| what |", 1)[1]
    table = ("| what |" + block).split("\n\n", 1)[0]
    return [ln for ln in table.splitlines()[2:] if ln.startswith("|")]


def _numbers(x: Any) -> list[float]:
    if isinstance(x, bool):
        return []
    if isinstance(x, (int, float)):
        return [float(x)]
    if isinstance(x, dict):
        return [v for y in x.values() for v in _numbers(y)]
    if isinstance(x, list):
        return [v for y in x for v in _numbers(y)]
    return []


def test_every_results_row_names_its_json_commit_and_isa_and_holds_its_figures():
    rows = _rows()
    assert len(rows) >= 10, "the README's results table was not found"
    for row in rows:
        cited = CITED.findall(row)
        assert cited, f"a results row names no JSON: {row[:80]}"
        results = {}
        for rel in cited:
            path = PACKAGE_ROOT / rel
            assert path.is_file(), f"{rel} (cited in the README) does not exist"
            results[rel] = json.loads(path.read_text())
        named_isas = {i for i in ISAS if re.search(rf"(?<![\w-]){re.escape(i)}(?![\w-])", row)}
        assert named_isas, f"a results row names no kernel path: {row[:80]}"
        for rel, res in results.items():
            commit = (res.get("provenance") or {}).get("commit")
            if commit:
                assert f"at {commit[:7]}" in row, f"{rel} was measured at {commit[:7]}: " \
                                                  f"the row must say so ({row[:60]})"
            isa = describe(PACKAGE_ROOT / rel)["isa"]
            if isa != NOT_RECORDED:
                assert isa in named_isas, f"{rel} ran {isa}; the row names {named_isas}"
        values = [v for res in results.values() for v in _numbers(res)]
        for shown in BOLD.findall(row):
            places = len(shown.split(".")[1]) if "." in shown else 0
            want = float(shown)
            assert any(round(v, places) == want or round(v * 100, places) == want
                       for v in values), f"**{shown}** is in none of {cited}"
