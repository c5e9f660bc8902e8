"""`memspec bench tune`'s gate section, checked by real runs before it is kept.

The gate's constants are swept in the simulator (bench/gate_sweep.py) over the dev traces.
On the Sapphire Rapids Xeon that sweep chose a gate which, run for real, kept the general
head closed on the README prompt and cost memspec 5% (fb6b9f0, undone), and twice before
its choice lost on real runs: the simulator does not predict this pool's gate. So the
simulated choice goes up against the committed constants on dev, each on its own warm
server (a scratch tuned.json; bench/realsweep.py) beside target-only, and it replaces them
only where the real runs prefer it; ties keep the committed constants.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memspec.bench.realsweep import Setting, choose_setting, dev_rows, run_settings
from memspec.bench.tune_lookup_gate import brief, tuned_with
from memspec.common.tuned import TUNED_ENV, tuned_path

SIMULATED, COMMITTED = "memspec@simulated", "memspec@committed"


def _log(msg: str) -> None:
    print(f"[bench tune] gate check: {msg}", file=sys.stderr, flush=True)


def committed_gate(names: list[str], base: Mapping[str, Any]) -> dict[str, Any]:
    """The committed tuned.json's values of the gate constants `names`."""
    return {k: base["knobs"][f"gate.{k}"]["value"] for k in names}


def check_gate(pool_file: Path, per_domain: int, max_new: int, repeats: int,
               simulated: Mapping[str, Any]) -> dict[str, Any]:
    """The gate section (`simulated`: bench/tune.py's tune_gate) with the constants real
    runs on dev prefer: the simulated choice or the committed one, and both figures."""
    base = json.loads(tuned_path().read_text())
    sim = dict(simulated["chosen"])
    now = committed_gate(list(sim), base)
    out = {**simulated, "simulated_choice": sim, "committed": now}
    if sim == now:
        _log("the simulator keeps the committed constants; nothing to run")
        return {**out, "real_check": None}
    rows = dev_rows(per_domain)
    with tempfile.TemporaryDirectory(prefix="memspec-tune-") as tmp:
        path = tuned_with(base, {f"gate.{k}": v for k, v in sim.items()},
                          Path(tmp) / "tuned-simulated-gate.json")
        settings = {"target-only": Setting("target-only", str(pool_file)),
                    COMMITTED: Setting("memspec", str(pool_file)),
                    SIMULATED: Setting("memspec", str(pool_file), {TUNED_ENV: str(path)})}
        res = run_settings(settings, rows, max_new, repeats, _log)
    summary = res["summary"]
    best = choose_setting({v: summary[v] for v in (SIMULATED, COMMITTED)},
                          prefer=lambda v: v == COMMITTED)
    chosen = sim if best == SIMULATED else now
    _log(f"kept the {best.split('@')[1]} constants (memspec / target-only: simulated "
         f"{summary[SIMULATED]['gmean']:.3f}, committed {summary[COMMITTED]['gmean']:.3f})")
    return {**out, "chosen": chosen,
            "real_check": {"kept": best.split("@")[1], "prompts": len(rows),
                           "repeats": repeats, "figure": brief(summary[best]),
                           "simulated": brief(summary[SIMULATED]),
                           "committed": brief(summary[COMMITTED]),
                           "identical_tokens": res["identical_tokens"]}}


def gate_dev_figure(section: Mapping[str, Any]) -> str:
    """tuned.json's `dev` line for the gate's constants: the real check's where it ran."""
    chk = section.get("real_check")
    fig = section["figure"]
    sim = (f"simulated: memspec / target-only e2e {fig['over_scales']:.3f} over the scales "
           f"(worst mean {fig['worst_gmean']:.3f}, worst prompt {fig['worst_prompt']:.3f})")
    if not chk:
        return sim
    f = chk["figure"]
    return (f"real runs kept the {chk['kept']} constants: memspec / target-only e2e "
            f"{f['gmean']:.3f} [{f['ci95'][0]:.3f}, {f['ci95'][1]:.3f}], worst prompt "
            f"{f['min']:.3f} ({chk['prompts']} prompts x {chk['repeats']}; simulated "
            f"{chk['simulated']['gmean']:.3f}, committed {chk['committed']['gmean']:.3f}); "
            f"the simulator's choice {sim}")
