"""`memspec bench`: the paper's four questions answered on our pool (ARCHITECTURE.md §7).

1. a cost model measured on the real runtime (traced calibration requests, training prompts);
2. every policy on every held-out domain through the replay simulator (same policy and
   cache-manager code as the decoder), normalised to general-static, plus the exact optimum;
3. time breakdowns, sweeps (N, output length, K, load/iteration), UCB's c for the baselines;
4. real end-to-end runs through the three processes on the same prompts, to validate the
   simulator per policy (and to check every run's tokens against the target's greedy ones).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from memspec.bench.calibrate import calibrate
from memspec.bench.figures import draw_all
from memspec.bench.realruns import RealRequest, pinned_pool, run_real
from memspec.bench.report import summary_text, write_results
from memspec.common.config import PoolConfig, load_pool
from memspec.common.errors import ConfigError
from memspec.common.machine import machine_info
from memspec.common.metrics import RunStats, Summary, gmean
from memspec.common.paths import memspec_home
from memspec.procs.decoder.replay import oracle_dynamic, oracle_static, pooled, replay_static
from memspec.procs.predictor.head import default_head_path, read_info
from memspec.sim.costmodel import CostModel
from memspec.sim.optimum import optimum
from memspec.sim.scores import position_scores
from memspec.sim.simulate import SimConfig, SimRequest, simulate
from memspec.zoo.evaluate import pool_domains, split_prompts
from memspec.zoo.tablestore import (
    load_pool_tables,
    pool_fingerprint,
    trajectories_path,
    trajectory_rows,
)
from memspec.zoo.trace import prompt_set

POLICIES = ("general-static", "oracle-static", "mab-sync", "mab-async", "prediction-only",
            "memspec", "oracle-dynamic")
UCB_C = (0.1, 0.5, 1.0, 2.0, 3.0)
BREAKDOWN = ("general-static", "prediction-only", "mab-async", "memspec")
SWEEP_N = (2, 4, 8, 16)
SWEEP_LEN = (64, 128, 256)
SWEEP_K = (2, 3, 4)
SWEEP_RATIO = (1.0, 2.7, 5.0, 10.0)
TIME_KEYS = ("desired", "fallback", "target_fallback", "load_wait", "prediction", "catchup")


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- inputs


def heldout_requests(pool: PoolConfig, per_domain: int, scores: bool = True,
                     which: str = "test") -> list[SimRequest]:
    """The first `per_domain` traced prompts of each domain of a split, with rankings."""
    tt = load_pool_tables(pool, which)
    prompts = split_prompts(which.split("-L")[0], pool_domains(pool), per_domain)
    rows = trajectory_rows(trajectories_path(pool, which), [p["id"] for p in prompts])
    picked = [p for p in prompts if p["id"] in rows and p["id"] in tt.rows]
    if len(picked) < len(prompts):
        raise ConfigError(f"{len(prompts) - len(picked)} {which} prompts have no tables",
                          f"run `memspec trace --per-domain {per_domain}`")
    ranked: dict[str, list[list[float]]] = {}
    if scores:
        ranked = position_scores(pool, [rows[p["id"]] for p in picked],
                                 {p["id"]: p["prompt"] for p in picked})
    names = [d.name for d in pool.drafts]
    out = []
    for p in picked:
        probs = ranked.get(p["id"])

        def score(pos: int, probs=probs) -> dict[str, float] | None:
            if not probs:
                return None
            return dict(zip(names, probs[min(pos, len(probs) - 1)]))

        out.append(SimRequest(p["id"], p["domain"], len(rows[p["id"]]["prompt_ids"]),
                              tt.rows[p["id"]]["tables"], score if probs else None))
    return out


def sim_config(pool: PoolConfig, **kw: Any) -> SimConfig:
    cfg = SimConfig(tuple(d.name for d in pool.drafts), pool.general, pool.K, pool.N, pool.gamma,
                    pool.max_new_tokens)
    return replace(cfg, **kw)


# --------------------------------------------------------------------------- aggregation


def aggregate(stats: Sequence[RunStats | Summary]) -> dict[str, Any]:
    """Pooled tokens/s (total tokens over total time) and the time breakdown fractions."""
    sums = [s.report() if isinstance(s, RunStats) else s for s in stats]
    tokens = sum(s.generated_tokens for s in sums)
    decode = sum(s.time.decode for s in sums)
    e2e = sum(s.time.e2e for s in sums)
    drafts = sum(s.num_drafts for s in sums)
    acc = sum(s.num_accepted_tokens for s in sums)
    out = {"tokens": tokens, "decode_s": decode, "e2e_s": e2e,
           "steady": tokens / decode if decode else 0.0, "e2e": tokens / e2e if e2e else 0.0,
           "mean_acceptance_length": 1 + acc / drafts if drafts else 1.0,
           "loads": sum(s.loads for s in sums)}
    for k in TIME_KEYS:
        out[f"{k}_frac"] = sum(getattr(s.time, k) for s in sums) / decode if decode else 0.0
    return out


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
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 20000))
    out: dict[str, dict[str, float]] = {}
    for dom in dict.fromkeys(r.domain for r in reqs):
        tok = t = 0.0
        for r in (x for x in reqs if x.domain == dom):
            o = optimum(r.tables, cost, cfg.K, cfg.N, cfg.gamma, cfg.max_new_tokens,
                        prompt_len=r.prompt_len, target_only=target_only)
            tok, t = tok + o.length, t + o.time_s
        out[dom] = {"steady": tok / t if t else 0.0, "tokens": tok, "decode_s": t}
    return out


# --------------------------------------------------------------------------- the bench


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


def headline(per: Mapping[str, Mapping[str, Mapping[str, Any]]], opt: Mapping[str, Any],
             key: str = "steady") -> dict[str, float]:
    def g(a: str, b: str | Mapping[str, Any]) -> float:
        other = per[b] if isinstance(b, str) else b
        return gmean([per[a][d][key] / other[d][key] for d in per[a]])

    pairs = {"memspec_over_mab_async": ("memspec", "mab-async"),
             "memspec_over_oracle_dynamic": ("memspec", "oracle-dynamic"),
             "memspec_over_general_static": ("memspec", "general-static"),
             "oracle_dynamic_over_general_static": ("oracle-dynamic", "general-static"),
             "oracle_static_over_general_static": ("oracle-static", "general-static")}
    out = {k: g(a, b) for k, (a, b) in pairs.items() if a in per and b in per}
    if key == "steady" and opt:
        out["memspec_over_optimum"] = g("memspec", opt)
        out["oracle_dynamic_over_optimum"] = g("oracle-dynamic", opt)
        out["optimum_over_general_static"] = gmean(
            [opt[d]["steady"] / per["general-static"][d]["steady"] for d in opt])
    return out


Variant = tuple[str, Any, Sequence[SimRequest], SimConfig, CostModel]


def sweep(ucb: Mapping[str, float], variants: Iterable[Variant]) -> list[dict[str, Any]]:
    rows = []
    for knob, value, reqs, c, cm in variants:
        per, _ = evaluate_policies(reqs, cm, c, ucb,
                                   ("general-static", "mab-async", "memspec", "oracle-dynamic"))
        h = headline(per, {})
        rows.append({"knob": knob, "value": value, **{k: round(v, 4) for k, v in h.items()},
                     "memspec_fallback_frac": round(_frac(per["memspec"], "fallback"), 4)})
        _log(f"sweep {knob}={value}: memspec/mab-async {h['memspec_over_mab_async']:.3f}, "
             f"/general-static {h['memspec_over_general_static']:.3f}")
    return rows


def _frac(doms: Mapping[str, Mapping[str, Any]], key: str) -> float:
    dec = sum(v["decode_s"] for v in doms.values())
    return sum(v[f"{key}_frac"] * v["decode_s"] for v in doms.values()) / dec if dec else 0.0


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


def read_cost_model(path: Path) -> CostModel:
    """A cost model from a JSON file: a `memspec bench --json` result (its "cost_model"),
    the bench's cached costmodel.json (its "cost"), or a bare CostModel object."""
    try:
        raw = json.loads(Path(path).read_text())
        body = raw.get("cost_model") or raw.get("cost") or raw
        return CostModel.from_json(body)
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise ConfigError(f"cannot read a cost model from {path} ({type(exc).__name__}: {exc})",
                          "pass a `memspec bench --json` file, e.g. docs/bench.json") from None


def run(pool_path: str | None, per_domain: int, real_per_domain: int, max_new: int,
        recalibrate: bool = False, sweeps: bool = True,
        cost_model: Path | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    pool = replace(load_pool(pool_path), max_new_tokens=max_new)
    home = memspec_home() / "bench"
    fp = pool_fingerprint(pool)
    reqs = heldout_requests(pool, per_domain)
    cfg = sim_config(pool)

    cost_path = home / "costmodel.json"
    if recalibrate:  # new costs, new bandwidth: earlier real runs no longer compare
        for old in ("costmodel.json", "calibration.jsonl", "real.jsonl", "pool-pinned.toml"):
            (home / old).unlink(missing_ok=True)
    # every real run of one benchmark (calibration and validation) loads drafts at one
    # edge-emulated bandwidth: the first calibration's, pinned in pool-pinned.toml
    pinned = home / "pool-pinned.toml"
    real_pool = str(pinned) if pinned.is_file() else pool_path
    cost = read_cost_model(cost_model) if cost_model else None
    if cost is not None:
        _log(f"cost model from {cost_model} (no calibration)")
    elif cost_path.is_file() and not recalibrate:
        cached = json.loads(cost_path.read_text())
        if cached.get("fingerprint") == fp and cached.get("storage") == pool.storage:
            cost = CostModel.from_json(cached["cost"])
    if cost is None:
        train = prompt_set(pool, "train", 0)
        calib = [next(p for p in train if p["domain"] == d)
                 for d in dict.fromkeys(r.domain for r in reqs)]
        cost = calibrate(pool, real_pool, calib, max_new, home / "calibration.jsonl")
        home.mkdir(parents=True, exist_ok=True)
        cost_path.write_text(json.dumps({"fingerprint": fp, "storage": pool.storage,
                                         "cost": cost.to_json()}, indent=2))
    ref = pool.general
    load_ratio = cost.load_s[ref] / (cost.mean_iteration_s or cost.spec_s[ref])
    _log(f"cost model: load/iteration {load_ratio:.2f}")

    ucb = ucb_sweep(reqs, cost, cfg)
    best_c = {pol: float(max(v, key=lambda c: v[c])) for pol, v in ucb.items()}
    _log(f"UCB c sweep: best {best_c}")
    per, raw = evaluate_policies(reqs, cost, cfg, best_c, ("target-only", *POLICIES))
    _log("optimum (dynamic programming) per trajectory")
    opt = optimum_by_domain(reqs, cost, cfg)
    opt_sd = optimum_by_domain(reqs, cost, cfg, target_only=False)
    result: dict[str, Any] = {
        "machine": machine_info(), "storage": pool.storage, "load_over_iteration": load_ratio,
        "K": pool.K, "N": pool.N, "gamma": pool.gamma, "max_new_tokens": max_new,
        "prompts_per_domain": per_domain, "cost_model": cost.to_json(),
        "ucb_c_sweep": ucb, "ucb_c_best": best_c,
        "steady": {p: {d: v["steady"] for d, v in doms.items()} for p, doms in per.items()},
        "e2e": {p: {d: v["e2e"] for d, v in doms.items()} for p, doms in per.items()},
        "optimum_steady": {d: v["steady"] for d, v in opt.items()},
        "optimum_sd_steady": {d: v["steady"] for d, v in opt_sd.items()},
        "normalised_steady": ratios(per, "general-static", "steady"),
        "normalised_e2e": ratios(per, "general-static", "e2e"),
        "gmean": {**headline(per, opt), **sd_headline(per, opt_sd)},
        "gmean_e2e": headline(per, {}, "e2e"),
        "breakdown": {p: {**{f"{k}_frac": _frac(per[p], k) for k in TIME_KEYS},
                          "any_fallback_frac": _frac(per[p], "fallback")
                          + _frac(per[p], "target_fallback")} for p in POLICIES},
        "mean_acceptance_length": {p: aggregate(raw[p])["mean_acceptance_length"]
                                   for p in per},
        "headroom_mean_acceptance_length": headroom(reqs, pool.gamma, pool.general),
    }
    if sweeps:
        result["sweeps"] = sweep(best_c, sweep_variants(pool, per_domain, reqs, cfg, cost))
    if real_per_domain > 0:
        bw = float(cost.source.get("bandwidth_bytes_s") or 0.0)
        if not pinned.is_file() and pool.storage == "edge-emulated" and bw > 0:
            real_pool = pinned_pool(pool_path, bw, pinned)
        result["validation"] = validate(pool, real_pool, reqs, cost, cfg, best_c,
                                        real_per_domain, max_new)
        result["sim_vs_real_max_rel_error"] = result["validation"]["max_rel_error_steady"]
    result["predictor"] = predictor_metrics()
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    return result


def sd_headline(per: Mapping[str, Mapping[str, Mapping[str, Any]]],
                opt_sd: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """Against the best schedule of speculative intervals only (no target-only steps while
    a draft is resident): how close the paper's policy space gets to its own optimum."""
    def g(a: str) -> float:
        return gmean([per[a][d]["steady"] / opt_sd[d]["steady"] for d in opt_sd])

    return {"memspec_over_optimum_sd": g("memspec"),
            "oracle_dynamic_over_optimum_sd": g("oracle-dynamic"),
            "optimum_sd_over_general_static": 1.0 / g("general-static")}


def sweep_variants(pool: PoolConfig, per_domain: int, reqs: Sequence[SimRequest],
                   cfg: SimConfig, cost: CostModel) -> list[Variant]:
    """N, output length, K and load/iteration; lengths beyond the traces need longer ones
    (`memspec trace --sets test --max-new-tokens 256`), skipped with a note if absent."""
    ref = pool.general
    out: list[Variant] = [("N", n, reqs, replace(cfg, N=n), cost) for n in SWEEP_N]
    traced = max(r.length for r in reqs)
    for n in SWEEP_LEN:
        if n <= (cfg.max_new_tokens or traced):
            out.append(("max_new_tokens", n, reqs, replace(cfg, max_new_tokens=n), cost))
            continue
        try:
            long = heldout_requests(pool, per_domain, which=f"test-L{n}")
        except ConfigError as exc:
            _log(f"sweep max_new_tokens={n} skipped: {exc}")
            continue
        out.append(("max_new_tokens", n, long, replace(cfg, max_new_tokens=n), cost))
    out += [("K", k, reqs, replace(cfg, K=k), cost) for k in SWEEP_K]
    out += [("load_over_iteration", r, reqs, cfg, cost.with_load_ratio(r, ref))
            for r in SWEEP_RATIO]
    return out


def predictor_metrics() -> dict[str, Any]:
    info = read_info(default_head_path())
    acc = info.get("heldout_accuracy", {})
    return {k: {"top1": v.get("top1"), "top2": v.get("top2"), "n": v.get("n")}
            for k, v in acc.items() if isinstance(v, dict)}


def validate(pool: PoolConfig, pool_path: str | None, reqs: Sequence[SimRequest],
             cost: CostModel, cfg: SimConfig, ucb: Mapping[str, float], per_domain: int,
             max_new: int) -> dict[str, Any]:
    """Real three-process runs vs the simulator on the same prompts, per policy."""
    prompts = {p["id"]: p for p in split_prompts("test", pool_domains(pool), per_domain)}
    sub = [r for r in reqs if r.prompt_id in prompts]
    real_reqs = [RealRequest(pol, r.prompt_id, r.domain, prompts[r.prompt_id]["prompt"],
                             max_new, ucb.get(pol)) for pol in POLICIES for r in sub]
    rows = run_real(real_reqs, memspec_home() / "bench" / "real.jsonl", pool_path)
    trajs = trajectory_rows(trajectories_path(pool, "test"), [r.prompt_id for r in sub])
    out: dict[str, Any] = {"prompts": len(sub), "policies": {}, "token_mismatches": 0}
    errs, errs_e2e = [], []
    for pol in POLICIES:
        real = [rows[q.key].stats for q in real_reqs if q.policy == pol]
        ids = [rows[q.key].token_ids for q in real_reqs if q.policy == pol]
        out["token_mismatches"] += sum(
            1 for q, t in zip([q for q in real_reqs if q.policy == pol], ids)
            if t[:len(trajs[q.prompt_id]["tokens"])] != trajs[q.prompt_id]["tokens"][:max_new])
        sim = run_sim(pol, sub, cost, cfg, ucb.get(pol, 2.0))
        a_real, a_sim = aggregate(real), aggregate(sim)
        err = a_sim["steady"] / a_real["steady"] - 1
        err_e2e = a_sim["e2e"] / a_real["e2e"] - 1
        errs.append(abs(err))
        errs_e2e.append(abs(err_e2e))
        out["policies"][pol] = {
            "real_steady": a_real["steady"], "sim_steady": a_sim["steady"], "rel_error": err,
            "real_e2e": a_real["e2e"], "sim_e2e": a_sim["e2e"], "rel_error_e2e": err_e2e,
            "real_fallback_frac": a_real["fallback_frac"], "sim_fallback_frac": a_sim["fallback_frac"],
            "real_target_fallback_frac": a_real["target_fallback_frac"],
            "sim_target_fallback_frac": a_sim["target_fallback_frac"],
            "real_mean_acceptance_length": a_real["mean_acceptance_length"],
            "sim_mean_acceptance_length": a_sim["mean_acceptance_length"]}
        _log(f"validation {pol}: real {a_real['steady']:.2f} tok/s, sim {a_sim['steady']:.2f} "
             f"({err * 100:+.1f}%)")
    out["max_rel_error_steady"] = max(errs)
    out["max_rel_error_e2e"] = max(errs_e2e)
    return out


def main_bench(args) -> int:
    result = run(getattr(args, "pool", None), args.prompts_per_domain, args.real_per_domain,
                 args.max_new_tokens or 128, args.recalibrate, not args.no_sweeps,
                 Path(args.cost_model) if args.cost_model else None)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plots:
        for path in draw_all(result, Path(args.plots)):
            _log(f"wrote {path}")
    if args.results:
        write_results(result, Path(args.results), Path(args.plots) if args.plots else None)
    print(summary_text(result))
    return 0

