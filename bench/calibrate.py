"""Measure the cost model on the real runtime: traced calibration requests + catch-up timing.

Calibration prompts come from the training set so the held-out prompts that validate the
simulator never shaped its costs.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from memspec.bench.realruns import RealRequest, run_real
from memspec.common.config import PoolConfig
from memspec.procs.decoder.forward.threads import decoder_threads
from memspec.procs.decoder.inprocess import slot_capacity
from memspec.procs.decoder.slots import SlotBuffer, load_into_slot
from memspec.sim.costmodel import CostModel, fit

CATCHUP_TOKENS = (8, 32, 96, 192)


def _log(msg: str) -> None:
    print(f"[calibrate] {msg}", file=sys.stderr, flush=True)


def catchup_timings(pool: PoolConfig, reps: int = 3) -> list[tuple[int, float]]:
    """(tokens, seconds) of a draft prefilling a fresh KV cache, as a (re)activation does;
    only the fallback when the traced runs switched too rarely. A head catches up on the
    target's features, which only a running engine has: none measured here for heads."""
    torch.set_num_threads(decoder_threads()[0])  # as the decoder process runs, helpers idle
    spec = pool.general_draft
    cfg = json.loads((Path(spec.path) / "config.json").read_text())
    if cfg.get("memspec_kind", "model") != "model":
        return []
    bound = load_into_slot(spec.name, spec.path, SlotBuffer(slot_capacity(pool)))
    cache = bound.new_cache(max(CATCHUP_TOKENS) + 16)
    out = []
    with torch.inference_mode():
        for n in CATCHUP_TOKENS:
            ids = torch.randint(0, 1000, (n,))
            bound.runner.forward(ids, 0, cache, last_only=True)  # warm
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                bound.runner.forward(ids, 0, cache, last_only=True)
                times.append(time.perf_counter() - t0)
            out.append((n, statistics.median(times)))
    _log("catch-up " + ", ".join(f"{n} tok {s * 1e3:.1f} ms" for n, s in out))
    return out


def draft_architectures(pool: PoolConfig) -> dict[str, str]:
    """Draft -> the config fields that set its compute (equal keys: equal iteration cost)."""
    keys = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
            "num_attention_heads", "num_key_value_heads", "vocab_size", "torch_dtype", "dtype")
    out = {}
    for d in pool.drafts:
        cfg = json.loads((Path(d.path) / "config.json").read_text())
        out[d.name] = json.dumps({k: cfg.get(k) for k in keys}, sort_keys=True)
    return out


def calibrate(pool: PoolConfig, pool_path: str | None, prompts: Sequence[dict],
              max_new_tokens: int, out: Path,
              policies: Sequence[str] = ("target-only", "general-static-ungated",
                                         "memspec-ungated", "mab-async-ungated")
              ) -> CostModel:
    """Fit the cost model from traced requests of `policies` on `prompts` (training set);
    target-only runs give the target step its own samples (not only cold-start steps). The
    drafting policies run ungated: the model prices what a draft's iteration, a load and a
    ranking cost, and on a machine where no draft pays a gated run has none of them to time
    (the gate loads nothing and asks for no ranking until a draft pays: on the 2-core EPYC
    all four calibration requests of each policy ran the target and the lookup alone)."""
    # interleaved per prompt, the order flipped every other prompt: run policy by policy,
    # a drifting host priced each policy at its own hour (a head's iteration fit at 1.61
    # target steps where the same prompts interleaved ran at 1.39, and the simulator's
    # gated policies then kept the head closed where the real ones ran it)
    reqs = [RealRequest(pol, p["id"], p["domain"], p["prompt"], max_new_tokens)
            for i, p in enumerate(prompts)
            for pol in (policies if i % 2 == 0 else tuple(reversed(policies)))]
    runs = run_real(reqs, out, pool_path)
    stats = [r.stats for r in runs.values()]
    # the predictor's own time per ranking, over every answered snapshot (prompt-only and
    # prompt+recent alike); how long the decoder then waited follows from it in the simulator
    ranked = [ev.seconds for s in stats if s.trace is not None for ev in s.trace.rankings]
    predict_s = statistics.median(ranked) if ranked else 0.0
    cost = fit(stats, pool.N, catchup_timings(pool), predict_s, [d.name for d in pool.drafts],
               draft_architectures(pool))
    bw = [r.row["bandwidth_bytes_s"] for r in runs.values() if r.row.get("bandwidth_bytes_s")]
    cost.source.update(policies=list(policies), prompts=[p["id"] for p in prompts],
                       max_new_tokens=max_new_tokens,
                       bandwidth_bytes_s=statistics.median(bw) if bw else 0.0)
    _log(f"spec iteration {cost.mean_iteration_s * 1e3:.1f} ms, target step "
         f"{cost.mean_target_s * 1e3:.1f} ms (as run), load {statistics.fmean(cost.load_s.values()) * 1e3:.0f}"
         f" ms, ranking {cost.predict_s * 1e3:.1f} ms, between intervals "
         f"{cost.sched_s * 1e3:.2f} ms, predictor slowdown {cost.predictor_slowdown:+.3f}")
    return cost
