"""`memspec bench engine`: engine overhead and target-only vs speculative tokens/s, side by side.

Overhead is the engine's mean iteration time over the time of the bare model forwards the
same iteration performs (gamma draft steps + one verify of gamma+1 tokens), replayed with
the same cache lengths in a tight loop. Both are measured in one run on this machine.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from memspec.common.config import load_pool
from memspec.common.machine import machine_line
from memspec.procs.decoder.engine import forward_with_cache
from memspec.procs.decoder.inprocess import build_local, run_request
from memspec.zoo.trajectories import read_prompts

DOMAINS = ("general", "code", "math", "law", "medical")


def _prompts(n: int) -> list[tuple[str, str]]:
    root = Path(__file__).resolve().parent.parent / "prompts"
    out = []
    for i in range(n):
        domain = DOMAINS[i % len(DOMAINS)]
        rows = read_prompts(root / f"{domain}.jsonl")
        out.append((domain, rows[i // len(DOMAINS)]["prompt"]))
    return out


@torch.inference_mode()
def _raw_iteration_s(target, draft, ctx: int, gamma: int, reps: int = 10) -> float:
    """Bare forwards of one SD iteration at context length ``ctx``, no engine logic."""
    vocab_d = draft.get_input_embeddings().weight.shape[0]
    tc, dc = DynamicCache(), DynamicCache()
    forward_with_cache(target, torch.randint(0, 1000, (1, ctx)), tc, logits_to_keep=1)
    forward_with_cache(draft, torch.randint(0, vocab_d, (1, ctx)), dc, logits_to_keep=1)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        forward_with_cache(draft, torch.randint(0, vocab_d, (1, 2)), dc, logits_to_keep=1)
        for _ in range(gamma - 1):
            forward_with_cache(draft, torch.randint(0, vocab_d, (1, 1)), dc)
        forward_with_cache(target, torch.randint(0, 1000, (1, gamma + 1)), tc)
        times.append(time.perf_counter() - t0)
        dc.crop(-(gamma + 1))
        tc.crop(-(gamma + 1))
    return statistics.median(times)


def run(pool_path: str | None, n_prompts: int, max_new: int) -> dict[str, Any]:
    torch.manual_seed(0)
    pool = load_pool(pool_path)
    rt = build_local(pool)
    rows = []
    for i, (domain, prompt) in enumerate(_prompts(n_prompts)):
        base = run_request(rt, prompt, "target-only", max_new)
        spec = run_request(rt, prompt, "general-static", max_new)
        assert base["token_ids"] == spec["token_ids"], "speculative output differs from target"
        s = spec["stats"]
        iters = max(s["iterations"], 1)
        iter_s = (s["time"]["desired"] + s["time"]["fallback"]
                  + s["time"]["target_fallback"]) / iters
        ctx = s["prompt_tokens"] + s["generated_tokens"] // 2
        draft = rt.engine.drafts[pool.general].model
        raw_s = _raw_iteration_s(rt.engine.target, draft, ctx, pool.gamma)
        rows.append({
            "domain": domain,
            "target_only_tok_s": base["stats"]["tokens_per_s_steady"],
            "speculative_tok_s": s["tokens_per_s_steady"],
            "speedup": s["tokens_per_s_steady"] / max(base["stats"]["tokens_per_s_steady"], 1e-9),
            "mean_acceptance_length": s["mean_acceptance_length"],
            "iteration_s": iter_s,
            "raw_forward_s": raw_s,
            "overhead_ratio": iter_s / raw_s,
        })
        print(f"[bench] {i + 1}/{n_prompts} {domain}: {rows[-1]['speedup']:.2f}x, "
              f"overhead {rows[-1]['overhead_ratio']:.3f}", file=sys.stderr, flush=True)
    gm = statistics.geometric_mean
    return {
        "machine": machine_line(),
        "gamma": pool.gamma, "max_new_tokens": max_new, "rows": rows,
        "gmean_speedup": gm([r["speedup"] for r in rows]),
        "gmean_overhead_ratio": gm([r["overhead_ratio"] for r in rows]),
    }


def _print(res: dict[str, Any]) -> None:
    print(f"machine: {res['machine']}; gamma={res['gamma']}, {res['max_new_tokens']} new tokens")
    print(f"{'domain':<9}{'target tok/s':>13}{'spec tok/s':>12}{'speedup':>9}{'acc len':>9}"
          f"{'iter ms':>9}{'raw ms':>8}{'overhead':>10}")
    for r in res["rows"]:
        print(f"{r['domain']:<9}{r['target_only_tok_s']:>13.1f}{r['speculative_tok_s']:>12.1f}"
              f"{r['speedup']:>8.2f}x{r['mean_acceptance_length']:>9.2f}"
              f"{1e3 * r['iteration_s']:>9.1f}{1e3 * r['raw_forward_s']:>8.1f}"
              f"{r['overhead_ratio']:>9.3f}x")
    print(f"gmean speculative/target-only: {res['gmean_speedup']:.2f}x; "
          f"engine iteration / raw forwards: {res['gmean_overhead_ratio']:.3f}x")


def _plot(res: dict[str, Any], folder: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    doms = [r["domain"] for r in res["rows"]]
    x = range(len(doms))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([i - 0.2 for i in x], [r["target_only_tok_s"] for r in res["rows"]], 0.4,
           label="target-only")
    ax.bar([i + 0.2 for i in x], [r["speculative_tok_s"] for r in res["rows"]], 0.4,
           label="speculative (general draft)")
    ax.set_xticks(list(x), doms)
    ax.set_ylabel("tokens/s (steady state)")
    ax.set_title(f"Engine throughput, {res['machine']}")
    ax.legend()
    fig.tight_layout()
    out = folder / "bench_engine.png"
    fig.savefig(out, dpi=120)
    return out


def main_bench_engine(args) -> int:
    res = run(args.pool, args.prompts, args.max_new_tokens)
    _print(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    if args.plots:
        print(f"plot: {_plot(res, Path(args.plots))}")
    return 0
