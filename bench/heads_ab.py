"""`memspec bench heads --pool A --against B`: is pool A's general draft worth more than
pool B's, in tokens per second, where a user would feel it?

Both pools run in one process on the same target (each its own engine), general-static
(the pool's general draft with the context lookup, no gate: what the draft itself is worth)
beside target-only, every prompt's three runs back to back with the two drafts' order
alternating, so the host's drift hits both alike; tokens must match target-only's. The
prompts are dev rows that no checkpoint choice scored: a head's training keeps the best of
its checkpoints on the first ``DEV_PER_DOMAIN`` dev prompts of each domain, so those would
favour the newer head. Ratios are gmeans over prompts with a 95% bootstrap interval
(bench/stats.py: prompts resampled within domains), end to end and steady.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from memspec.bench.stats import headline_ratios
from memspec.common.config import load_pool
from memspec.common.errors import ConfigError
from memspec.common.machine import machine_info, machine_line
from memspec.common.plotting import save_outputs
from memspec.zoo.heads import DEV_PER_DOMAIN
from memspec.zoo.prompts import DOMAINS, load_prompts

VARIANTS = ("target-only", "A", "B")
PAIRS = {"a_over_b": ("A", "B"), "a_over_target_only": ("A", "target-only"),
         "b_over_target_only": ("B", "target-only")}


def unscored_dev(per_domain: int, skip: int = DEV_PER_DOMAIN) -> list[dict]:
    """Dev rows ``skip``..``skip + per_domain`` of each domain, domains interleaved."""
    by = [load_prompts("dev", [d])[skip:skip + per_domain] for d in DOMAINS]
    if not all(by):
        raise ConfigError(f"dev has no prompts past the first {skip} of a domain",
                          "use fewer --per-domain or rebuild the prompt sets")
    return [rows[i] for i in range(per_domain) for rows in by if i < len(rows)]


def run(pool_a: str | None, pool_b: str, per_domain: int, max_new: int) -> dict[str, Any]:
    """``pool_a`` None: the embedded default pool."""
    from memspec.procs.decoder.inprocess import build_local, run_request
    from memspec.procs.decoder.sched.acceptance import SamplingParams

    rts = {"A": build_local(load_pool(pool_a)), "B": build_local(load_pool(pool_b))}
    rows = unscored_dev(per_domain)
    greedy = SamplingParams()
    e2e: dict[str, dict[str, list[tuple[float, float]]]] = {v: {} for v in VARIANTS}
    steady: dict[str, dict[str, list[tuple[float, float]]]] = {v: {} for v in VARIANTS}
    acc: dict[str, list[float]] = {"A": [], "B": []}
    for i, r in enumerate(rows):
        base = run_request(rts["A"], r["prompt"], "target-only", max_new, greedy)
        outs = {"target-only": base}
        for v in (("A", "B") if i % 2 == 0 else ("B", "A")):
            outs[v] = run_request(rts[v], r["prompt"], "general-static", max_new, greedy)
            if outs[v]["token_ids"] != base["token_ids"]:
                raise RuntimeError(f"pool {v}'s general-static differs from target-only on "
                                   f"{r['id']}")
            acc[v].append(outs[v]["stats"]["mean_acceptance_length"])
        for v, out in outs.items():
            s = out["stats"]
            n = s["generated_tokens"]
            e2e[v][r["id"]] = [(n, n / s["tokens_per_s_e2e"])] if s["tokens_per_s_e2e"] else []
            steady[v][r["id"]] = ([(n, n / s["tokens_per_s_steady"])]
                                  if s["tokens_per_s_steady"] else [])
        print(f"[bench heads] {i + 1}/{len(rows)} {r['id']}: target-only "
              f"{base['stats']['tokens_per_s_steady']:.0f}, A "
              f"{outs['A']['stats']['tokens_per_s_steady']:.0f}, B "
              f"{outs['B']['stats']['tokens_per_s_steady']:.0f} tok/s steady",
              file=sys.stderr, flush=True)
    strata = {r["id"]: r["domain"] for r in rows}
    res: dict[str, Any] = {"machine": machine_info(), "pool_a": str(pool_a or "pool.toml"),
                           "pool_b": str(pool_b), "prompts": len(rows),
                           "prompt_rows": f"dev rows {DEV_PER_DOMAIN + 1}-"
                                          f"{DEV_PER_DOMAIN + per_domain} of each domain",
                           "max_new_tokens": max_new, "policy": "general-static, ungated, "
                                                                "context lookup as the pool sets it"}
    for clock, runs in (("e2e", e2e), ("steady", steady)):
        gm, ci = headline_ratios(runs, strata, PAIRS)
        res[clock] = {k: {"gmean": gm[k], "ci95": ci[k]} for k in PAIRS}
    res["mean_acceptance_length"] = {v: sum(x) / len(x) for v, x in acc.items()}
    return res


def _print(res: dict[str, Any]) -> None:
    print(machine_line())
    print(f"A = {res['pool_a']}, B = {res['pool_b']}; {res['prompts']} prompts "
          f"({res['prompt_rows']}), {res['max_new_tokens']} new tokens, {res['policy']}")
    for clock in ("e2e", "steady"):
        print(f"  {clock:<7}" + "; ".join(
            f"{k} {v['gmean']:.3f} [{v['ci95'][0]:.3f}, {v['ci95'][1]:.3f}]"
            for k, v in res[clock].items()))
    a, b = res["mean_acceptance_length"]["A"], res["mean_acceptance_length"]["B"]
    print(f"  tokens an iteration: A {a:.3f}, B {b:.3f}")


def _plot(res: dict[str, Any], folder: Path) -> Path:
    from memspec.common.plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    labels = list(PAIRS)
    for j, clock in enumerate(("e2e", "steady")):
        xs = [i + (j - 0.5) * 0.35 for i in range(len(labels))]
        g = [res[clock][k]["gmean"] for k in labels]
        err = [[gi - res[clock][k]["ci95"][0] for gi, k in zip(g, labels)],
               [res[clock][k]["ci95"][1] - gi for gi, k in zip(g, labels)]]
        ax.bar(xs, g, 0.35, yerr=err, capsize=3, label=clock)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("gmean tokens/s ratio (95% interval)")
    ax.set_title(f"general draft of A vs B, {res['prompts']} unscored dev prompts",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "heads_ab.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main_bench_heads(args) -> int:
    if not args.against:
        raise ConfigError("bench heads compares two pools", "name the other with --against P")
    if not Path(args.against).is_file():
        raise ConfigError(f"--against pool file {args.against} not found",
                          "name an existing pool file, e.g. pool.toml or pools/heads.toml")
    res = run(args.pool, args.against, args.per_domain, args.max_new_tokens)
    _print(res)
    save_outputs(res, args, _plot)
    return 0
