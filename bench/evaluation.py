"""`memspec bench`: real three-process runs are the headline; the simulator sits beside them.

1. A cost model measured on the real runtime (traced calibration requests, train prompts).
2. UCB's c for the MAB baselines swept on **dev** (`bench tune`'s grid, 0.001-3, which brackets it);
   nothing is tuned on dev2 (the old test split, read by many runs: a second dev set) or
   test2 (read once, only by an explicit `--split test2`).
3. The replay simulator (the decoder's own loop, policies and cache manager over the
   engine's acceptance tables, priced by the cost model) runs every policy on the dev2
   (or test2) prompts of every domain and on the mixed workload: per-domain tables, the
   exact optimum (the relaxed bound), oracle checks (oracle-dynamic >= oracle-static and
   >= every online policy, per domain), time breakdowns, time to the first draft token,
   sweeps.
4. Real runs through the three processes on a subset of dev2 and of mixed, policies
   interleaved per prompt, several repeats, target-only always beside, every drafting
   baseline with the speculation gate and (general-static, mab-async, memspec) without
   it, and lookup-only: GMEAN of per-prompt ratios, end to end (the headline: request
   start to last token, prefill and binds included) and steady, each with a bootstrap 95%
   interval; each policy's wall time split into parts that add up to it; the simulator's
   value of the steady statistic on the same prompts next to it (`sim_vs_real`).
5. The predictor's Table 2 (trained on train + dev, measured on dev2 and mixed) from the
   sidecar of the head the pool ranks with, beside the prompt's-domain rule and the
   majority rule.

The result records the commit it was measured on and whether the tree was clean.

`render` rewrites docs/RESULTS.md, the plots and the README's figures from a bench JSON
alone (`memspec bench --from-json docs/results/bench.json ...`).
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from memspec.bench import heldout, peers
from memspec.bench.calibrate import calibrate
from memspec.bench.figures import draw_all
from memspec.bench.realruns import (
    RealResult,
    interleaved,
    peer_runs,
    pinned_pool,
    run_fingerprint,
    run_real,
    variant,
)
from memspec.bench.report import summary_text, write_readme, write_results
from memspec.bench.stats import HEADLINE, Runs, headline_ratios
from memspec.common.config import PoolConfig, load_pool
from memspec.common.draftfiles import fingerprint_digest
from memspec.common.errors import ConfigError, MemspecError
from memspec.common.files import atomic_write_text, sha256_file
from memspec.common.machine import machine_info
from memspec.common.metrics import RunStats, Summary, gmean
from memspec.common.paths import memspec_home
from memspec.common.provenance import result_provenance, shown_path
from memspec.procs.decoder.oracle.replay import oracle_dynamic, oracle_static, pooled, replay_static
from memspec.procs.predictor.head import read_info
from memspec.procs.predictor.ranker import head_path_for
from memspec.sim.costmodel import CostModel
from memspec.sim.fanout import fan_out
from memspec.sim.optimum import optimum
from memspec.sim.scores import position_scores
from memspec.sim.simulate import SimConfig, SimRequest, simulate
from memspec.zoo.evaluate import pool_domains
from memspec.zoo.prompts import SPLITS, load_prompts, row_sources, split_name
from memspec.zoo.tablestore import (
    load_pool_tables,
    pool_fingerprint,
    runtime_dtype,
    runtime_key,
    trajectories_path,
    trajectory_rows,
)
from memspec.zoo.trace import prompt_set

POLICIES = ("general-static", "oracle-static", "mab-sync", "mab-async", "prediction-only",
            "memspec", "oracle-dynamic")
SIM_POLICIES = ("target-only", *POLICIES)
# bench variants (bench/realruns.py `variant`): a drafting policy's own name runs gated,
# `-ungated` without the gate
REAL_POLICIES = ("target-only", "target-only-1t", "lookup-only", "general-static",
                 "general-static-ungated", "oracle-static", "mab-async", "mab-async-ungated",
                 "prediction-only", "memspec", "memspec-ungated", "oracle-dynamic")
ONLINE = ("general-static", "mab-sync", "mab-async", "prediction-only", "memspec")
# real variants that oracle-dynamic must not trail (the baselines that plan no oracle)
NOT_ONLINE = ("target-only", "target-only-1t", "oracle-static", "oracle-dynamic")
NOT_SIMULATED = {"lookup-only": "real runs only: the simulator has no acceptance table of "
                                "the context lookup alone (sim/simulate.py refuses it)",
                 "target-only-1t": "real runs only: the cost model is timed with the "
                                   "decoder's own thread setting"}
UCB_C = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)  # `bench tune`'s grid too: it brackets
# the optimum on dev (~greedy at the bottom)
SWEEP_N = (2, 4, 8, 16)
SWEEP_LEN = (64, 128, 256)
SWEEP_K = (2, 3, 4)
SWEEP_RATIO = (1.0, 2.7, 5.0, 10.0)
# the wall clock of a request, in parts that add up to it (`wall_split`)
SPLIT = ("pre", "prefill", "draft", "catchup", "verify", "target_gated", "target_fallback",
         "load_wait", "bind", "prediction", "sched", "other")
SPLIT_GAP = 0.02  # the measured parts must explain the wall time of every run to this
EVAL_SETS = ("dev2", "mixed")
# what `memspec bench --split` may name: dev2 (the default) or test2, read once and counted
HELD_OUT = ("dev2", "test2")


@dataclass(frozen=True)
class Sizes:
    """How much of each prompt set a bench reads; the defaults are the full run."""

    sim_per_domain: int = 40  # dev2 (or test2) prompts per domain in the simulator
    sim_mixed: int = 60  # mixed prompts in the simulator
    dev_per_domain: int = 20  # dev prompts per domain for UCB's c
    real_per_domain: int = 10  # dev2 prompts per domain run for real (0: no real runs)
    real_mixed: int = 30  # mixed prompts run for real
    repeats: int = 2  # real runs per (prompt, policy)
    sweep_per_domain: int = 10  # dev2 prompts per domain in the sweeps
    peers_per_domain: int = 4  # dev2 prompts per domain run beside llama.cpp (0: none)
    # the set the figures are of besides mixed: dev2, a second dev set many runs read (the
    # key keeps its old name, "held_out"); test2 is read once, only when named
    held_out: str = "dev2"

    def trace_command(self) -> str:
        return (f"memspec trace --sets {self.held_out}:{self.sim_per_domain},"
                f"mixed:{self.sim_mixed},dev:{self.dev_per_domain}")

    def smaller_than_full(self) -> bool:
        full = Sizes()
        return any(getattr(self, k) < getattr(full, k) for k in full.__dataclass_fields__
                   if k != "held_out")


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- inputs


def set_prompts(pool: PoolConfig, which: str, count: int) -> list[dict]:
    """The first `count` prompts of each domain (mixed: `count` in all)."""
    return load_prompts(which, pool_domains(pool), count) if count > 0 else []


def traced_requests(pool: PoolConfig, which: str, count: int, scores: bool = True,
                    fix: str = "") -> list[SimRequest]:
    """The first `count` traced prompts (per domain; mixed: in all) of a set, with the
    predictor's ranking at every position when `scores`."""
    base = which.split("-L")[0]
    prompts = set_prompts(pool, base, count)
    if not prompts:
        return []
    tt = load_pool_tables(pool, which)
    rows = trajectory_rows(trajectories_path(pool, which, tt.dtype), [p["id"] for p in prompts])
    missing = [p["id"] for p in prompts if p["id"] not in rows or p["id"] not in tt.rows]
    if missing:
        raise ConfigError(f"{len(missing)} {which} prompts have no traces (e.g. {missing[0]})",
                          f"run `{fix or f'memspec trace --sets {base}:{count}'}`")
    ranked: dict[str, list[list[float]]] = {}
    if scores:
        ranked = position_scores(pool, [rows[p["id"]] for p in prompts],
                                 {p["id"]: p["prompt"] for p in prompts})
    names = [d.name for d in pool.drafts]
    out = []
    for p in prompts:
        probs = ranked.get(p["id"])

        def score(pos: int, probs=probs) -> dict[str, float] | None:
            return dict(zip(names, probs[min(pos, len(probs) - 1)])) if probs else None

        out.append(SimRequest(p["id"], p["domain"], len(rows[p["id"]]["prompt_ids"]),
                              tt.rows[p["id"]]["tables"], score if probs else None))
    return out


# kept for callers of the old name
def heldout_requests(pool: PoolConfig, per_domain: int, scores: bool = True,
                     which: str = "dev2") -> list[SimRequest]:
    return traced_requests(pool, which, per_domain, scores)


def sim_config(pool: PoolConfig, cost: CostModel | None = None, **kw: Any) -> SimConfig:
    cfg = SimConfig(tuple(d.name for d in pool.drafts), pool.general, pool.K, pool.N, pool.gamma,
                    pool.max_new_tokens, cost.plan_costs() if cost is not None else None,
                    pool.spec_gate, rank_horizon=pool.rank_horizon)
    return replace(cfg, **kw)


def split_info(sizes: Sizes | None = None) -> dict[str, Any]:
    """The committed prompt sets: counts, and whether they share any source (they must not)."""
    sources = {s: set() for s in SPLITS}
    counts = {}
    for s in SPLITS:
        rows = load_prompts(s)
        counts[s] = len(rows)
        for r in rows:
            sources[s].update(row_sources(r))
    # mixed prompts are built from dev2 sources by design: dev2/mixed may share
    shared = {f"{a}/{b}": len(sources[a] & sources[b]) for i, a in enumerate(SPLITS)
              for b in SPLITS[i + 1:] if {a, b} != {"dev2", "mixed"}}
    out: dict[str, Any] = {"kind": "source-disjoint", "counts": counts,
                           "shared_sources": shared,
                           "disjoint": all(v == 0 for v in shared.values()),
                           "tuned_on": "dev", "measured_on": list(EVAL_SETS)}
    if sizes is not None:
        out["used"] = {k: getattr(sizes, k) for k in sizes.__dataclass_fields__}
    return out


# --------------------------------------------------------------------------- aggregation


def _summary(s: RunStats | Summary) -> Summary:
    return s.report() if isinstance(s, RunStats) else s


def wall_split(s: Summary) -> dict[str, float]:
    """Seconds of one request's wall clock per part (SPLIT). A target step runs no draft
    and times only its verify, so `verify` here is the target's share of drafted
    iterations, and the target alone is split by why it ran: by choice (`target_gated`:
    target-only, a closed gate) or as fallback (nothing preferred resident)."""
    t = s.time
    return {"pre": t.pre, "prefill": t.prefill, "draft": t.draft, "catchup": t.catchup,
            "verify": t.verify - t.target_alone - t.target_fallback,
            "target_gated": t.target_alone, "target_fallback": t.target_fallback,
            "load_wait": t.load_wait, "bind": t.bind, "prediction": t.prediction,
            "sched": t.sched, "other": t.other}


def parts_gap(s: Summary) -> float | None:
    """|wall time - its measured parts| / wall time (None: no wall time). `other` is left
    out: the runtime books it as the remainder, so counting it would close any sum."""
    split, e2e = wall_split(s), s.time.e2e
    if e2e <= 0:
        return None
    return abs(e2e - sum(v for k, v in split.items() if k != "other")) / e2e


def aggregate(stats: Sequence[RunStats | Summary]) -> dict[str, Any]:
    """Pooled tokens/s (total tokens over total time), the wall-time split as shares of
    the wall time (`{part}_frac`) with how well its parts add up, and issue #10's shares
    of decode time (`*_of_decode`)."""
    sums = [_summary(s) for s in stats]
    tokens = sum(s.generated_tokens for s in sums)
    decode = sum(s.time.decode for s in sums)
    e2e = sum(s.time.e2e for s in sums)
    drafts = sum(s.num_drafts for s in sums)
    acc = sum(s.num_accepted_tokens for s in sums)
    out = {"tokens": tokens, "decode_s": decode, "e2e_s": e2e,
           "steady": tokens / decode if decode else 0.0, "e2e": tokens / e2e if e2e else 0.0,
           "mean_acceptance_length": 1 + acc / drafts if drafts else 1.0,
           "loads": sum(s.loads for s in sums), "runs": len(sums)}
    parts = [wall_split(s) for s in sums]
    for k in SPLIT:
        out[f"{k}_frac"] = sum(w[k] for w in parts) / e2e if e2e else 0.0
    # a non-preferred draft ran (inside draft, catch-up and verify above: another view)
    out["fallback_resident_frac"] = sum(s.time.fallback for s in sums) / e2e if e2e else 0.0
    fallback = sum(s.time.fallback + s.time.target_fallback for s in sums)
    out["fallback_of_decode"] = fallback / decode if decode else 0.0
    out["prediction_of_decode"] = sum(s.time.prediction for s in sums) / decode if decode \
        else 0.0
    # the predictor's own encoding for rankings after the prompt's (the prompt's overlaps
    # the prefill): what it takes from the decoder's cores, how often it ranked, how long
    own = sum(s.predictor_s for s in sums)
    later = sum(max(0, s.snapshots - 1) for s in sums)
    out["predictor_of_decode"] = own / decode if decode else 0.0
    out["snapshots_per_request"] = sum(s.snapshots for s in sums) / len(sums) if sums else 0.0
    out["predictor_s_per_ranking"] = own / later if later else None
    gaps = [g for g in map(parts_gap, sums) if g is not None]
    out["parts_gap_max"] = max(gaps) if gaps else None
    measured = sum(v for w in parts for k, v in w.items() if k != "other")
    out["parts_gap_pooled"] = abs(e2e - measured) / e2e if e2e else None
    return out


BREAKDOWN_KEYS = (*(f"{k}_frac" for k in SPLIT), "fallback_resident_frac",
                  "fallback_of_decode", "prediction_of_decode", "predictor_of_decode",
                  "snapshots_per_request", "predictor_s_per_ranking", "parts_gap_max",
                  "parts_gap_pooled")


def breakdown(stats: Sequence[RunStats | Summary]) -> dict[str, float | None]:
    """Where a policy's wall time goes: shares of it per part (they add up to 1), the worst
    run's gap between its measured parts and its wall time, and the fallback and
    prediction shares of decode time that issue #10's bounds are stated in."""
    a = aggregate(stats)
    return {k: a[k] for k in BREAKDOWN_KEYS}


def first_draft_token_s(stats: RunStats | Summary) -> float | None:
    """Request start -> the end of the first speculative iteration (None: no draft ran)."""
    if isinstance(stats, RunStats):
        recs = stats.records  # simulated: the request starts at 0
    elif stats.trace is not None:
        recs = stats.trace.iterations  # traced: times from the request's start
    else:
        return None
    return next((r.t_start + r.duration for r in recs if r.draft is not None), None)


def _median(xs: Iterable[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def by_domain(reqs: Sequence[SimRequest], stats: Sequence[RunStats | Summary]
              ) -> dict[str, dict[str, Any]]:
    doms = list(dict.fromkeys(r.domain for r in reqs))
    return {d: aggregate([s for r, s in zip(reqs, stats) if r.domain == d]) for d in doms}


def run_sim(name: str, reqs: Sequence[SimRequest], cost: CostModel, cfg: SimConfig,
            ucb_c: float = 2.0) -> list[RunStats]:
    return [simulate(name, r, cost, cfg, ucb_c) for r in reqs]


def ratios(table: Mapping[str, Mapping[str, Mapping[str, Any]]], base: str, key: str
           ) -> dict[str, dict[str, float]]:
    """{policy: {domain: x / base, ..., "GMEAN": gmean}} for tokens/s `key`."""
    out: dict[str, dict[str, float]] = {}
    for pol, doms in table.items():
        r = {d: v[key] / table[base][d][key] for d, v in doms.items() if table[base][d][key]}
        out[pol] = {**r, "GMEAN": gmean(list(r.values()))}
    return out


def evaluate_policies(reqs: Sequence[SimRequest], cost: CostModel, cfg: SimConfig,
                      ucb: Mapping[str, float], policies: Iterable[str] = POLICIES
                      ) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, list[RunStats]]]:
    per: dict[str, dict[str, dict[str, Any]]] = {}
    raw: dict[str, list[RunStats]] = {}
    for pol in policies:
        raw[pol] = run_sim(pol, reqs, cost, cfg, ucb.get(pol, 2.0))
        per[pol] = by_domain(reqs, raw[pol])
    return per, raw


def optimum_by_domain(reqs: Sequence[SimRequest], cost: CostModel, cfg: SimConfig,
                      target_only: bool = True) -> dict[str, dict[str, Any]]:
    """The exact optimum per domain: every trajectory searched on every core, each result
    kept on disk under its inputs and the search's code (a re-run reads it)."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 20000))
    code = sha256_file(Path(optimum.__code__.co_filename))[:16]
    keys = [hashlib.sha256(json.dumps(
        [code, cost.to_json(), cfg.K, cfg.N, cfg.gamma, cfg.max_new_tokens, r.prompt_len,
         target_only, {d: list(map(int, t)) for d, t in sorted(r.tables.items())}],
        sort_keys=True).encode()).hexdigest()[:24] for r in reqs]
    folder = memspec_home() / "sim_cache" / "optimum"
    cached = {k: json.loads(p.read_text()) for k in keys
              if (p := folder / f"{k}.json").is_file()}
    todo = [i for i, k in enumerate(keys) if k not in cached]

    def one(j: int) -> list[float]:
        r = reqs[todo[j]]
        o = optimum(r.tables, cost, cfg.K, cfg.N, cfg.gamma, cfg.max_new_tokens,
                    prompt_len=r.prompt_len, target_only=target_only)
        return [o.length, o.time_s]

    if todo:
        folder.mkdir(parents=True, exist_ok=True)
        for j, res in enumerate(fan_out(one, len(todo))):
            cached[keys[todo[j]]] = res
            atomic_write_text(folder / f"{keys[todo[j]]}.json", json.dumps(res))
    out: dict[str, dict[str, float]] = {}
    for dom in dict.fromkeys(r.domain for r in reqs):
        tok = t = 0.0
        for r, k in zip(reqs, keys):
            if r.domain == dom:
                tok, t = tok + cached[k][0], t + cached[k][1]
        out[dom] = {"steady": tok / t if t else 0.0, "tokens": tok, "decode_s": t}
    return out


def headline(per: Mapping[str, Mapping[str, Mapping[str, Any]]], opt: Mapping[str, Any],
             key: str = "steady") -> dict[str, float]:
    """GMEAN over domains of per-domain pooled ratios (the simulator's domain tables)."""
    def g(a: str, b: str | Mapping[str, Any]) -> float:
        other = per[b] if isinstance(b, str) else b
        return gmean([per[a][d][key] / other[d][key] for d in per[a]])

    pairs = {**HEADLINE,
             "oracle_dynamic_over_general_static": ("oracle-dynamic", "general-static"),
             "oracle_static_over_general_static": ("oracle-static", "general-static")}
    out = {k: g(a, b) for k, (a, b) in pairs.items() if a in per and b in per}
    if key == "steady" and opt:
        out["memspec_over_optimum"] = g("memspec", opt)
        out["oracle_dynamic_over_optimum"] = g("oracle-dynamic", opt)
        out["optimum_over_general_static"] = gmean(
            [opt[d]["steady"] / per["general-static"][d]["steady"] for d in opt])
    return out


def per_prompt_runs(ids: Sequence[str], stats: Sequence[RunStats | Summary],
                    key: str = "steady") -> dict[str, list[tuple[float, float]]]:
    """(tokens, seconds) of every run (repeat) per prompt id; seconds of decode (steady)
    or of the whole request (e2e)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for pid, s in zip(ids, stats):
        r = s.report() if isinstance(s, RunStats) else s
        sec = r.time.decode if key == "steady" else r.time.e2e
        out.setdefault(pid, []).append((float(r.generated_tokens), sec))
    return out


def oracle_checks(per: Mapping[str, Mapping[str, Mapping[str, Any]]], tol: float = 0.0
                  ) -> dict[str, Any]:
    """Per domain: oracle-dynamic >= oracle-static and >= every online policy (steady)."""
    out: dict[str, Any] = {"ok": True, "domains": {}}
    for dom in per.get("oracle-dynamic", {}):
        od = per["oracle-dynamic"][dom]["steady"]
        worse = {p: per[p][dom]["steady"] / od for p in ("oracle-static", *ONLINE)
                 if p in per and per[p][dom]["steady"] > od * (1 + tol)}
        out["domains"][dom] = {
            "oracle_dynamic_over_oracle_static": od / per["oracle-static"][dom]["steady"]
            if "oracle-static" in per else None,
            "beaten_by": worse}
        out["ok"] = out["ok"] and not worse
    return out


# --------------------------------------------------------------------------- the simulator


def ucb_sweep(reqs: Sequence[SimRequest], cost: CostModel, cfg: SimConfig
              ) -> dict[str, dict[str, float]]:
    """GMEAN steady tokens/s over general-static for every c, per MAB policy."""
    base = by_domain(reqs, run_sim("general-static", reqs, cost, cfg))
    out: dict[str, dict[str, float]] = {}
    for pol in ("mab-async", "mab-sync"):
        out[pol] = {}
        for c in UCB_C:
            doms = by_domain(reqs, run_sim(pol, reqs, cost, cfg, c))
            out[pol][str(c)] = gmean([doms[d]["steady"] / base[d]["steady"] for d in doms])
    return out


def sim_section(reqs: Sequence[SimRequest], cost: CostModel, cfg: SimConfig,
                ucb: Mapping[str, float], gamma: int, general: str, with_optimum: bool = True
                ) -> tuple[dict[str, Any], dict[str, list[RunStats]]]:
    """Every policy on one prompt set in the simulator."""
    per, raw = evaluate_policies(reqs, cost, cfg, ucb, SIM_POLICIES)
    ids = [r.prompt_id for r in reqs]
    strata = {r.prompt_id: r.domain for r in reqs}
    runs: Runs = {p: per_prompt_runs(ids, raw[p]) for p in raw}
    gm, ci = headline_ratios(runs, strata)
    out: dict[str, Any] = {
        "prompts": len(reqs),
        "domains": list(dict.fromkeys(r.domain for r in reqs)),
        "steady": {p: {d: v["steady"] for d, v in doms.items()} for p, doms in per.items()},
        "e2e": {p: {d: v["e2e"] for d, v in doms.items()} for p, doms in per.items()},
        "normalised_steady": ratios(per, "general-static", "steady"),
        "normalised_e2e": ratios(per, "general-static", "e2e"),
        "gmean": gm, "ci95": ci,
        "gmean_by_domain": headline(per, {}),
        "breakdown": {p: breakdown(raw[p]) for p in raw},
        "mean_acceptance_length": {p: aggregate(raw[p])["mean_acceptance_length"] for p in raw},
        "first_draft_token_s": {p: _median(first_draft_token_s(s) for s in raw[p])
                                for p in raw if p != "target-only"},
        "oracle_checks": oracle_checks(per),
        "headroom_mean_acceptance_length": headroom(reqs, gamma, general),
        "not_simulated": dict(NOT_SIMULATED),
    }
    if with_optimum:
        _log(f"optimum (dynamic programming) over {len(reqs)} trajectories")
        opt = optimum_by_domain(reqs, cost, cfg)
        opt_sd = optimum_by_domain(reqs, cost, cfg, target_only=False)
        out["optimum_steady"] = {d: v["steady"] for d, v in opt.items()}
        out["optimum_sd_steady"] = {d: v["steady"] for d, v in opt_sd.items()}
        out["gmean_by_domain"] = {**headline(per, opt), **sd_headline(per, opt_sd)}
    return out, raw


def sd_headline(per: Mapping[str, Mapping[str, Mapping[str, Any]]],
                opt_sd: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """Against the best schedule of speculative intervals only (no target-only steps while
    a draft is resident): how close the paper's policy space gets to its own optimum."""
    def g(a: str) -> float:
        return gmean([per[a][d]["steady"] / opt_sd[d]["steady"] for d in opt_sd])

    return {"memspec_over_optimum_sd": g("memspec"),
            "oracle_dynamic_over_optimum_sd": g("oracle-dynamic"),
            "optimum_sd_over_general_static": 1.0 / g("general-static")}


Variant = tuple[str, Any, Sequence[SimRequest], SimConfig, CostModel]


def sweep(ucb: Mapping[str, float], variants: Iterable[Variant]) -> list[dict[str, Any]]:
    rows = []
    for knob, value, reqs, c, cm in variants:
        per, _ = evaluate_policies(reqs, cm, c, ucb,
                                   ("target-only", "general-static", "mab-async", "memspec",
                                    "oracle-dynamic"))
        h = headline(per, {})
        rows.append({"knob": knob, "value": value, **{k: round(v, 4) for k, v in h.items()},
                     "memspec_fallback_frac": round(_frac(per["memspec"],
                                                          "fallback_of_decode"), 4)})
        _log(f"sweep {knob}={value}: memspec/mab-async {h['memspec_over_mab_async']:.3f}, "
             f"/general-static {h['memspec_over_general_static']:.3f}")
    return rows


def _frac(doms: Mapping[str, Mapping[str, Any]], key: str) -> float:
    """A share of decode time pooled over domains."""
    dec = sum(v["decode_s"] for v in doms.values())
    return sum(v[key] * v["decode_s"] for v in doms.values()) / dec if dec else 0.0


def headroom(reqs: Sequence[SimRequest], gamma: int, general: str) -> dict[str, Any]:
    """Acceptance the pool offers at all (mean acceptance length), per domain."""
    out: dict[str, Any] = {}
    for dom in dict.fromkeys(r.domain for r in reqs):
        rs = [r for r in reqs if r.domain == dom]
        gen = pooled([replay_static(r.tables, general, gamma) for r in rs])
        ost = pooled([oracle_static(r.tables, gamma)[1] for r in rs])
        odyn = pooled([oracle_dynamic(r.tables, gamma, 4) for r in rs])
        out[dom] = {"general": gen["mean_acceptance_length"],
                    "oracle_static": ost["mean_acceptance_length"],
                    "oracle_dynamic_unlimited": odyn["mean_acceptance_length"]}
    return out


def sweep_variants(pool: PoolConfig, reqs: Sequence[SimRequest], cfg: SimConfig,
                   cost: CostModel, per_domain: int, which: str = "dev2") -> list[Variant]:
    """N, output length, K and load/iteration; lengths beyond the traces need longer ones
    of the same set `which` (`memspec trace --sets dev2:N --max-new-tokens 256`), skipped
    with a note if absent."""
    ref = pool.general
    out: list[Variant] = [("N", n, reqs, replace(cfg, N=n), cost) for n in SWEEP_N]
    traced = max(r.length for r in reqs)
    for n in SWEEP_LEN:
        if n <= (cfg.max_new_tokens or traced):
            out.append(("max_new_tokens", n, reqs, replace(cfg, max_new_tokens=n), cost))
            continue
        try:
            long = traced_requests(pool, f"{which}-L{n}", per_domain,
                                   fix=f"memspec trace --sets {which}:{per_domain} "
                                       f"--max-new-tokens {n}")
        except ConfigError as exc:
            _log(f"sweep max_new_tokens={n} skipped: {exc}")
            continue
        out.append(("max_new_tokens", n, long, replace(cfg, max_new_tokens=n), cost))
    out += [("K", k, reqs, replace(cfg, K=k), cost) for k in SWEEP_K]
    for r in SWEEP_RATIO:
        cm = cost.with_load_ratio(r, ref)
        out.append(("load_over_iteration", r, reqs, replace(cfg, plan=cm.plan_costs()), cm))
    return out


def read_cost_model(path: Path) -> CostModel:
    """A cost model from a JSON file: a `memspec bench --json` result (its "cost_model"),
    the bench's cached costmodel.json (its "cost"), or a bare CostModel object."""
    try:
        raw = json.loads(Path(path).read_text())
        body = raw.get("cost_model") or raw.get("cost") or raw
        return CostModel.from_json(body)
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise ConfigError(f"cannot read a cost model from {path} ({type(exc).__name__}: {exc})",
                          "pass a `memspec bench --json` file, e.g. docs/results/bench.json") from None


def pool_digest(pool: PoolConfig) -> str:
    """What a head was trained for and what the runs used, in one comparable string."""
    return fingerprint_digest(pool_fingerprint(pool))


def head_provenance(pool: PoolConfig, info: Mapping[str, Any]) -> dict[str, Any]:
    """Which head the Table 2 is of, and whether its sidecar says it was trained for this
    pool (None: the sidecar does not say)."""
    theirs = info.get("pool_fingerprint")  # what `memspec predictor train` records
    if isinstance(theirs, dict):
        theirs = fingerprint_digest(theirs)
    ours = pool_digest(pool)
    return {"head": shown_path(head_path_for(pool)), "head_pool_fingerprint": theirs,
            "pool_fingerprint": ours, "head_for_this_pool": None if theirs is None
            else theirs == ours}


def predictor_metrics(pool: PoolConfig) -> dict[str, Any]:
    """Table 2 rows per evaluation set from the sidecar of the head this pool ranks with
    (procs/predictor/ranker.py `head_path_for`; trained on train + dev). A sidecar from
    before the rename names dev2 "test"."""
    try:
        info = read_info(head_path_for(pool))
    except MemspecError as exc:
        return {"note": f"no predictor figures: {exc}"}
    prov = head_provenance(pool, info)
    ev = info.get("evaluation")
    if not isinstance(ev, dict):
        return {**prov, "note": "the head predates its evaluation on held-out sets; "
                                "run `memspec predictor train`"}
    ev = {split_name(k): v for k, v in ev.items()}
    keep = ("prompt_only", "recent_only", "prompt_recent", "domain_rule", "majority",
            "runtime_head")
    out: dict[str, Any] = {"trained_on": info.get("train_set"), **prov}
    for s in EVAL_SETS:
        rows = ev.get(s) or {}
        out[s] = {k: {"top1": rows[k].get("top1"), "top2": rows[k].get("top2"),
                      "n": rows[k].get("n")} for k in keep if isinstance(rows.get(k), dict)}
    return out


# --------------------------------------------------------------------------- real runs


def _ratio_key(name: str) -> str:
    return name.replace("-", "_")


def oracle_bound(runs: Mapping[str, Runs], strata: Mapping[str, str],
                 policies: Sequence[str]) -> dict[str, Any]:
    """Every online variant over oracle-dynamic, per clock ({"e2e": runs, "steady": ...}),
    with CI95; `worst` is the ratio with the highest upper bound (an unknown bound counts
    as the highest): oracle-dynamic is at or above them all when it is <= 1."""
    pairs = {f"{_ratio_key(p)}_over_oracle_dynamic": (p, "oracle-dynamic")
             for p in policies if p not in NOT_ONLINE}
    out: dict[str, Any] = {}
    for clock, by_policy in runs.items():
        gm, ci = headline_ratios(by_policy, strata, pairs)

        def upper(k: str, ci: dict[str, list[float]] = ci) -> float:
            hi = ci[k][1]
            return hi if hi == hi else math.inf

        worst = max(gm, key=upper, default=None)
        out[clock] = {"gmean": gm, "ci95": ci,
                      "worst": None if worst is None else
                      {"ratio": worst, "gmean": gm[worst], "ci95": ci[worst]}}
    return out


def sim_variant(name: str, cfg: SimConfig, ucb: Mapping[str, float]
                ) -> tuple[str, SimConfig, float]:
    """A bench variant as the simulator runs it: its policy, its gate, its UCB c."""
    policy, gate = variant(name)
    return (policy, cfg if gate is None else replace(cfg, gate=gate),
            ucb.get(name, ucb.get(policy, 2.0)))


def sim_beside(reqs: Sequence[SimRequest], real: Mapping[str, Any], policies: Sequence[str],
               cost: CostModel, cfg: SimConfig, ucb: Mapping[str, float]) -> dict[str, Any]:
    """The simulator on exactly the real runs' prompts, the same (steady) statistic; the
    variants it cannot run are named with why."""
    strata = {r.prompt_id: r.domain for r in reqs}
    simulated = [p for p in policies if p not in NOT_SIMULATED]
    sim_raw = {}
    for p in simulated:
        policy, c, u = sim_variant(p, cfg, ucb)
        sim_raw[p] = run_sim(policy, reqs, cost, c, u)
    sim_gm, _ = headline_ratios({p: per_prompt_runs([r.prompt_id for r in reqs], sim_raw[p])
                                 for p in simulated}, strata, n=0)
    gm = real["gmean"]
    sim_steady = {p: aggregate(sim_raw[p])["steady"] for p in simulated}
    return {"ratios": {k: {"real": gm[k], "sim": sim_gm.get(k),
                           "rel_error": sim_gm[k] / gm[k] - 1 if gm.get(k) else None}
                       for k in gm if k in sim_gm},
            "policies": {p: {"real_steady": real["steady"][p], "sim_steady": sim_steady[p],
                             "rel_error": sim_steady[p] / real["steady"][p] - 1
                             if real["steady"][p] else None} for p in simulated},
            "not_simulated": {p: NOT_SIMULATED[p] for p in policies if p in NOT_SIMULATED}}


def real_section(reqs: Sequence[SimRequest], rows: Mapping[str, RealResult],
                 keys: Sequence[tuple[str, str, str]], cost: CostModel, cfg: SimConfig,
                 ucb: Mapping[str, float], trajs: Mapping[str, Mapping[str, Any]]
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(real figures, the simulator beside them) for one prompt set; `keys` are (cache
    key, variant, prompt id) of its runs, `trajs` the traced greedy trajectories by id.
    Every headline ratio comes end to end (the headline) and steady, each with CI95."""
    strata = {r.prompt_id: r.domain for r in reqs}
    policies = list(dict.fromkeys(p for _, p, _ in keys))
    stats = {p: [rows[k].stats for k, pol, _ in keys if pol == p] for p in policies}
    ids = {p: [pid for _, pol, pid in keys if pol == p] for p in policies}
    runs = {clock: {p: per_prompt_runs(ids[p], stats[p], clock) for p in policies}
            for clock in ("e2e", "steady")}
    gm_e2e, ci_e2e = headline_ratios(runs["e2e"], strata)
    gm, ci = headline_ratios(runs["steady"], strata)
    mismatches = sum(1 for k, _p, pid in keys
                     if rows[k].token_ids != trajs[pid]["tokens"][:cfg.max_new_tokens or None])
    agg = {p: aggregate(stats[p]) for p in policies}
    real: dict[str, Any] = {
        "prompts": len(reqs), "runs": len(keys),
        "repeats": max((rows[k].row.get("repeat", 0) for k, *_ in keys), default=0) + 1,
        "gmean_e2e": gm_e2e, "ci95_e2e": ci_e2e, "gmean": gm, "ci95": ci,
        "oracle_bound": oracle_bound(runs, strata, policies),
        "variants": {p: dict(zip(("policy", "gate"), variant(p))) for p in policies},
        "e2e": {p: agg[p]["e2e"] for p in policies},
        "steady": {p: agg[p]["steady"] for p in policies},
        "mean_acceptance_length": {p: agg[p]["mean_acceptance_length"] for p in policies},
        "breakdown": {p: breakdown(stats[p]) for p in policies},
        "first_draft_token_s": {p: _median(first_draft_token_s(s) for s in stats[p])
                                for p in policies if variant(p)[0] != "target-only"},
        "token_mismatches": mismatches,
    }
    return real, sim_beside(reqs, real, policies, cost, cfg, ucb)


def first_per_domain(reqs: Sequence[SimRequest], n: int) -> list[SimRequest]:
    taken: dict[str, int] = {}
    out = []
    for r in reqs:
        if taken.get(r.domain, 0) < n:
            taken[r.domain] = taken.get(r.domain, 0) + 1
            out.append(r)
    return out


def _interleave_sets(groups: Sequence[Sequence[dict]]) -> list[dict]:
    """Prompts of several lists alternated (domains and mixed spread over the run)."""
    out, i = [], 0
    while any(i < len(g) for g in groups):
        out += [g[i] for g in groups if i < len(g)]
        i += 1
    return out


# --------------------------------------------------------------------------- the bench


def calibrated_dir(home: Path, pool_path: str | None) -> Path:
    """Where the cost model and the pinned pool of this pool, head, numerics and code live
    (bench/realruns.py `run_fingerprint`): made for anything else, they are never read."""
    return home / "calibrated" / run_fingerprint(pool_path)


def _cost_model(pool: PoolConfig, pool_path: str | None, home: Path, recalibrate: bool,
                cost_model: Path | None, max_new: int) -> tuple[CostModel, str | None]:
    """The cost model (cached per pool and code, or from a file, or measured) and the
    pool file the real runs use (pinned edge-emulated bandwidth and load/iteration)."""
    fp = pool_fingerprint(pool)
    keyed = calibrated_dir(home, pool_path)
    cost_path, pinned = keyed / "costmodel.json", keyed / "pool-pinned.toml"
    if recalibrate:  # new costs, new bandwidth: earlier real runs no longer compare
        for old in (cost_path, pinned, home / "calibration.jsonl", home / "real.jsonl"):
            old.unlink(missing_ok=True)
    real_pool = str(pinned) if pinned.is_file() else pool_path
    cost = read_cost_model(cost_model) if cost_model else None
    if cost is not None:
        _log(f"cost model from {cost_model} (no calibration)")
    elif cost_path.is_file():
        cached = json.loads(cost_path.read_text())
        if cached.get("fingerprint") == fp and cached.get("storage") == pool.storage \
                and cached.get("numerics") == runtime_key(pool):
            cost = CostModel.from_json(cached["cost"])
            if not cost.mean_iteration_s:  # fitted from gated runs that never drafted
                cost = None
    if cost is None:
        train = prompt_set(pool, "train", 0)
        calib = [next(p for p in train if p["domain"] == d) for d in pool_domains(pool)]
        cost = calibrate(pool, real_pool, calib, max_new, home / "calibration.jsonl")
        if not cost.mean_iteration_s:
            raise MemspecError("the calibration requests timed no draft iteration",
                               "check that the pool's drafts load (`memspec status`), then "
                               "run `memspec bench --recalibrate`")
        keyed.mkdir(parents=True, exist_ok=True)
        cost_path.write_text(json.dumps({"fingerprint": fp, "storage": pool.storage,
                                         "numerics": runtime_key(pool),
                                         "cost": cost.to_json()}, indent=2))
    bw = float(cost.source.get("bandwidth_bytes_s") or 0.0)
    if not pinned.is_file() and pool.storage == "edge-emulated" and bw > 0:
        real_pool = pinned_pool(pool_path, bw, pinned, cost.load_over_iteration(pool.general))
    return cost, real_pool


def run(pool_path: str | None, sizes: Sizes, max_new: int, recalibrate: bool = False,
        sweeps: bool = True, cost_model: Path | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    prov = result_provenance(pool_path)  # the code as the run starts: what its figures measure
    wall: dict[str, float] = {}
    pool = replace(load_pool(pool_path), max_new_tokens=max_new)
    home = memspec_home() / "bench"
    fix = sizes.trace_command()
    held = sizes.held_out
    reads = heldout.record_read(held, prov)  # before any figure: a read is a read
    dev = traced_requests(pool, "dev", sizes.dev_per_domain, scores=False, fix=fix)
    sets = {held: traced_requests(pool, held, sizes.sim_per_domain, fix=fix),
            "mixed": traced_requests(pool, "mixed", sizes.sim_mixed, fix=fix)
            if sizes.sim_mixed else []}
    sets = {k: v for k, v in sets.items() if v}
    wall["inputs"] = time.perf_counter() - t0

    t = time.perf_counter()
    cost, real_pool = _cost_model(pool, pool_path, home, recalibrate, cost_model, max_new)
    wall["calibration"] = time.perf_counter() - t
    cfg = sim_config(pool, cost)
    load_ratio = cost.load_over_iteration(pool.general)
    _log(f"cost model: load/iteration {load_ratio:.2f}")

    t = time.perf_counter()
    ucb = ucb_sweep(dev, cost, cfg) if dev else {}
    best_c = {pol: float(max(v, key=lambda c: v[c])) for pol, v in ucb.items()}
    _log(f"UCB c on dev: best {best_c}")
    sim: dict[str, Any] = {}
    for which, reqs in sets.items():
        _log(f"simulator: {len(reqs)} {which} prompts x {len(SIM_POLICIES)} policies")
        sim[which], _ = sim_section(reqs, cost, cfg, best_c, pool.gamma, pool.general)
    wall["simulator"] = time.perf_counter() - t
    result: dict[str, Any] = {
        "provenance": prov, "pool_fingerprint": pool_digest(pool),
        "real_policies": list(REAL_POLICIES),
        "machine": machine_info(), "storage": pool.storage, "dtype": runtime_dtype(pool),
        "numerics": runtime_key(pool),
        "load_over_iteration": load_ratio, "K": pool.K, "N": pool.N, "gamma": pool.gamma,
        "max_new_tokens": max_new, "drafts": [d.name for d in pool.drafts],
        "draft_kinds": sorted({_draft_kind(d.path) for d in pool.drafts}),
        "split": split_info(sizes), "smoke": sizes.smaller_than_full(),
        "cost_model": cost.to_json(), "ucb_c_sweep": ucb, "ucb_c_best": best_c,
        "ucb_c_tuned_on": f"dev ({len(dev)} prompts)", "sim": sim,
        "held_out": held, **({"held_out_reads": reads} if reads is not None else {}),
    }
    if sweeps and held in sets:
        t = time.perf_counter()
        sub = first_per_domain(sets[held], sizes.sweep_per_domain)
        result["sweeps"] = sweep(best_c, sweep_variants(pool, sub, cfg, cost,
                                                        sizes.sweep_per_domain, held))
        wall["sweeps"] = time.perf_counter() - t
    if sizes.real_per_domain > 0 or sizes.real_mixed > 0:
        t = time.perf_counter()
        result.update(real_runs(pool, real_pool, sets, sizes, cost, cfg, best_c, max_new, home))
        wall["real"] = time.perf_counter() - t
    result["predictor"] = predictor_metrics(pool)
    wall["total"] = time.perf_counter() - t0
    result["wall_s"] = {k: round(v, 1) for k, v in wall.items()}
    result["estimate_full_run"] = estimate(result, sizes)
    return result


def _draft_kind(path: Path) -> str:
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("memspec_kind", "model")
    except (OSError, ValueError):
        return "model"


def real_runs(pool: PoolConfig, real_pool: str | None, sets: Mapping[str, list[SimRequest]],
              sizes: Sizes, cost: CostModel, cfg: SimConfig, ucb: Mapping[str, float],
              max_new: int, home: Path) -> dict[str, Any]:
    """Every REAL_POLICIES request on the real subsets, interleaved, then the figures."""
    held = sizes.held_out
    subsets = {held: first_per_domain(sets.get(held, []), sizes.real_per_domain),
               "mixed": list(sets.get("mixed", []))[:sizes.real_mixed]}
    subsets = {k: v for k, v in subsets.items() if v}
    prompts = {p["id"]: p for s in subsets
               for p in set_prompts(pool, s, sizes.sim_per_domain if s == held
                                    else sizes.sim_mixed)}
    groups = [[prompts[r.prompt_id] for r in subsets[held] if r.domain == d]
              for d in pool_domains(pool)] if held in subsets else []
    groups.append([prompts[r.prompt_id] for r in subsets.get("mixed", [])])
    order = _interleave_sets(groups)
    reqs = interleaved(order, REAL_POLICIES, max_new, sizes.repeats, dict(ucb))
    _log(f"real runs: {len(order)} prompts x {len(REAL_POLICIES)} policies x "
         f"{sizes.repeats} repeats = {len(reqs)} requests")
    rows = run_real(reqs, home / "real.jsonl", real_pool)
    out: dict[str, Any] = {"real": {}, "sim_vs_real": {}}
    for which, sub in subsets.items():
        ids = {r.prompt_id for r in sub}
        keys = [(q.key, q.policy, q.prompt_id) for q in reqs if q.prompt_id in ids]
        trajs = trajectory_rows(trajectories_path(pool, which, runtime_key(pool)), ids)
        out["real"][which], out["sim_vs_real"][which] = real_section(
            sub, rows, keys, cost, cfg, ucb, trajs)
    out["sim_vs_real"]["max_rel_error"] = max_rel_error(out["sim_vs_real"])
    e2e = [r.stats.time.e2e for r in rows.values()]
    out["real_request_s"] = statistics.fmean(e2e) if e2e else None
    # the real runs above share one decoder (slots emptied per request); beside them,
    # memspec as a fresh decoder's first request, on the held-out set's first prompt per
    # domain
    first = [prompts[r.prompt_id] for r in first_per_domain(subsets.get(held, []), 1)]
    if first:
        from memspec.bench.floor import first_requests

        _log(f"first requests: {len(first)} {held} prompts, memspec and target-only, "
             "a fresh process each")
        out["cold_decoder"] = first_requests(
            [{"id": p["id"], "domain": p["domain"], "prompt": p["prompt"]} for p in first],
            real_pool, max_new, max(1, sizes.repeats))
    chosen = first_per_domain(subsets.get(held, []), sizes.peers_per_domain)
    if sizes.peers_per_domain > sizes.real_per_domain and chosen:
        _log(f"peers: {sizes.real_per_domain} {held} prompts per domain, the real runs' "
             f"(--real-per-domain), not {sizes.peers_per_domain}")
    # domains alternated, as in the real runs: a draft's load is paid per domain change
    beside = _interleave_sets([[prompts[r.prompt_id] for r in chosen if r.domain == d]
                               for d in pool_domains(pool)])
    why = peers.unavailable(pool.target) if beside else None
    if beside and why is None:
        _log(f"peers: {len(beside)} {held} prompts, memspec and target-only beside llama.cpp")
        t = time.perf_counter()
        out["peers"] = peer_runs(beside, real_pool, max_new, pool.gamma, home / "peers.jsonl")
        out["peers"]["wall_s"] = time.perf_counter() - t
    elif beside:
        _log(f"no peers: {why}")
    return out


def max_rel_error(beside: Mapping[str, Any]) -> float | None:
    errs = [abs(v["rel_error"]) for s in beside.values() if isinstance(s, dict)
            for v in s.get("ratios", {}).values() if v.get("rel_error") is not None]
    return max(errs) if errs else None


def estimate(result: Mapping[str, Any], sizes: Sizes) -> dict[str, Any]:
    """The full run's duration (default sizes), scaled from what this run measured."""
    full, wall = Sizes(), result.get("wall_s", {})
    per_req = result.get("real_request_s")
    n_full = (5 * full.real_per_domain + full.real_mixed) * len(REAL_POLICIES) * full.repeats
    sim_n = sum(v["prompts"] for v in result.get("sim", {}).values()) or 1
    sim_s = wall.get("simulator", 0.0) * (5 * full.sim_per_domain + full.sim_mixed) / sim_n
    sweep_s = wall.get("sweeps", 0.0) * full.sweep_per_domain / max(1, sizes.sweep_per_domain)
    # a real request also pays supervisor and reply overheads besides its e2e (~0.3 s)
    real_s = n_full * ((per_req or 2.5) + 0.3)
    # llama.cpp beside memspec: as long as this run's took, per prompt (0 when cached)
    ran = result.get("peers") or {}
    peers_s = ran.get("wall_s", 0.0) * 5 * full.peers_per_domain / max(1, ran.get("prompts", 1))
    total = real_s + sim_s + sweep_s + peers_s + wall.get("calibration", 0.0)
    return {"real_requests": n_full, "real_min": round(real_s / 60, 1),
            "peers_min": round(peers_s / 60, 1),
            "simulator_min": round(sim_s / 60, 1), "sweeps_min": round(sweep_s / 60, 1),
            "total_min": round(total / 60, 1),
            "note": "excludes tracing and predictor embedding (`memspec trace`, "
                    "`memspec predictor train`); scaled from this run's timings"}


def render(result: dict[str, Any], plots: Path | None, results: Path | None,
           readme: Path | None, source: Path | None = None) -> None:
    """Plots, RESULTS.md and the README's figures block, from a result alone (`source`:
    the JSON it is kept in)."""
    drawn = draw_all(result, plots) if plots else []
    for path in drawn:
        _log(f"wrote {path}")
    if results:
        write_results(result, results, plots, drawn, source)
    if readme:
        write_readme(result, readme, plots, drawn)


def main_bench(args) -> int:
    if getattr(args, "from_json", None):
        result = json.loads(Path(args.from_json).read_text())
    else:
        sizes = Sizes(sim_per_domain=args.prompts_per_domain, sim_mixed=args.mixed,
                      dev_per_domain=args.dev_per_domain,
                      real_per_domain=args.real_per_domain, real_mixed=args.real_mixed,
                      repeats=args.repeats,
                      peers_per_domain=getattr(args, "peers_per_domain",
                                               Sizes().peers_per_domain),
                      sweep_per_domain=min(Sizes().sweep_per_domain, args.prompts_per_domain),
                      held_out=getattr(args, "split", None) or "dev2")
        if sizes.held_out not in HELD_OUT:
            raise ConfigError(f"memspec bench measures dev2 or test2, not {sizes.held_out}",
                              "use --split dev2 (the default) or --split test2 (read once)")
        if sizes.repeats < 1:
            raise ConfigError(f"--repeats {sizes.repeats} is below 1", "use --repeats 2")
        if sizes.peers_per_domain < 0:
            raise ConfigError(f"--peers-per-domain {sizes.peers_per_domain} is below 0",
                              "use --peers-per-domain 4 (0: no llama.cpp runs)")
        result = run(getattr(args, "pool", None), sizes, args.max_new_tokens or 128,
                     args.recalibrate, not args.no_sweeps,
                     Path(args.cost_model) if args.cost_model else None)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(_finite(result), indent=2))
    render(result, Path(args.plots) if args.plots else None,
           Path(args.results) if args.results else None,
           Path(args.readme) if getattr(args, "readme", None) else None,
           Path(src) if (src := getattr(args, "from_json", None) or getattr(args, "json", None))
           else None)
    print(summary_text(result))
    return 0


def _finite(obj: Any) -> Any:
    """NaN/inf as null: the JSON stays valid for every reader."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
