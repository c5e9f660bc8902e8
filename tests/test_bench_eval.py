"""`memspec bench` on a tiny synthetic pool: statistics, the JSON's structure (the issue's
must-hold keys), the report, the README block and the figures. No models, no processes:
"real" runs are the simulator's own traced runs under a perturbed cost model."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest

from memspec.bench.evaluation import (
    POLICIES,
    REAL_POLICIES,
    Sizes,
    aggregate,
    estimate,
    evaluate_policies,
    first_draft_token_s,
    headline,
    headroom,
    max_rel_error,
    optimum_by_domain,
    ratios,
    real_section,
    sim_section,
    split_info,
    sweep,
)
from memspec.bench.realruns import RealRequest, RealResult, interleaved, pinned_pool
from memspec.bench.report import README_BEGIN, README_END, checks, write_readme, write_results
from memspec.bench.stats import HEADLINE, headline_ratios
from memspec.common.config import load_pool
from memspec.common.metrics import as_json
from memspec.sim.costmodel import CostModel
from memspec.sim.simulate import SimConfig, SimRequest, simulate_traced
from memspec.zoo.tables import table_from_correct

DRAFTS = ("general", "code", "math", "law", "medical")


def _scores(dom: str):
    return lambda p: {d: 0.9 if d == dom else 0.025 for d in DRAFTS}


def requests(n_per: int = 2, length: int = 48) -> list[SimRequest]:
    rng = random.Random(0)
    out = []
    for dom in DRAFTS:
        for i in range(n_per):
            tabs = {d: table_from_correct([rng.random() < (0.6 if d == dom else 0.25)
                                           for _ in range(length)], 4) for d in DRAFTS}
            out.append(SimRequest(f"{dom}-{i}", dom, 30, tabs, scores=_scores(dom)))
    return out


def mixed_requests(n: int = 3, length: int = 64) -> list[SimRequest]:
    """Two domains per answer: the first half one draft's, the second another's."""
    rng = random.Random(1)
    out = []
    for i in range(n):
        a, b = DRAFTS[1 + i % 4], DRAFTS[1 + (i + 1) % 4]
        tabs = {d: table_from_correct([rng.random() < (0.7 if d == (a if p < length // 2 else b)
                                                       else 0.2) for p in range(length)], 4)
                for d in DRAFTS}
        out.append(SimRequest(f"mixed-{i}", "mixed", 40, tabs,
                              scores=lambda p, a=a, b=b: {d: 0.8 if d == (a if p < 28 else b)
                                                          else 0.05 for d in DRAFTS}))
    return out


COST = CostModel(spec_s={d: 0.09 for d in DRAFTS}, target_s=0.04, catchup_base_s=0.002,
                 catchup_per_token_s=1e-5, load_s={d: 0.24 for d in DRAFTS}, predict_s=0.02,
                 snapshot_s=0.0002, sched_s=0.001, mean_iteration_s=0.09)
CFG = SimConfig(DRAFTS, "general", 2, 4, 4, plan=COST.plan_costs())


def test_policies_aggregate_and_normalise():
    """(Ungated: the policies' own mechanics; the gate has its tests in test_gate.py.)"""
    reqs = requests()
    per, raw = evaluate_policies(reqs, COST, replace(CFG, gate=False), {}, POLICIES)
    assert set(per) == set(POLICIES) and set(per["memspec"]) == set(DRAFTS)
    norm = ratios(per, "general-static", "steady")
    assert all(abs(norm["general-static"][d] - 1.0) < 1e-12 for d in DRAFTS)
    opt = optimum_by_domain(reqs, COST, CFG)
    h = headline(per, opt)
    # a perfect predictor on domain-separated drafts: memspec beats the general draft, and
    # nothing beats the optimum
    assert h["memspec_over_general_static"] > 1.1
    assert h["memspec_over_optimum"] <= 1.0 and h["oracle_dynamic_over_optimum"] <= 1.0
    a = aggregate(raw["memspec"])
    assert a["tokens"] == sum(r.length for r in reqs)
    assert 0 <= a["fallback_frac"] < 1 and a["prediction_frac"] > 0
    room = headroom(reqs, 4, "general")
    assert all(v["oracle_static"] >= v["general"] for v in room.values())
    # the cold start: every draft policy loads while the prompt prefills, so its first
    # draft token comes after about one load, never later than a load plus an interval
    first = first_draft_token_s(raw["general-static"][0])
    assert first is not None and first < COST.load_s["general"] + 5 * 0.09


def test_gmean_and_two_level_bootstrap_interval():
    key = "memspec_over_target_only"
    ids = [f"p{i}" for i in range(20)]
    base = {p: [(100.0, 1.0)] for p in ids}
    fast = {p: [(100.0, 1.0 / (1.2 * (1.05 if i % 2 else 0.95)))] for i, p in enumerate(ids)}
    gm, ci = headline_ratios({"memspec": fast, "target-only": base}, {p: "x" for p in ids},
                             n=500)
    assert gm[key] == pytest.approx(1.2 * math.sqrt(1.05 * 0.95)) and ci[key][0] < gm[key] < ci[key][1]
    assert ci[key][1] / ci[key][0] < 1.1
    # one prompt, two noisy repeats: the interval still shows the run-to-run noise
    one = {"memspec": {"a": [(100.0, 0.5), (100.0, 0.8)]}, "target-only": {"a": [(100.0, 1.0)]}}
    g1, c1 = headline_ratios(one, {}, n=400)
    assert g1[key] == pytest.approx(2 / 1.3) and c1[key][0] < g1[key] < c1[key][1]
    _, none = headline_ratios(one, {}, n=0)
    assert all(math.isnan(v) for v in none[key])
    assert set(headline_ratios({"memspec": {}}, {})[0]) == set()  # a pair needs both policies


def test_interleaving_rotates_policies_per_prompt_and_repeat():
    prompts = [{"id": f"p{i}", "domain": "x", "prompt": "?"} for i in range(3)]
    reqs = interleaved(prompts, REAL_POLICIES, 16, 2, {"mab-async": 0.5})
    assert len(reqs) == 3 * len(REAL_POLICIES) * 2 and len({r.key for r in reqs}) == len(reqs)
    P = len(REAL_POLICIES)
    blocks = [reqs[i:i + P] for i in range(0, len(reqs), P)]
    assert all({r.prompt_id for r in b} == {b[0].prompt_id} for b in blocks)  # per prompt
    assert all(sorted(r.policy for r in b) == sorted(REAL_POLICIES) for b in blocks)
    assert len({b[0].policy for b in blocks}) > 2  # the first policy rotates
    assert {r.ucb_c for r in reqs if r.policy == "mab-async"} == {0.5}
    assert RealRequest("memspec", "p", "x", "?", 16).key != \
        RealRequest("memspec", "p", "x", "?", 16, repeat=1).key


def _fake_real(reqs: list[SimRequest], repeats: int = 2):
    """Traced simulated runs standing in for real ones (slower iterations, as if measured
    under load), keyed like run_real's cache."""
    slow = replace(COST, spec_s={d: 0.095 for d in DRAFTS})
    rows, keys = {}, []
    for rep in range(repeats):
        for r in reqs:
            for pol in REAL_POLICIES:
                q = RealRequest(pol, r.prompt_id, r.domain, "", 64, None, rep)
                summary = simulate_traced(pol, r, slow, CFG)
                rows[q.key] = RealResult({"key": q.key, "repeat": rep,
                                          "token_ids": list(range(r.length))}, summary)
                keys.append((q.key, pol, r.prompt_id))
    return rows, keys


def test_bench_json_structure_report_and_figures(tmp_path):
    sets = {"test": requests(1), "mixed": mixed_requests()}
    sim, real, beside = {}, {}, {}
    for which, reqs in sets.items():
        sim[which], _ = sim_section(reqs, COST, CFG, {}, 4, "general", with_optimum=False)
        rows, keys = _fake_real(reqs)
        trajs = {r.prompt_id: {"tokens": list(range(r.length))} for r in reqs}
        real[which], beside[which] = real_section(reqs, rows, keys, COST, CFG, {}, trajs)
    beside["max_rel_error"] = max_rel_error(beside)
    sizes = Sizes(sim_per_domain=1, sim_mixed=3, dev_per_domain=1, real_per_domain=1,
                  real_mixed=3, repeats=2, sweep_per_domain=1)
    rows = sweep({}, [("N", n, sets["test"], replace(CFG, N=n), COST) for n in (2, 8)])
    result = {"machine": {"cpu": "test"}, "storage": "edge-emulated", "dtype": "int4",
              "K": 2, "N": 4, "gamma": 4, "max_new_tokens": 64, "load_over_iteration": 2.7,
              "drafts": list(DRAFTS), "draft_kinds": ["model"], "split": split_info(sizes),
              "smoke": sizes.smaller_than_full(), "cost_model": COST.to_json(),
              "ucb_c_sweep": {"mab-async": {"0.5": 1.0, "2.0": 1.1}},
              "ucb_c_best": {"mab-async": 2.0}, "ucb_c_tuned_on": "dev (5 prompts)",
              "sim": sim, "real": real, "sim_vs_real": beside, "sweeps": rows,
              "predictor": {"trained_on": "train,dev", **{s: {
                  k: {"top1": 0.5, "top2": 0.8, "n": 10}
                  for k in ("prompt_only", "recent_only", "prompt_recent", "domain_rule",
                            "majority")} for s in ("test", "mixed")}},
              "wall_s": {"simulator": 2.0, "sweeps": 1.0, "calibration": 5.0},
              "real_request_s": 1.5}
    result["estimate_full_run"] = estimate(result, sizes)
    result = json.loads(json.dumps(as_json(result)))  # what the JSON file holds

    # the must-hold keys
    assert result["split"]["kind"] == "source-disjoint" and result["split"]["disjoint"]
    assert set(result["split"]["counts"]) == {"train", "dev", "test", "mixed"}
    for which in ("test", "mixed"):
        sec = result["real"][which]
        assert set(sec["gmean"]) == set(HEADLINE) == set(sec["ci95"])
        for k in HEADLINE:
            lo, hi = sec["ci95"][k]
            assert lo <= sec["gmean"][k] <= hi
        mem = sec["breakdown"]["memspec"]
        assert mem["fallback_frac"] == pytest.approx(
            mem["fallback_resident_frac"] + mem["target_fallback_frac"])
        assert "prediction_frac" in mem and sec["token_mismatches"] == 0
        assert sec["first_draft_token_s"]["memspec"] > 0
        assert set(result["sim_vs_real"][which]["ratios"]) == set(HEADLINE)
        for row in ("prompt_only", "recent_only", "prompt_recent", "domain_rule"):
            assert set(result["predictor"][which][row]) >= {"top1", "top2"}
        assert result["sim"][which]["oracle_checks"]["ok"]
    assert 0 < result["sim_vs_real"]["max_rel_error"] < 0.2  # slower "real" iterations
    # mixed answers switch domains: a plan that loads ahead beats the best single draft
    assert result["real"]["mixed"]["gmean"]["oracle_dynamic_over_oracle_static"] > 1.0
    assert result["smoke"] and result["estimate_full_run"]["real_requests"] == \
        (5 * 10 + 30) * len(REAL_POLICIES) * 2

    from memspec.bench.figures import draw_all

    paths = draw_all(result, tmp_path / "plots")
    names = {p.stem for p in paths}
    assert {"real_ratios", "real_throughput", "sim_vs_real", "breakdown", "sweeps",
            "ucb_c", "sim_throughput_steady"} <= names
    assert all(p.stat().st_size > 1000 for p in paths)
    write_results(result, tmp_path / "RESULTS.md", tmp_path / "plots")
    text = (tmp_path / "RESULTS.md").read_text()
    assert "SMOKE RUN" in text and "## Must hold" in text
    assert "![real_ratios](plots/real_ratios.png)" in text and "target-only" in text
    got = {label: ok for label, _v, _op, _b, ok in checks(result)}
    assert got["prompt sets disjoint by source (train/dev/test/mixed)"] is True
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{README_BEGIN}\nold\n{README_END}\nafter\n")
    write_readme(result, readme, tmp_path / "plots")
    body = readme.read_text()
    assert "old" not in body and "before" in body and "after" in body
    assert body.count(README_BEGIN) == 1 and "memspec / mab-async" in body
    assert "![real_ratios](plots/real_ratios.png)" in body


def test_pinned_pool_keeps_every_path(tmp_path):
    path = pinned_pool(None, 3.5e6, tmp_path / "pool.toml", load_iter_ratio=2.25)
    pool = load_pool(path, check=False)
    assert pool.bandwidth_mb_s == 3.5 and pool.load_iter_ratio == 2.25
    default = load_pool(None, check=False)
    assert [d.path for d in pool.drafts] == [d.path for d in default.drafts]
    assert pool.target == default.target


def test_cached_real_runs_are_kept_only_for_the_same_code_and_pool(tmp_path):
    """A real run cached by an earlier checkout or another pool is measured again, not
    mixed into new figures."""
    import json as _json

    from memspec.bench.realruns import read_results, run_fingerprint

    fp = run_fingerprint(None)
    assert fp == run_fingerprint(None)
    from memspec.common.paths import PACKAGE_ROOT

    assert run_fingerprint(str(PACKAGE_ROOT / "pools" / "small-models.toml")) != fp
    stats = {"generated_tokens": 1, "prompt_tokens": 1, "iterations": 1,
             "tokens_per_s_steady": 1.0, "tokens_per_s_e2e": 1.0, "num_drafts": 0,
             "num_draft_tokens": 0, "num_accepted_tokens": 0, "mean_acceptance_length": 1.0,
             "acceptance_rate": 0.0, "time": {k: 0.0 for k in (
                 "prefill", "draft", "verify", "catchup", "desired", "fallback",
                 "target_fallback", "load_wait", "prediction", "decode", "e2e")},
             "loads": 0, "evictions": 0, "switches": 0, "bytes_loaded": 0, "drafts_used": {}}
    path = tmp_path / "real.jsonl"
    path.write_text("\n".join(_json.dumps({"key": k, "stats": stats, "fingerprint": f})
                              for k, f in (("a", fp), ("b", "stale"))) + "\n")
    assert set(read_results(path, fp)) == {"a"} and set(read_results(path)) == {"a", "b"}
