"""`memspec zoo curves`: each head's dev acceptance against its training time, from the
`training.json` that `memspec zoo drafts` writes beside every head. Is a longer training
budget still buying acceptance, or has it stopped paying?

A domain head is fine-tuned from the general head's chosen checkpoint, so its curve starts
where the general head's was chosen (its x axis continues the general head's time). A head
trained on from its own weights (`memspec zoo drafts --continue`) keeps the runs before in
its record; its curve shows them all on one clock. The
general head is scored on every domain's dev prompts, a domain head on its own domain's.
Each run's learning rate decays (cosine) to a tenth at the end of its own budget, so a
curve flattening at its end is partly that schedule: a longer budget is a longer schedule,
not these curves extended.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memspec.common.config import PoolConfig, load_pool
from memspec.common.errors import ConfigError


def run_points(rec: dict[str, Any]) -> tuple[list[tuple[float, float]], float]:
    """(training minutes, dev) of a record, the runs it continues (``continues``, written by
    ``--continue``) first, on one clock; and the record's training minutes in all."""
    before = rec.get("continues")
    points, offset = run_points(before) if before else ([], 0.0)
    own = [(offset + float(e["train_s"]) / 60, float(e["dev"])) for e in rec["evals"]]
    if rec.get("plan", {}).get("init_from") is None:  # from scratch: step 0 scores nothing
        own = [(m, v) for m, v in own if m > offset]
    wall_s = rec.get("wall_s", rec["evals"][-1]["train_s"] if rec["evals"] else 0.0)
    return points + own, offset + float(wall_s) / 60


def chosen_minute(rec: dict[str, Any]) -> float:
    """Training minutes, all runs counted, at the checkpoint a record kept (its best)."""
    points, _ = run_points(rec)
    return max(points, key=lambda p: p[1])[0] if points else 0.0


def first_run(rec: dict[str, Any]) -> dict[str, Any]:
    while rec.get("continues"):
        rec = rec["continues"]
    return rec


def read_curves(pool: PoolConfig) -> dict[str, dict[str, Any]]:
    """{head: {"minutes": [...], "dev": [...], "best", "budget_min", "init_from",
    "offset_min"}} for every head of the pool with a training record."""
    out: dict[str, dict[str, Any]] = {}
    recs: dict[str, dict[str, Any]] = {}
    for d in pool.drafts:
        f = Path(d.path) / "training.json"
        if not f.is_file():
            continue
        try:
            rec = recs[d.name] = json.loads(f.read_text())
            evals, _ = run_points(rec)
            plan = rec.get("plan", {})
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise ConfigError(f"{f} is not a training record this memspec reads ({exc})",
                              f"retrain the head: memspec zoo drafts --only {d.name} "
                              "--force") from None
        if not evals:  # stopped before its first scored checkpoint: nothing to draw
            continue
        out[d.name] = {"minutes": [m for m, _ in evals], "dev": [v for _, v in evals],
                       "best": rec.get("best_dev"), "budget_min": plan.get("minutes"),
                       "init_from": None if rec.get("continues") else plan.get("init_from"),
                       "stopped": rec.get("stopped"), "rows_seen": rec.get("rows_seen")}
    for name, c in out.items():
        # a fine-tune starts where its parent's kept checkpoint was: recorded since heads can
        # be continued; older fine-tunes came from the parent's first run
        offset = recs[name].get("parent_minutes")
        if offset is None and c["init_from"] in recs:
            offset = chosen_minute(first_run(recs[c["init_from"]]))
        c["offset_min"] = float(offset or 0.0)
    return out


def last_gain(c: dict[str, Any], share: float = 1 / 3) -> float | None:
    """Dev acceptance gained per 10 minutes over the last `share` of the run: what more of
    the same budget was still buying when it ended."""
    ms, vs = c["minutes"], c["dev"]
    if len(ms) < 2 or ms[-1] <= 0:
        return None
    start = ms[-1] * (1 - share)
    i = max(j for j, m in enumerate(ms) if m <= start) if ms[0] <= start else 0
    span = ms[-1] - ms[i]
    return None if span <= 0 else 10 * (max(vs[i:]) - vs[i]) / span


def plot(curves: dict[str, dict[str, Any]], out: Path) -> Path:
    from memspec.common.plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for name, c in curves.items():
        xs = [c["offset_min"] + m for m in c["minutes"]]
        ax.plot(xs, c["dev"], marker="o", ms=3, label=f"{name} (best {max(c['dev']):.3f})")
    ax.set_xlabel("training minutes (a domain head continues from the general head's "
                  "chosen checkpoint)")
    ax.set_ylabel("dev mean acceptance length (gamma 4)")
    ax.set_title("Draft heads: dev acceptance against training time\n(general: every "
                 "domain's dev prompts; a domain head: its own; cosine to 10% per budget)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main_curves(args) -> int:
    pool = load_pool(getattr(args, "pool", None))
    curves = read_curves(pool)
    if not curves:
        raise ConfigError("no head of this pool has a training record (training.json)",
                          "train them: memspec zoo drafts")
    rows = {n: {**c, "gain_per_10_min_at_end": last_gain(c)} for n, c in curves.items()}
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'head':<10}{'minutes':>9}{'dev best':>10}{'dev last':>10}"
              f"{'gain/10 min, last third':>25}  stopped by")
        for n, c in rows.items():
            g = c["gain_per_10_min_at_end"]
            print(f"{n:<10}{c['minutes'][-1]:>9.1f}{max(c['dev']):>10.3f}{c['dev'][-1]:>10.3f}"
                  f"{'n/a' if g is None else f'{g:+.3f}':>25}  {c['stopped']}")
    if args.plots:
        print(f"plot: {plot(curves, Path(args.plots) / 'head_training.png')}")
    return 0
