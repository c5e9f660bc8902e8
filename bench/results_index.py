"""docs/results/README.md: every committed result JSON, what measured it and who reads it.

A figure in the docs is only as good as the file behind it, so each result says the code
(commit, clean tree), the machine and its kernel path; a file no document reads is a
figure nobody can check and is removed (tests/test_results_index.py keeps both true).
Older files predate `common/provenance.py` and say "not recorded" where they lack it.

    python3 -m memspec.bench.results_index > docs/results/README.md
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from memspec.common.paths import PACKAGE_ROOT

RESULTS_DIR = PACKAGE_ROOT / "docs" / "results"
INDEX = RESULTS_DIR / "README.md"
NOT_RECORDED = "not recorded"
# where a result may be read from: the docs, the knobs, the pools and the code
READER_GLOBS = ("README.md", "docs/**/*.md", "tuned.json", "pools/*.toml",
                *(f"{d}/**/*.py" for d in ("bench", "common", "launch", "procs", "sim", "tests",
                                           "zoo")))
# file-name prefix -> the command that writes such a file (longest prefix first)
COMMANDS = (("bench_avx512", "memspec bench"), ("bench.json", "memspec bench"),
            ("bench_engine_heads", "memspec bench engine --heads"),
            ("bench_", "memspec bench {0}"), ("zoo_eval", "memspec zoo eval"),
            ("costmodel", "memspec bench (its cost model)"),
            ("head_", "memspec zoo drafts"), ("horizon_stores", "memspec bench horizon"),
            ("stores_sources", "memspec zoo stores"),
            ("tune_lookup_depth", "memspec bench tune --only lookup_depth"),
            ("ab_", "old and new code alternating (its JSON says how)"))
_KERNELS = re.compile(r"\((\S+) kernels")


def command_of(name: str) -> str:
    for prefix, cmd in COMMANDS:
        if name.startswith(prefix):
            return cmd.format(name.removesuffix(".json").removeprefix("bench_").split("_")[0])
    return NOT_RECORDED


def _machine(res: dict[str, Any]) -> tuple[str, str]:
    """(machine, kernel path) as the file records them, wherever its bench put them."""
    prov = res.get("provenance") if isinstance(res.get("provenance"), dict) else {}
    machine: Any = prov.get("machine") or res.get("machine") or res.get("machine_info")
    isa = prov.get("isa")
    for m in (res.get("machine"), res.get("machine_info")):
        if isinstance(m, dict):
            isa = isa or m.get("isa")
    if isinstance(machine, dict):
        machine = machine.get("cpu") or machine.get("gpu")
    if isinstance(machine, str):
        found = _KERNELS.search(machine)
        isa = isa or (found.group(1).rstrip(",") if found else None)
        machine = machine.removeprefix("CPU ").split(" (")[0].split(",")[0]
    numerics = res.get("numerics")
    if not isa and isinstance(numerics, str) and "-" in numerics:
        isa = numerics.split("-", 1)[1]  # "int4-avx512-bf16": the kernel path it ran
    return (machine or NOT_RECORDED), (isa or NOT_RECORDED)


def describe(path: Path) -> dict[str, Any]:
    """One result file's row: its command, code, machine and kernel path."""
    res = json.loads(path.read_text())
    prov = res.get("provenance") if isinstance(res, dict) else None
    commit = NOT_RECORDED
    if isinstance(prov, dict) and prov.get("commit"):
        commit = prov["commit"][:7] + ("" if prov.get("clean") else " (tree not clean)")
    machine, isa = _machine(res) if isinstance(res, dict) else (NOT_RECORDED, NOT_RECORDED)
    return {"file": path.name, "command": command_of(path.name), "commit": commit,
            "machine": machine, "isa": isa}


def reader_texts(root: Path = PACKAGE_ROOT) -> dict[str, str]:
    """Every file that may cite a result, by its path in the checkout (not the index)."""
    out: dict[str, str] = {}
    for pattern in READER_GLOBS:
        for path in sorted(root.glob(pattern)):
            rel = str(path.relative_to(root))
            if path.resolve() not in (INDEX.resolve(), Path(__file__).resolve()) \
                    and path.is_file() \
                    and not rel.startswith("models/"):
                out[rel] = path.read_text(errors="replace")
    return out


def readers(name: str, texts: dict[str, str]) -> list[str]:
    return [rel for rel, text in texts.items() if name in text]


def render(root: Path = PACKAGE_ROOT) -> str:
    texts = reader_texts(root)
    lines = [
        "# Result files",
        "",
        "Every result JSON the documents cite: the command that wrote it, the code it measured",
        "(commit; \"tree not clean\" where it ran with uncommitted changes), the machine and",
        "the kernel path. Files written before results recorded their provenance say",
        f"\"{NOT_RECORDED}\": the text that cites them names the commit instead. Every file",
        "here is read by at least one document; one that none reads is removed.",
        "Regenerate with `python3 -m memspec.bench.results_index > docs/results/README.md`.",
        "",
        "| file | written by | code | machine | kernel path | read by |",
        "|---|---|---|---|---|---|",
    ]
    for path in sorted((root / "docs" / "results").glob("*.json")):
        row = describe(path)
        who = ", ".join(f"`{r}`" for r in readers(path.name, texts)) or "**nobody**"
        lines.append(f"| `{row['file']}` | `{row['command']}` | {row['commit']} | "
                     f"{row['machine']} | {row['isa']} | {who} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
