"""`memspec bench tune`'s head_vocab section: how many rows of its draft vocabulary a head
scores (``head.VOCAB``), chosen on dev by real runs.

The LM rows are most of a head step's work (16,384 rows of the target's LM head against
one layer), and a draft vocabulary is frequency-ranked, so its first rows are the tokens a
head gets right most often; the context lookup still proposes tokens past the cut (a head
embeds any target id). Each setting runs memspec on its own warm server (a scratch
tuned.json; bench/realsweep.py) beside target-only and general-static with the cut, every
dev prompt's variants back to back. The chosen cut scores most for memspec over target-only
with no prompt below the floor; ties go to the fuller vocabulary.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from memspec.bench.realsweep import FLOOR, Setting, choose_setting, dev_rows, run_settings
from memspec.bench.tune_lookup_gate import _brief, tuned_with
from memspec.common.tuned import TUNED_ENV, tuned_path

ROWS = (None, 8192, 4096, 2048, 1024)  # None: every row the head was trained with


def _log(msg: str) -> None:
    print(f"[bench tune] head vocab: {msg}", file=sys.stderr, flush=True)


def variant(rows: int | None) -> str:
    return "memspec@all-rows" if rows is None else f"memspec@{rows}-rows"


def static_variant(rows: int | None) -> str:
    return "general-static@all-rows" if rows is None else f"general-static@{rows}-rows"


def tune_head_vocab(pool_file: Path, per_domain: int, max_new: int, repeats: int
                    ) -> dict[str, Any]:
    base = json.loads(tuned_path().read_text())
    rows = dev_rows(per_domain)
    with tempfile.TemporaryDirectory(prefix="memspec-tune-") as tmp:
        settings = {"target-only": Setting("target-only", str(pool_file))}
        for n in ROWS:
            path = tuned_with(base, {"head.VOCAB": n}, Path(tmp) / f"rows{n}.json")
            env = {TUNED_ENV: str(path)}
            settings[variant(n)] = Setting("memspec", str(pool_file), env)
            settings[static_variant(n)] = Setting("general-static", str(pool_file), env)
        res = run_settings(settings, rows, max_new, repeats, _log)
    summary = res["summary"]
    best = choose_setting({n: summary[variant(n)] for n in ROWS},
                          prefer=lambda n: n or 1 << 30)
    fig = summary[variant(best)]
    _log(f"chosen head.VOCAB = {best} (memspec / target-only {fig['gmean']:.3f}, worst prompt "
         f"{fig['min']:.3f})")
    return {"grid": {"VOCAB": list(ROWS)},
            "rows": [{"value": n, "variant": variant(n), **_brief(summary[variant(n)]),
                      "general_static": _brief(summary[static_variant(n)])} for n in ROWS],
            "chosen": best, "figure": _brief(fig), "floor": FLOOR, "prompts": len(rows),
            "repeats": repeats, "identical_tokens": res["identical_tokens"]}
