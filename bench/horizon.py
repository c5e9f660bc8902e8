"""`memspec bench horizon --pool P`: the pool's ranking horizon, chosen on dev by real runs.

A ranking (the predictor's encoding, the load it sets off, the first look at the draft it
ranks first) pays only if what the right draft gains per token, times the tokens still to
come, outweighs it. What a right draft gains depends on how much the pool's drafts differ
(the heads: ~2% on their own domains; the datastores: 8-25%), so a pool sets its own
`rank_horizon` (tokens still to come for a ranking to be asked for, the prompt's included).

Each setting runs on its own warm `memspec up` (a copy of the pool with that horizon; no
setting learns from another's requests), beside target-only, lookup-only and general-static
on theirs, every dev prompt's variants back to back in an alternating order; per variant the
end-to-end speed over target-only (geometric mean, its 95% interval, the worst prompt).
The chosen horizon scores most with no prompt below FLOOR of target-only (ties: the larger
horizon, fewer rankings); dev2 and test2 prompts are never read.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from memspec.bench.realruns import pool_copy
from memspec.bench.realsweep import FLOOR, Setting, choose_setting, dev_rows, run_settings
from memspec.common.errors import ConfigError
from memspec.common.machine import machine_info, machine_line
from memspec.common.plotting import save_outputs

NEVER = 10**6  # no ranking at all: the general draft (what memspec runs before any ranking)
GRID = (0, 64, 128, NEVER)  # seven servers in all (~1.5 GB each)
BASELINES = ("target-only", "lookup-only", "general-static")


def _log(msg: str) -> None:
    print(f"[bench horizon] {msg}", file=sys.stderr, flush=True)


def variant(h: int) -> str:
    return f"memspec@{'never' if h >= NEVER else h}"


def pool_with_horizon(pool_path: str, horizon: int, out: Path) -> str:
    """A copy of the pool with `rank_horizon` set (its drafts and head unchanged)."""
    return pool_copy(pool_path, out, {"rank_horizon": str(horizon)})


def run(pool: str, per_domain: int, max_new: int, repeats: int,
        grid: tuple[int, ...] = GRID) -> dict[str, Any]:
    rows = dev_rows(per_domain)
    with tempfile.TemporaryDirectory(prefix="memspec-horizon-") as tmp:
        settings = {p: Setting(p, pool) for p in BASELINES}
        for h in grid:
            copy = pool_with_horizon(pool, h, Path(tmp) / f"pool-{h}.toml")
            settings[variant(h)] = Setting("memspec", copy)
        res = run_settings(settings, rows, max_new, repeats, _log)
    chosen = choose({h: res["summary"][variant(h)] for h in grid})
    return {"machine": machine_line(), "machine_info": machine_info(), "pool": pool,
            "split": "dev", "prompts": len(rows), "max_new_tokens": max_new,
            "repeats": repeats, "grid": list(grid), "floor": FLOOR, **res, "chosen": chosen}


def choose(by_h: dict[int, dict[str, Any]]) -> int:
    """The horizon with the highest geometric mean over target-only and no prompt below
    FLOOR (else the highest of all); ties within 0.1% go to the larger horizon."""
    return choose_setting(by_h, prefer=lambda h: h)


def _print(res: dict[str, Any]) -> None:
    print(f"machine: {res['machine']}; {res['prompts']} dev prompts x {res['max_new_tokens']} "
          f"tokens x {res['repeats']} repeats; pool {res['pool']}")
    for v, s in res["summary"].items():
        lo, hi = s["ci95"]
        print(f"  {v:18s} / target-only e2e {s['gmean']:.3f} [{lo:.3f}, {hi:.3f}] worst "
              f"{s['min']:.3f}; {s['snapshots_per_request']:.1f} snapshots a request, mean "
              f"accepted length {s['mean_acceptance_length']:.2f}")
    h = res["chosen"]
    print(f"chosen: rank_horizon = {h} (set it in [pool] of {res['pool']}); identical tokens "
          f"{res['identical_tokens']}")


def _plot(res: dict[str, Any], folder: Path) -> Path:
    from memspec.common.plotting import pyplot

    plt = pyplot()
    names = list(res["summary"])
    g = [res["summary"][v]["gmean"] for v in names]
    lo = [gi - res["summary"][v]["ci95"][0] for v, gi in zip(names, g)]
    hi = [res["summary"][v]["ci95"][1] - gi for v, gi in zip(names, g)]
    fig, ax = plt.subplots(figsize=(7.2, 3.8))
    colors = ["#888888" if not v.startswith("memspec") else
              ("#2a7" if v == variant(res["chosen"]) else "#48c") for v in names]
    ax.bar(range(len(names)), g, yerr=[lo, hi], color=colors, capsize=3)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=25, ha="right")
    ax.set_ylabel("end to end / target-only (gmean, 95% CI)")
    ax.set_ylim(min(0.8, min(g) - 0.05), max(gi + h for gi, h in zip(g, hi)) + 0.03)
    ax.set_title(f"Ranking horizon on dev: {Path(res['pool']).name}\n{res['machine']}",
                 fontsize=8)
    fig.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"horizon_{Path(res['pool']).stem}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main_bench_horizon(args) -> int:  # noqa: ANN001
    if not args.pool:
        raise ConfigError("bench horizon needs the pool whose horizon it chooses",
                          "pass --pool <pool.toml>")
    res = run(args.pool, args.per_domain, args.max_new_tokens, max(1, args.repeats))
    _print(res)
    save_outputs(res, args, _plot)
    return 0
