"""PNG figures of a `memspec bench` result; every one is drawn from the result JSON alone.

Real three-process runs first (headline ratios with their 95% intervals and the
simulator's value beside them, tokens/s per policy with target-only), then the
simulator's per-domain view, the time breakdown, sweeps and UCB's c on dev.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memspec.bench.plotting import pyplot

POLICY_ORDER = ("target-only", "general-static", "oracle-static", "mab-sync", "mab-async",
                "prediction-only", "memspec", "oracle-dynamic")
RATIO_LABELS = {
    "memspec_over_mab_async": "memspec / mab-async",
    "memspec_over_general_static": "memspec / general-static",
    "memspec_over_oracle_dynamic": "memspec / oracle-dynamic",
    "memspec_over_prediction_only": "memspec / prediction-only",
    "memspec_over_target_only": "memspec / target-only",
    "oracle_dynamic_over_oracle_static": "oracle-dynamic / oracle-static",
}


def _plt():
    return pyplot()


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def _tag(result: dict[str, Any]) -> str:
    return " [SMOKE RUN]" if result.get("smoke") else ""


def real_ratios(result: dict[str, Any], out: Path) -> Path | None:
    """Headline ratios per prompt set: real GMEAN with 95% CI, simulator value beside."""
    real = result.get("real") or {}
    if not real:
        return None
    plt = _plt()
    sets = list(real)
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4), squeeze=False)
    for ax, which in zip(axes[0], sets):
        gm, ci = real[which]["gmean"], real[which]["ci95"]
        beside = (result.get("sim_vs_real") or {}).get(which, {}).get("ratios", {})
        keys = [k for k in RATIO_LABELS if k in gm and gm[k] is not None]
        ys = list(range(len(keys)))
        vals = [gm[k] for k in keys]
        lo = [gm[k] - (ci[k][0] if ci[k][0] is not None else gm[k]) for k in keys]
        hi = [(ci[k][1] if ci[k][1] is not None else gm[k]) - gm[k] for k in keys]
        ax.barh(ys, vals, xerr=[lo, hi], color="tab:blue", alpha=0.75, capsize=3,
                label="real (GMEAN, 95% CI)")
        sim = [beside.get(k, {}).get("sim") for k in keys]
        ax.scatter([s for s in sim if s is not None],
                   [y for y, s in zip(ys, sim) if s is not None], marker="D", color="tab:red",
                   zorder=3, label="simulator, same prompts")
        ax.axvline(1.0, color="grey", lw=0.8)
        ax.set_yticks(ys, [RATIO_LABELS[k] for k in keys], fontsize=8)
        ax.set_title(f"{which}: {real[which]['prompts']} prompts x "
                     f"{real[which]['repeats']} repeats{_tag(result)}", fontsize=9)
        ax.set_xlabel("steady-state tokens/s ratio")
        ax.legend(fontsize=7, loc="best")
    return _save(fig, out / "real_ratios.png")


def real_throughput(result: dict[str, Any], out: Path) -> Path | None:
    """Pooled steady-state tokens/s per policy in real runs, target-only included."""
    real = result.get("real") or {}
    if not real:
        return None
    plt = _plt()
    sets = list(real)
    pols = [p for p in POLICY_ORDER if any(p in real[s]["steady"] for s in sets)]
    fig, ax = plt.subplots(figsize=(10, 4))
    w = 0.8 / len(sets)
    for i, which in enumerate(sets):
        ax.bar([j + i * w for j in range(len(pols))],
               [real[which]["steady"].get(p, 0.0) for p in pols], w, label=which)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(pols))], pols, fontsize=8)
    ax.set_ylabel("steady-state tokens/s (real)")
    ax.set_title(f"Real three-process runs, K={result['K']}, N={result['N']}, "
                 f"{result['max_new_tokens']} tokens, target in {result.get('dtype', '?')}"
                 f"{_tag(result)}", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, out / "real_throughput.png")


def sim_throughput(result: dict[str, Any], out: Path, key: str = "normalised_steady"
                   ) -> Path | None:
    """Simulator, per domain (and mixed), normalised to general-static; target-only too."""
    sim = result.get("sim") or {}
    cols: dict[str, dict[str, float]] = {}  # policy -> column -> value
    for which, sec in sim.items():
        for pol, row in sec[key].items():
            for d, v in row.items():
                if which == "test" or d != "GMEAN":  # mixed: its one column
                    cols.setdefault(pol, {})[f"GMEAN ({which})" if d == "GMEAN" else d] = v
    if not cols:
        return None
    plt = _plt()
    names = list(dict.fromkeys(c for row in cols.values() for c in row))
    pols = [p for p in POLICY_ORDER if p in cols]
    fig, ax = plt.subplots(figsize=(12, 4))
    w = 0.8 / len(pols)
    for i, p in enumerate(pols):
        ax.bar([j + i * w for j in range(len(names))], [cols[p].get(c, 0.0) for c in names], w,
               label=p)
    test = sim.get("test", {})
    if key == "normalised_steady" and "optimum_steady" in test:
        base = test["steady"]["general-static"]
        xs = [j for j, c in enumerate(names) if c in test["optimum_steady"]]
        ax.scatter([j + 0.4 - w / 2 for j in xs],
                   [test["optimum_steady"][names[j]] / base[names[j]] for j in xs], marker="_",
                   s=400, color="black", label="optimum (DP)", zorder=3)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(names))], names)
    ax.axhline(1.0, color="grey", lw=0.8)
    kind = "steady-state" if "steady" in key else "end-to-end"
    ax.set_ylabel(f"{kind} tokens/s / general-static")
    ax.set_title(f"Simulator per domain (K={result['K']}, N={result['N']}, "
                 f"{result['max_new_tokens']} tokens, {result['storage']}){_tag(result)}",
                 fontsize=9)
    ax.legend(ncol=5, fontsize=7)
    return _save(fig, out / f"sim_throughput_{'steady' if 'steady' in key else 'e2e'}.png")


def breakdown(result: dict[str, Any], out: Path) -> Path | None:
    """Where decode time goes, real runs (simulator when there are none)."""
    src = result.get("real") or result.get("sim") or {}
    if not src:
        return None
    plt = _plt()
    keys = (("desired", "desired"), ("fallback_resident", "fallback (other draft)"),
            ("target_fallback", "target alone while loading"), ("load_wait", "load wait"),
            ("prediction", "prediction"))
    bars: list[tuple[str, dict[str, float]]] = []
    for which, sec in src.items():
        for p in ("general-static", "mab-async", "prediction-only", "memspec",
                  "oracle-dynamic"):
            if p in sec["breakdown"]:
                bars.append((f"{p}\n{which}", sec["breakdown"][p]))
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(bars)), 4))
    bottom = [0.0] * len(bars)
    for k, label in keys:
        vals = [100 * b.get(f"{k}_frac", 0.0) for _, b in bars]
        ax.bar([n for n, _ in bars], vals, bottom=bottom, label=label)
        bottom = [x + v for x, v in zip(bottom, vals)]
    ax.set_ylabel("% of decode time")
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(f"Time breakdown ({'real runs' if result.get('real') else 'simulator'})"
                 f"{_tag(result)}", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, out / "breakdown.png")


def sweeps(result: dict[str, Any], out: Path) -> Path | None:
    rows = result.get("sweeps")
    if not rows:
        return None
    plt = _plt()
    knobs = list(dict.fromkeys(r["knob"] for r in rows))
    fig, grid = plt.subplots(1, len(knobs), figsize=(4 * len(knobs), 3.6), squeeze=False)
    axes = grid[0]
    for ax, knob in zip(axes, knobs):
        rs = [r for r in rows if r["knob"] == knob]
        xs = [r["value"] for r in rs]
        for key in ("memspec_over_mab_async", "memspec_over_general_static",
                    "memspec_over_oracle_dynamic", "memspec_over_target_only"):
            if all(key in r for r in rs):
                ax.plot(xs, [r[key] for r in rs], marker="o", label=RATIO_LABELS[key])
        ax.set_xlabel(knob)
        ax.axhline(1.0, color="grey", lw=0.8)
        if knob in ("N", "load_over_iteration"):
            ax.set_xscale("log", base=2)
    axes[0].set_ylabel("GMEAN steady-state ratio")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Sensitivity (simulator, test prompts){_tag(result)}")
    return _save(fig, out / "sweeps.png")


def sim_vs_real(result: dict[str, Any], out: Path) -> Path | None:
    svr = {k: v for k, v in (result.get("sim_vs_real") or {}).items() if isinstance(v, dict)}
    if not svr:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 5))
    lo, hi = 10.0, 0.0
    for which, sec in svr.items():
        pts = [(v["real"], v["sim"]) for v in sec["ratios"].values()
               if v.get("real") and v.get("sim")]
        if pts:
            ax.scatter(*zip(*pts), label=which)
            lo = min(lo, *(min(p) for p in pts))
            hi = max(hi, *(max(p) for p in pts))
    if hi > lo:
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
        ax.fill_between([lo, hi], [lo * 0.97, hi * 0.97], [lo * 1.03, hi * 1.03],
                        color="grey", alpha=0.15, label="±3%")
    ax.set_xlabel("real (GMEAN ratio)")
    ax.set_ylabel("simulator (same prompts)")
    ax.set_title(f"Headline ratios: simulator vs real{_tag(result)}", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, out / "sim_vs_real.png")


def ucb(result: dict[str, Any], out: Path) -> Path | None:
    if not result.get("ucb_c_sweep"):
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for pol, row in result["ucb_c_sweep"].items():
        ax.plot([float(c) for c in row], list(row.values()), marker="o", label=pol)
    ax.set_xlabel("UCB exploration constant c")
    ax.set_ylabel("GMEAN / general-static (dev)")
    ax.set_title(f"UCB c chosen on dev{_tag(result)}", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, out / "ucb_c.png")


FIGURES = (real_ratios, real_throughput, sim_throughput, breakdown, sweeps, sim_vs_real, ucb)


def draw_all(result: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [f(result, out) for f in FIGURES]
    return [p for p in paths if p is not None]
