"""`memspec bench` on a tiny synthetic pool: statistics, the JSON's structure (the issue's
must-hold keys), the report, the README block and the figures. No models, no processes:
"real" runs are the simulator's own traced runs under a perturbed cost model."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest
from msgspec.structs import replace as replace_struct

from memspec.bench.evaluation import (
    POLICIES,
    REAL_POLICIES,
    SPLIT,
    Sizes,
    aggregate,
    breakdown,
    estimate,
    evaluate_policies,
    first_draft_token_s,
    headline,
    headroom,
    max_rel_error,
    optimum_by_domain,
    parts_gap,
    ratios,
    real_section,
    sim_section,
    sim_variant,
    split_info,
    sweep,
    wall_split,
)
from memspec.bench.realruns import (
    RealRequest,
    RealResult,
    interleaved,
    pinned_pool,
    variant,
    variant_threads,
)
from memspec.bench.report import (
    README_BEGIN,
    README_END,
    checks,
    summary_text,
    write_readme,
    write_results,
)
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
    assert 0 <= a["fallback_of_decode"] < 1 and a["prediction_frac"] > 0
    assert sum(a[f"{k}_frac"] for k in SPLIT) == pytest.approx(1.0)
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
    # an ungated variant runs its policy with the gate off and takes its UCB c
    assert {r.ucb_c for r in reqs if r.policy == "mab-async-ungated"} == {0.5}
    assert len(reqs) == 3 * len(REAL_POLICIES) * 2 and len({r.key for r in reqs}) == len(reqs)
    P = len(REAL_POLICIES)
    blocks = [reqs[i:i + P] for i in range(0, len(reqs), P)]
    assert all({r.prompt_id for r in b} == {b[0].prompt_id} for b in blocks)  # per prompt
    assert all(sorted(r.policy for r in b) == sorted(REAL_POLICIES) for b in blocks)
    assert len({b[0].policy for b in blocks}) > 2  # the first policy rotates
    assert {r.ucb_c for r in reqs if r.policy == "mab-async"} == {0.5}
    assert RealRequest("memspec", "p", "x", "?", 16).key != \
        RealRequest("memspec", "p", "x", "?", 16, repeat=1).key


def test_variants_name_their_policy_and_gate_and_never_share_a_cache_key():
    assert variant("memspec") == ("memspec", True)
    assert variant("memspec-ungated") == ("memspec", False)
    assert variant("general-static-ungated") == ("general-static", False)
    assert variant("target-only") == ("target-only", None)
    assert variant("lookup-only") == ("lookup-only", None)
    assert variant("oracle-dynamic") == ("oracle-dynamic", None)  # it plans the target itself
    assert variant("target-only-1t") == ("target-only", None)  # on one decoder thread
    assert variant_threads("target-only-1t") == 1 and variant_threads("target-only") is None
    keys = {RealRequest(v, "p", "x", "?", 16).key for v in REAL_POLICIES}
    assert len(keys) == len(REAL_POLICIES)
    assert "gate=off" in RealRequest("mab-async-ungated", "p", "x", "?", 16).key
    assert "gate=on" in RealRequest("mab-async", "p", "x", "?", 16).key
    policy, cfg, c = sim_variant("mab-async-ungated", CFG, {"mab-async": 0.5})
    assert (policy, cfg.gate, c) == ("mab-async", False, 0.5)


def _fake_real(reqs: list[SimRequest], repeats: int = 2, mismatch: str = ""):
    """Traced simulated runs standing in for real ones (slower iterations, as if measured
    under load), keyed like run_real's cache; lookup-only, which the simulator cannot run,
    stands in as target-only. The run keyed `mismatch` gets a wrong last token."""
    slow = replace(COST, spec_s={d: 0.095 for d in DRAFTS})
    rows, keys = {}, []
    for rep in range(repeats):
        for r in reqs:
            for pol in REAL_POLICIES:
                q = RealRequest(pol, r.prompt_id, r.domain, "", 64, None, rep)
                policy, cfg, c = sim_variant(pol, CFG, {})
                policy = "target-only" if policy == "lookup-only" else policy
                summary = simulate_traced(policy, r, slow, cfg, c)
                tokens = list(range(r.length))
                if q.key == mismatch:
                    tokens[-1] += 1
                rows[q.key] = RealResult({"key": q.key, "repeat": rep, "token_ids": tokens},
                                         summary)
                keys.append((q.key, pol, r.prompt_id))
    return rows, keys


MISMATCH = RealRequest("general-static", "general-0", "general", "", 64).key


@pytest.fixture(scope="module")
def result():
    """A bench result as `memspec bench --json` writes it, from simulated stand-ins; one
    test run (MISMATCH) decoded a wrong token."""
    sets = {"dev2": requests(1), "mixed": mixed_requests()}
    sim, real, beside = {}, {}, {}
    for which, reqs in sets.items():
        sim[which], _ = sim_section(reqs, COST, CFG, {}, 4, "general", with_optimum=False)
        rows, keys = _fake_real(reqs, mismatch=MISMATCH)
        trajs = {r.prompt_id: {"tokens": list(range(r.length))} for r in reqs}
        real[which], beside[which] = real_section(reqs, rows, keys, COST, CFG, {}, trajs)
    beside["max_rel_error"] = max_rel_error(beside)
    sizes = Sizes(sim_per_domain=1, sim_mixed=3, dev_per_domain=1, real_per_domain=1,
                  real_mixed=3, repeats=2, sweep_per_domain=1)
    rows = sweep({}, [("N", n, sets["dev2"], replace(CFG, N=n), COST) for n in (2, 8)])
    out = {"machine": {"cpu": "test"}, "storage": "edge-emulated", "dtype": "int4",
           "K": 2, "N": 4, "gamma": 4, "max_new_tokens": 64, "load_over_iteration": 2.7,
           "drafts": list(DRAFTS), "draft_kinds": ["model"], "split": split_info(sizes),
           "smoke": sizes.smaller_than_full(), "cost_model": COST.to_json(),
           "ucb_c_sweep": {"mab-async": {"0.5": 1.0, "2.0": 1.1}},
           "ucb_c_best": {"mab-async": 2.0}, "ucb_c_tuned_on": "dev (5 prompts)",
           "provenance": {"commit": "0123456789abcdef", "clean": False, "dirty_files": 2},
           "sim": sim, "real": real, "sim_vs_real": beside, "sweeps": rows,
           "predictor": {"trained_on": "train,dev", "head": "predictor/head.safetensors",
                         "head_for_this_pool": True, **{s: {
                             k: {"top1": 0.5, "top2": 0.8, "n": 10}
                             for k in ("prompt_only", "recent_only", "prompt_recent",
                                       "domain_rule", "majority")} for s in ("dev2", "mixed")}},
           "wall_s": {"simulator": 2.0, "sweeps": 1.0, "calibration": 5.0},
           "real_request_s": 1.5}
    out["estimate_full_run"] = estimate(out, sizes)
    return json.loads(json.dumps(as_json(out)))  # what the JSON file holds


def test_bench_json_holds_the_issues_must_hold_keys(result):
    assert result["split"]["kind"] == "source-disjoint" and result["split"]["disjoint"]
    assert set(result["split"]["counts"]) == {"train", "dev", "dev2", "mixed", "test2"}
    assert result["split"]["measured_on"] == ["dev2", "mixed"]
    assert "dev2/mixed" not in result["split"]["shared_sources"]  # mixed quotes dev2 sources
    for which in ("dev2", "mixed"):
        sec = result["real"][which]
        # end to end and steady, each ratio with its interval
        for gm, ci in (("gmean_e2e", "ci95_e2e"), ("gmean", "ci95")):
            assert set(sec[gm]) == set(HEADLINE) == set(sec[ci])
            for k in HEADLINE:
                lo, hi = sec[ci][k]
                assert lo <= sec[gm][k] <= hi
        assert sec["gmean_e2e"] != sec["gmean"]  # two clocks, two statistics
        assert sec["variants"]["memspec-ungated"] == {"policy": "memspec", "gate": False}
        bound = sec["oracle_bound"]["e2e"]
        assert "memspec_over_oracle_dynamic" in bound["gmean"]
        assert "target_only_over_oracle_dynamic" not in bound["gmean"]
        assert bound["worst"]["ci95"][1] == max(v[1] for v in bound["ci95"].values())
        for pol, b in sec["breakdown"].items():
            assert sum(b[f"{k}_frac"] for k in SPLIT) == pytest.approx(1.0), pol
            assert 0 <= b["parts_gap_max"] <= 0.02, pol
        first = sec["first_draft_token_s"]  # None: a gate that never opened
        assert set(first) == set(sec["breakdown"]) - {"target-only", "target-only-1t"}
        assert all(v is None or v > 0 for v in first.values())
        # the simulator cannot run lookup-only: every other ratio beside the real one
        svr = result["sim_vs_real"][which]
        assert set(svr["ratios"]) == set(HEADLINE) - {"memspec_over_lookup_only", "memspec_over_target_only_1t",
                                                   "target_only_over_target_only_1t"}
        assert set(svr["not_simulated"]) == {"lookup-only", "target-only-1t"}
        assert "lookup-only" in result["sim"][which]["not_simulated"]
        for row in ("prompt_only", "recent_only", "prompt_recent", "domain_rule"):
            assert set(result["predictor"][which][row]) >= {"top1", "top2"}
        assert result["sim"][which]["oracle_checks"]["ok"]
    # the one run built with a wrong token is counted, on its set only
    assert result["real"]["dev2"]["token_mismatches"] == 1
    assert result["real"]["mixed"]["token_mismatches"] == 0
    assert 0 < result["sim_vs_real"]["max_rel_error"] < 0.2  # slower "real" iterations
    # mixed answers switch domains: a plan that loads ahead beats the best single draft
    assert result["real"]["mixed"]["gmean"]["oracle_dynamic_over_oracle_static"] > 1.0
    assert result["smoke"] and result["estimate_full_run"]["real_requests"] == \
        (5 * 10 + 30) * len(REAL_POLICIES) * 2


def test_report_readme_and_figures_link_only_what_this_run_drew(result, tmp_path):
    from memspec.bench.figures import draw_all

    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "sweeps.png").write_bytes(b"a stale plot of another pool")
    no_sweeps = {k: v for k, v in result.items() if k != "sweeps"}
    paths = draw_all(no_sweeps, plots)
    names = {p.stem for p in paths}
    assert {"real_ratios", "real_throughput", "sim_vs_real", "breakdown", "ucb_c",
            "sim_throughput_steady"} <= names and "sweeps" not in names
    assert all(p.stat().st_size > 1000 for p in paths)
    write_results(no_sweeps, tmp_path / "RESULTS.md", plots, paths)
    text = (tmp_path / "RESULTS.md").read_text()
    assert "SMOKE RUN" in text and "## Must hold" in text
    assert "![real_ratios](plots/real_ratios.png)" in text and "target-only" in text
    assert "sweeps.png" not in text  # on disk, but not this run's
    assert "target alone (gated) | target alone (fallback)" in text
    assert "commit 0123456789ab (uncommitted changes in 2 paths)" in text
    write_results(no_sweeps, tmp_path / "R2.md", plots)  # nothing drawn: nothing linked
    assert "](plots/" not in (tmp_path / "R2.md").read_text()
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{README_BEGIN}\nold\n{README_END}\nafter\n")
    write_readme(result, readme, plots, paths)
    body = readme.read_text()
    assert "old" not in body and "before" in body and "after" in body
    assert body.count(README_BEGIN) == 1 and "memspec / mab-async-ungated" in body
    assert "| dev2 end to end [95% CI] | dev2 steady [95% CI] |" in body  # e2e first
    assert "![real_ratios](plots/real_ratios.png)" in body
    text = summary_text(result)
    assert "mixed end to end [95% CI] | mixed steady [95% CI]" in text
    assert "[ok] prompt sets disjoint" in text and "its CI95 too" in text
    # a result from before the rename keys dev2 "test" and has no "held_out": it reads,
    # and its documents are written, as dev2 (the committed JSONs stay as they are)
    old = json.loads(json.dumps({k: v for k, v in no_sweeps.items() if k != "held_out"})
                     .replace('"dev2"', '"test"'))
    assert "dev2" not in old["real"] and "test" in old["predictor"]
    write_results(old, tmp_path / "R3.md", plots, paths)
    lines = (tmp_path / "R3.md").read_text().replace("R3.md", "RESULTS.md").splitlines()
    said = [ln for ln in lines if ln.startswith("- set names: the JSON predates the rename")]
    assert len(said) == 1 and "set names" not in (tmp_path / "RESULTS.md").read_text()
    assert "\n".join(ln for ln in lines if ln not in said) + "\n" \
        == (tmp_path / "RESULTS.md").read_text()
    assert summary_text(old) == summary_text(no_sweeps)
    assert {p.name for p in draw_all(old, tmp_path / "old_plots")} == {p.name for p in paths}


def _with(result: dict, path: tuple[str, ...], value) -> dict:
    out = json.loads(json.dumps(result))
    cur = out
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    return out


def test_a_bound_is_met_only_when_its_interval_clears_it(result):
    label = "#11 dev2: memspec / mab-async (real, steady)"
    key = ("real", "dev2")

    def verdict(r: dict):
        return next(c for c in checks(r) if c.label == label)

    r = _with(_with(result, (*key, "gmean", "memspec_over_mab_async"), 1.2575),
              (*key, "ci95", "memspec_over_mab_async"), [1.210, 1.308])
    c = verdict(r)
    assert c.value > 1.25 and not c.ok  # the point clears 1.25, the interval does not
    c = verdict(_with(r, (*key, "ci95", "memspec_over_mab_async"), [1.26, 1.31]))
    assert c.ok and c.ci == [1.26, 1.31]
    c = verdict(_with(r, (*key, "ci95", "memspec_over_mab_async"), [None, None]))
    assert not c.ok and c.note == "no CI"
    # oracle-dynamic above every online policy: the worst upper bound must stay <= 1
    oracle = "dev2: oracle-dynamic >= every online policy (real, end to end; the worst " \
             "policy / oracle-dynamic)"
    worst = ("real", "dev2", "oracle_bound", "e2e", "worst")
    low = _with(result, worst, {"ratio": "x", "gmean": 0.9, "ci95": [0.85, 0.99]})
    high = _with(result, worst, {"ratio": "x", "gmean": 0.97, "ci95": [0.9, 1.02]})
    assert next(c for c in checks(low) if c.label == oracle).ok
    assert not next(c for c in checks(high) if c.label == oracle).ok
    got = {c.label: c.ok for c in checks(result)}
    assert got["prompt sets disjoint by source (train/dev/dev2/mixed)"] is True
    assert got["dev2: time split parts add up to the wall time (worst run, every policy)"]
    assert got["predictor Table 2 is of a head trained for the runs' pool"]
    assert not got["mixed: predictor prompt+recent top-1 minus the domain rule's"]  # 0.5 - 0.5


def test_wall_split_adds_up_and_a_part_no_clock_measured_is_caught():
    """Real summaries (the decoder's Done.stats, here from the loop under the simulator):
    the split's parts add up to the wall time within 2%; a run whose time went
    unmeasured (booked as `other`) shows as a gap."""
    r = requests(1)[1]
    runs = [simulate_traced(p, r, COST, CFG) for p in ("target-only", "general-static",
                                                       "memspec", "oracle-dynamic")]
    for s in runs:
        parts = wall_split(s)
        assert sum(parts.values()) == pytest.approx(s.time.e2e)
        assert parts_gap(s) <= 0.02 and all(v >= -1e-9 for v in parts.values())
    assert wall_split(runs[0])["target_gated"] > 0  # target-only: the target alone by choice
    lost = runs[2].time.e2e * 0.05  # the wall clock ran on, no part's clock did
    t = replace_struct(runs[2].time, e2e=runs[2].time.e2e + lost,
                       other=runs[2].time.other + lost)
    bad = replace_struct(runs[2], time=t)
    assert parts_gap(bad) == pytest.approx(0.05 / 1.05)
    assert breakdown([*runs, bad])["parts_gap_max"] == pytest.approx(0.05 / 1.05)


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


def test_the_predictor_own_cost_is_reported_per_ranking():
    """The predictor's encoding beside the decoder (its rankings after the prompt's): share
    of decode time, snapshots a request, seconds a later ranking; none ranked: n/a."""
    from memspec.common.metrics import Summary, TimeBreakdown

    def summary(snapshots: int, predictor_s: float) -> Summary:
        t = TimeBreakdown(prefill=0.1, draft=0.0, verify=1.0, catchup=0.0, desired=1.0,
                          fallback=0.0, target_fallback=0.0, load_wait=0.0, prediction=0.0,
                          decode=1.0, e2e=1.1)
        return Summary(generated_tokens=100, prompt_tokens=10, iterations=50,
                       tokens_per_s_steady=100.0, tokens_per_s_e2e=90.0, num_drafts=50,
                       num_draft_tokens=200, num_accepted_tokens=50,
                       mean_acceptance_length=2.0, acceptance_rate=0.25, time=t, loads=0,
                       evictions=0, switches=0, bytes_loaded=0, drafts_used={},
                       snapshots=snapshots, predictor_s=predictor_s)

    a = aggregate([summary(3, 0.04), summary(1, 0.0)])
    assert a["predictor_of_decode"] == pytest.approx(0.02)
    assert a["snapshots_per_request"] == pytest.approx(2.0)
    assert a["predictor_s_per_ranking"] == pytest.approx(0.02)
    assert aggregate([summary(1, 0.0)])["predictor_s_per_ranking"] is None
