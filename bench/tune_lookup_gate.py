"""`memspec bench tune`'s lookup_gate section: when the speculation gate judges the context
lookup, chosen on dev by real runs.

The lookup (procs/decoder/drafts/lookup.py) proposes only where the context repeats, and its
worth comes in bursts, so the gate lets it run unjudged for its first LOOKUP_LOOKS
proposals, unless after LOOKUP_FAILING's count it accepts under that floor. The simulator
has no table for the lookup run alone, so each setting runs on its own warm server (a
scratch tuned.json with the setting; bench/realsweep.py) beside target-only and
lookup-only, every dev prompt's variants back to back. The chosen setting scores most over
target-only with no prompt below the floor; ties go to the setting that judges soonest
(a lookup that does not pay then costs the fewest wide verifies).
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memspec.bench.realsweep import FLOOR, Setting, choose_setting, dev_rows, run_settings
from memspec.common.tuned import TUNED_ENV, tuned_path

LOOKS = (0, 8, 32, 128, 1_000_000)  # proposals the lookup runs unjudged (the last: never
# judged, its proposal lengths alone weigh what it costs: lookup_depth.py)
FAILING = (None, (8, 1.25))  # None: never gated early; else (after n proposals, under tau)
BASELINES = ("target-only", "lookup-only")


def _log(msg: str) -> None:
    print(f"[bench tune] lookup gate: {msg}", file=sys.stderr, flush=True)


def grid() -> list[tuple[int, tuple[int, float] | None]]:
    """(LOOKUP_LOOKS, LOOKUP_FAILING) pairs that differ in what they do: a failing check
    after n proposals acts only where the lookup runs unjudged past n."""
    return [(looks, fail) for looks in LOOKS for fail in FAILING
            if fail is None or fail[0] < looks]


def variant(looks: int, fail: tuple[int, float] | None) -> str:
    return f"memspec@{looks}" + ("" if fail is None else f"/{fail[0]}<{fail[1]}")


def tuned_with(base: Mapping[str, Any], values: Mapping[str, Any], out: Path) -> Path:
    """A copy of tuned.json whose knobs in `values` take those values."""
    data = json.loads(json.dumps(base))
    for name, value in values.items():
        data["knobs"][name] = {**data["knobs"].get(name, {}), "value": value}
    out.write_text(json.dumps(data))
    return out


def tune_lookup_gate(pool_file: Path, per_domain: int, max_new: int, repeats: int
                     ) -> dict[str, Any]:
    base = json.loads(tuned_path().read_text())
    rows = dev_rows(per_domain)
    pairs = grid()
    with tempfile.TemporaryDirectory(prefix="memspec-tune-") as tmp:
        settings = {p: Setting(p, str(pool_file)) for p in BASELINES}
        for i, (looks, fail) in enumerate(pairs):
            path = tuned_with(base, {"gate.LOOKUP_LOOKS": looks, "gate.LOOKUP_FAILING":
                                     None if fail is None else list(fail)},
                              Path(tmp) / f"tuned{i}.json")
            settings[variant(looks, fail)] = Setting("memspec", str(pool_file),
                                                     {TUNED_ENV: str(path)})
        res = run_settings(settings, rows, max_new, repeats, _log)
    summary = res["summary"]
    best = choose_setting({p: summary[variant(*p)] for p in pairs},
                          prefer=lambda p: (-p[0], p[1] is not None))
    fig = summary[variant(*best)]
    _log(f"chosen LOOKUP_LOOKS = {best[0]}, LOOKUP_FAILING = {best[1]} (memspec / target-only "
         f"{fig['gmean']:.3f}, worst prompt {fig['min']:.3f})")
    return {"grid": {"LOOKUP_LOOKS": list(LOOKS),
                     "LOOKUP_FAILING": [None if f is None else list(f) for f in FAILING]},
            "rows": [{"value": [looks, None if fail is None else list(fail)],
                      "variant": variant(looks, fail), **brief(summary[variant(looks, fail)])}
                     for looks, fail in pairs],
            "lookup_only": brief(summary["lookup-only"]),
            "chosen": [best[0], None if best[1] is None else list(best[1])],
            "figure": brief(fig), "floor": FLOOR, "prompts": len(rows), "repeats": repeats,
            "identical_tokens": res["identical_tokens"]}


def brief(s: Mapping[str, Any]) -> dict[str, Any]:
    return {"gmean": s["gmean"], "ci95": s["ci95"], "min": s["min"],
            "paired_gmean": s["paired_gmean"],
            "mean_acceptance_length": s["mean_acceptance_length"]}
