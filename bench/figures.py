"""PNG figures of a `memspec bench` result; every one is drawn from the result JSON alone.

Real three-process runs first (headline ratios end to end with their 95% intervals,
steady and the simulator's value beside them; tokens/s per policy with target-only), then
the simulator's per-domain view, the wall-time split, sweeps and UCB's c on dev.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memspec.bench.heldout import current_names
from memspec.bench.stats import HEADLINE
from memspec.common.plotting import pyplot

POLICY_ORDER = ("target-only", "target-only-1t", "lookup-only", "general-static",
                "general-static-ungated", "oracle-static", "mab-sync", "mab-async",
                "mab-async-ungated", "prediction-only", "memspec", "memspec-ungated",
                "oracle-dynamic")
RATIO_LABELS = {k: f"{a} / {b}" for k, (a, b) in HEADLINE.items()}
# the wall-time split (bench/evaluation.py SPLIT) as the figures and tables name its parts
SPLIT_LABELS = {"pre": "pre", "prefill": "prefill", "draft": "draft", "catchup": "catch-up",
                "verify": "verify", "target_gated": "target alone (gated)",
                "target_fallback": "target alone (fallback)", "load_wait": "load wait",
                "bind": "bind", "prediction": "prediction", "sched": "scheduling",
                "other": "other"}


def _plt():
    return pyplot()


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def _tag(result: dict[str, Any]) -> str:
    return " [SMOKE RUN]" if result.get("smoke") else ""


def _err(gm: dict[str, Any], ci: dict[str, Any], keys: list[str]) -> list[list[float]]:
    """Error-bar lengths below and above each value (0 where the interval is unknown)."""
    def side(k: str, i: int) -> float:
        bound = (ci.get(k) or [None, None])[i]
        return abs(bound - gm[k]) if isinstance(bound, (int, float)) and bound == bound else 0.0

    return [[side(k, 0) for k in keys], [side(k, 1) for k in keys]]


def real_ratios(result: dict[str, Any], out: Path) -> Path | None:
    """Headline ratios per prompt set: end-to-end GMEAN with 95% CI (bars), steady and the
    simulator's steady value beside it (markers)."""
    real = result.get("real") or {}
    if not real:
        return None
    plt = _plt()
    sets = list(real)
    fig, axes = plt.subplots(1, len(sets), figsize=(6.5 * len(sets), 5), squeeze=False)
    for ax, which in zip(axes[0], sets):
        sec = real[which]
        e2e, steady = sec.get("gmean_e2e") or {}, sec["gmean"]
        beside = (result.get("sim_vs_real") or {}).get(which, {}).get("ratios", {})
        keys = [k for k in RATIO_LABELS if e2e.get(k) is not None]
        ys = list(range(len(keys)))
        ax.barh(ys, [e2e[k] for k in keys], xerr=_err(e2e, sec.get("ci95_e2e") or {}, keys),
                color="tab:blue", alpha=0.75, capsize=3, label="end to end (GMEAN, 95% CI)")
        st = [(y, steady.get(k)) for y, k in zip(ys, keys) if steady.get(k) is not None]
        ax.scatter([v for _, v in st], [y for y, _ in st], marker="o", color="black",
                   zorder=3, label="steady")
        sim = [(y, beside.get(k, {}).get("sim")) for y, k in zip(ys, keys)]
        sim = [(y, v) for y, v in sim if v is not None]
        ax.scatter([v for _, v in sim], [y for y, _ in sim], marker="D", color="tab:red",
                   zorder=3, label="simulator (steady), same prompts")
        ax.axvline(1.0, color="grey", lw=0.8)
        ax.set_yticks(ys, [RATIO_LABELS[k] for k in keys], fontsize=8)
        ax.set_title(f"{which}: {sec['prompts']} prompts x {sec['repeats']} repeats"
                     f"{_tag(result)}", fontsize=9)
        ax.set_xlabel("tokens/s ratio")
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
                if which != "mixed" or d != "GMEAN":  # mixed: its one column
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
    held = sim.get(current_names(result)["held_out"], {})
    if key == "normalised_steady" and "optimum_steady" in held:
        base = held["steady"]["general-static"]
        xs = [j for j, c in enumerate(names) if c in held["optimum_steady"]]
        ax.scatter([j + 0.4 - w / 2 for j in xs],
                   [held["optimum_steady"][names[j]] / base[names[j]] for j in xs], marker="_",
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
    """Where the wall time goes, real runs (simulator when there are none)."""
    src = result.get("real") or result.get("sim") or {}
    if not src:
        return None
    plt = _plt()
    bars: list[tuple[str, dict[str, float]]] = []
    for which, sec in src.items():
        for p in POLICY_ORDER:
            if p in sec["breakdown"]:
                bars.append((f"{p}\n{which}", sec["breakdown"][p]))
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(bars)), 4.5))
    bottom = [0.0] * len(bars)
    for k, label in SPLIT_LABELS.items():
        vals = [100 * (b.get(f"{k}_frac") or 0.0) for _, b in bars]
        ax.bar([n for n, _ in bars], vals, bottom=bottom, label=label)
        bottom = [x + v for x, v in zip(bottom, vals)]
    ax.set_ylabel("% of wall time (request start to last token)")
    ax.tick_params(axis="x", labelsize=6, rotation=90)
    ax.set_title(f"Wall-time split ({'real runs' if result.get('real') else 'simulator'})"
                 f"{_tag(result)}", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
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
    fig.suptitle(f"Sensitivity (simulator, {current_names(result)['held_out']} prompts)"
                 f"{_tag(result)}")
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
    """Every figure of a `memspec bench` result (an old one read in today's set names)."""
    out.mkdir(parents=True, exist_ok=True)
    result = current_names(result)
    paths = [f(result, out) for f in FIGURES]
    return [p for p in paths if p is not None]
