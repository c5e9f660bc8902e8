"""`memspec bench gate`: the speculation gate's constants, chosen on dev by a sweep.

The gate (procs/decoder/sched/gate.py) decides from a request's own iterations whether its draft
pays; how fast it forgets (``ALPHA``), how long it looks at a draft before its record
decides (``FIRST_LOOK``, ``NEAR_MISS``), whether that first look is free or paid from the
share (``PRIOR_TAU``: free only where an iteration costs fewer target steps than the pool's
drafts bring), whether a running draft stops inside its interval
(``STOP_INSIDE``) and how much of a request its probes may cost (``PROBE_SHARE``) trade a
draft that pays against the iterations lost to one that does not. Each setting is replayed
through the runtime's own loop (sim/simulate.py) on the traced dev prompts, with the
general draft resident as in a fresh decoder, at the measured cost model and at cheaper
iterations (``SPEC_SCALES``: the same acceptance on a machine where an iteration costs
less, where speculation pays more often), so the choice holds on either side of
break-even. Per setting: memspec over target-only end to end (geometric mean, the worst
prompt) and memspec over an ungated general-static where that pays. The chosen setting
keeps every scale's geometric mean at ``GMEAN_FLOOR`` or above and no prompt below
``FLOOR`` (never slower than the target alone, with a margin), and among those gains the most over the
scales (their geometric mean: where speculation pays, take it); the simulator is
deterministic, so a re-run gives the same table (it answers the what-if; `memspec bench
floor` measures the real value).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from memspec.common.config import load_pool
from memspec.common.errors import ConfigError
from memspec.common.plotting import save_outputs
from memspec.procs.decoder.sched.gate import SpecGate
from memspec.sim.costmodel import CostModel
from memspec.sim.simulate import SimRequest, simulate

SPEC_SCALES = (1.0, 0.75, 0.55)  # an iteration's cost over the cost model's
# every scale's geometric mean and every prompt: the bounds memspec must meet for real
# (0.97, 0.90), with a margin for what the simulator leaves out (a machine's noise)
GMEAN_FLOOR, FLOOR = 0.975, 0.92
GRID: dict[str, tuple[Any, ...]] = {
    "ALPHA": (0.05, 0.1, 0.2, 0.3),
    "FIRST_LOOK": (2, 4, 8),
    "NEAR_MISS": (0.5, 0.75),
    "STOP_INSIDE": (0, 8, 10**6),  # 0: never, 10**6: always
    "PROBE_SHARE": (0.01, 0.02),  # the probes' bound: at most 2% of a request
    "PRIOR_TAU": (0.0, 2.0, 10**6),  # 0: no free look, 10**6: always one
}


@contextlib.contextmanager
def gate_constants(values: Mapping[str, Any]) -> Iterator[None]:
    """The gate's class constants set to `values` for the duration (the runtime's SpecGate,
    unchanged otherwise)."""
    old = {k: getattr(SpecGate, k) for k in values}
    try:
        for k, v in values.items():
            setattr(SpecGate, k, v)
        yield
    finally:
        for k, v in old.items():
            setattr(SpecGate, k, v)


def gmean(xs: Sequence[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else 0.0


def _e2e(policy: str, req: SimRequest, cost: CostModel, cfg, general: str) -> float:  # noqa: ANN001
    s = simulate(policy, req, cost, cfg, resident=(general,)).report()
    return s.generated_tokens / s.time.e2e if s.time.e2e > 0 else 0.0


def score(values: Mapping[str, Any], reqs: Sequence[SimRequest], cost: CostModel, cfg,  # noqa: ANN001
          general: str, base: Mapping[str, tuple[float, float]]) -> dict[str, Any]:
    """memspec under `values` against the baselines `base` ({prompt: (target-only,
    ungated general-static)} tokens/s)."""
    with gate_constants(values):
        ms = {r.prompt_id: _e2e("memspec", r, cost, cfg, general) for r in reqs}
    over_to = [ms[p] / base[p][0] for p in ms]
    pays = [ms[p] / base[p][1] for p in ms if base[p][1] > base[p][0]]
    return {"gmean": gmean(over_to), "min": min(over_to),
            "where_general_static_pays": len(pays),
            "over_general_static": gmean(pays) if pays else None}


def sweep(reqs: Sequence[SimRequest], cost: CostModel, cfg, general: str,  # noqa: ANN001
          grid: Mapping[str, Sequence[Any]] = GRID, scales: Sequence[float] = SPEC_SCALES,
          progress=lambda msg: None) -> dict[str, Any]:
    settings = [dict(zip(grid, vals)) for vals in itertools.product(*grid.values())]
    per_scale = []
    for i, f in enumerate(scales):
        c = replace(cost, spec_s={d: s * f for d, s in cost.spec_s.items()})
        base = {r.prompt_id: (_e2e("target-only", r, c, cfg, general),
                              _e2e("general-static", r, c, replace(cfg, gate=False), general))
                for r in reqs}
        rows = []
        for j, v in enumerate(settings):
            rows.append(score(v, reqs, c, cfg, general, base))
            if j % 20 == 19:
                progress(f"scale {f}: {j + 1}/{len(settings)} settings "
                         f"({i + 1}/{len(scales)} scales)")
        per_scale.append({"spec_scale": f, "spec_over_target_step":
                          c.spec_s[general] / c.target_s, "rows": rows,
                          "general_static_over_target_only":
                          gmean([b[1] / b[0] for b in base.values()])})
    table = []
    for k, v in enumerate(settings):
        res = [s["rows"][k] for s in per_scale]
        table.append({"setting": v, "over_scales": gmean([r["gmean"] for r in res]),
                      "worst_gmean": min(r["gmean"] for r in res),
                      "worst_prompt": min(r["min"] for r in res), "by_scale": res})
    ok = [t for t in table if t["worst_gmean"] >= GMEAN_FLOOR and t["worst_prompt"] >= FLOOR]
    best = max(ok or table, key=lambda t: t["over_scales"])
    current = {k: getattr(SpecGate, k) for k in grid}
    now = next(t for t in table if t["setting"] == current) if current in settings else None
    return {"scales": [{k: s[k] for k in s if k != "rows"} for s in per_scale],
            "grid": {k: list(v) for k, v in grid.items()}, "floor": FLOOR,
            "table": table, "best": best, "current": now}


def _print(res: dict[str, Any]) -> None:
    print(f"{res['prompts']} dev prompts x {res['max_new_tokens']} tokens, simulated; "
          f"iteration / target step at the scales: "
          + ", ".join(f"{s['spec_over_target_step']:.2f} (ungated general-static / target-only "
                      f"{s['general_static_over_target_only']:.3f})" for s in res["scales"]))
    for name in ("best", "current"):
        t = res[name]
        if t is None:
            continue
        by = "; ".join(f"{r['gmean']:.3f} (min {r['min']:.3f}"
                       + (f", {r['over_general_static']:.3f} of general-static on its "
                          f"{r['where_general_static_pays']}" if r["over_general_static"] else "")
                       + ")" for r in t["by_scale"])
        print(f"{name}: {t['setting']}: memspec / target-only e2e {t['over_scales']:.3f} over "
              f"the scales; by scale {by}")


def _plot(res: dict[str, Any], folder: Path) -> Path:
    from memspec.common.plotting import pyplot

    plt = pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    rows = sorted(res["table"], key=lambda t: t["over_scales"])
    fig, ax = plt.subplots(figsize=(10, 4))
    for i, s in enumerate(res["scales"]):
        ax.plot([t["by_scale"][i]["gmean"] for t in rows], ".",
                label=f"iteration = {s['spec_over_target_step']:.2f} target steps")
    ax.plot([t["worst_prompt"] for t in rows], "x", ms=3, color="grey", label="worst prompt")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(res["floor"], color="r", ls="--", lw=0.8)
    ax.set_xlabel("gate setting (sorted by its geometric mean over the scales)")
    ax.set_ylabel("memspec / target-only, end to end")
    ax.set_title("speculation gate constants on dev (simulated, general draft resident)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = folder / "gate_sweep.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main_bench_gate(args) -> int:  # noqa: ANN001
    from memspec.bench.evaluation import sim_config, traced_requests

    pool = load_pool(args.pool)
    if not args.cost_model:
        raise ConfigError("bench gate replays a measured cost model",
                          "pass --cost-model docs/results/bench.json (a `memspec bench --json` output)")
    try:
        raw = json.loads(Path(args.cost_model).read_text())
        cost = CostModel.from_json(raw.get("cost_model", raw))
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot read a cost model from {args.cost_model}: {exc}",
                          "pass a `memspec bench --json` output, e.g. docs/results/bench.json") from None
    reqs = traced_requests(pool, "dev", args.per_domain, scores=False)
    cfg = sim_config(pool, cost, max_new_tokens=args.max_new_tokens)
    res = sweep(reqs, cost, cfg, pool.general,
                progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    res.update(prompts=len(reqs), max_new_tokens=args.max_new_tokens,
               cost_model=args.cost_model, split="dev")
    _print(res)
    save_outputs(res, args, _plot)
    return 0
