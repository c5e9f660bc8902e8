"""PNG figures of a `memspec bench` result (the paper's Figs. 6-9 on our pool)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

POLICY_ORDER = ("general-static", "oracle-static", "mab-sync", "mab-async", "prediction-only",
                "memspec", "oracle-dynamic")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def throughput(result: dict[str, Any], out: Path, key: str = "normalised_steady") -> Path:
    plt = _plt()
    norm = result[key]
    doms = [d for d in next(iter(norm.values())) if d != "GMEAN"] + ["GMEAN"]
    pols = [p for p in POLICY_ORDER if p in norm]
    fig, ax = plt.subplots(figsize=(11, 4))
    w = 0.8 / len(pols)
    for i, p in enumerate(pols):
        ax.bar([j + i * w for j in range(len(doms))], [norm[p][d] for d in doms], w, label=p)
    if key == "normalised_steady" and "optimum_steady" in result:
        base = result["steady"]["general-static"]
        opt = [result["optimum_steady"][d] / base[d] for d in doms[:-1]]
        ax.scatter([j + 0.4 - w / 2 for j in range(len(doms) - 1)], opt, marker="_", s=400,
                   color="black", label="optimum (DP)", zorder=3)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(doms))], doms)
    ax.axhline(1.0, color="grey", lw=0.8)
    kind = "steady-state" if "steady" in key else "end-to-end"
    ax.set_ylabel(f"{kind} tokens/s / general-static")
    ax.set_title(f"Throughput per policy (K={result['K']}, N={result['N']}, "
                 f"{result['max_new_tokens']} tokens, {result['storage']})")
    ax.legend(ncol=4, fontsize=8)
    return _save(fig, out / f"throughput_{'steady' if 'steady' in key else 'e2e'}.png")


def breakdown(result: dict[str, Any], out: Path) -> Path:
    plt = _plt()
    bd = result["breakdown"]
    pols = [p for p in ("general-static", "prediction-only", "mab-async", "memspec",
                        "oracle-dynamic") if p in bd]
    keys = ("desired", "fallback", "target_fallback", "load_wait", "prediction")
    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = [0.0] * len(pols)
    for k in keys:
        vals = [100 * bd[p].get(f"{k}_frac", 0.0) for p in pols]
        label = "target alone while loading" if k == "target_fallback" else k.replace("_", " ")
        ax.bar(pols, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("% of decode time")
    ax.set_title("Where decode time goes (catch-up is inside desired/fallback)")
    ax.legend(fontsize=8)
    return _save(fig, out / "breakdown.png")


def sweeps(result: dict[str, Any], out: Path) -> Path:
    plt = _plt()
    rows = result["sweeps"]
    knobs = list(dict.fromkeys(r["knob"] for r in rows))
    fig, grid = plt.subplots(1, len(knobs), figsize=(4 * len(knobs), 3.6), squeeze=False)
    axes = grid[0]
    for ax, knob in zip(axes, knobs):
        rs = [r for r in rows if r["knob"] == knob]
        xs = [r["value"] for r in rs]
        for key, label in (("memspec_over_mab_async", "memspec / mab-async"),
                           ("memspec_over_general_static", "memspec / general-static"),
                           ("memspec_over_oracle_dynamic", "memspec / oracle-dynamic")):
            ax.plot(xs, [r[key] for r in rs], marker="o", label=label)
        ax.set_xlabel(knob)
        ax.axhline(1.0, color="grey", lw=0.8)
        if knob in ("N", "load_over_iteration"):
            ax.set_xscale("log", base=2)
    axes[0].set_ylabel("GMEAN steady-state ratio")
    axes[0].legend(fontsize=7)
    fig.suptitle("Sensitivity (simulator, held-out prompts)")
    return _save(fig, out / "sweeps.png")


def validation(result: dict[str, Any], out: Path) -> Path | None:
    val = result.get("validation")
    if not val:
        return None
    plt = _plt()
    pols = list(val["policies"])
    fig, ax = plt.subplots(figsize=(9, 3.8))
    w = 0.4
    ax.bar([i for i in range(len(pols))], [val["policies"][p]["real_steady"] for p in pols], w,
           label="real (3 processes)")
    ax.bar([i + w for i in range(len(pols))], [val["policies"][p]["sim_steady"] for p in pols],
           w, label="simulator")
    ax.set_xticks([i + w / 2 for i in range(len(pols))], pols, fontsize=8)
    ax.set_ylabel("steady-state tokens/s")
    ax.set_title(f"Simulator vs real runs ({val['prompts']} prompts/policy); max |error| "
                 f"{100 * val['max_rel_error_steady']:.1f}%")
    ax.legend(fontsize=8)
    return _save(fig, out / "sim_vs_real.png")


def ucb(result: dict[str, Any], out: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for pol, row in result["ucb_c_sweep"].items():
        xs = [float(c) for c in row]
        ax.plot(xs, list(row.values()), marker="o", label=pol)
    ax.set_xlabel("UCB exploration constant c")
    ax.set_ylabel("GMEAN / general-static")
    ax.set_title("Baselines at their best c")
    ax.legend(fontsize=8)
    return _save(fig, out / "ucb_c.png")


def draw_all(result: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [throughput(result, out), throughput(result, out, "normalised_e2e"),
             breakdown(result, out), ucb(result, out)]
    if result.get("sweeps"):
        paths.append(sweeps(result, out))
    v = validation(result, out)
    return paths + ([v] if v else [])
