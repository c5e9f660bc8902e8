"""`memspec bench tune` and tuned.json: every knob the runtime uses names the dev sweep that
chose it, and the runtime runs the values the file holds."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from memspec.bench import tune
from memspec.common.config import load_pool
from memspec.common.errors import ConfigError
from memspec.common.paths import DEFAULT_POOL
from memspec.common.tuned import TUNED_FILE, knob, tuned_knobs
from memspec.procs.decoder import engine
from memspec.procs.decoder.drafts.head import first_floor, scored_rows, stop_floor
from memspec.procs.decoder.drafts.lookup_depth import LookupDepth
from memspec.procs.decoder.oracle.oracle import DynamicPlan
from memspec.procs.decoder.sched import loop
from memspec.procs.decoder.sched.costs import PlanCosts
from memspec.procs.decoder.sched.gate import SpecGate

RUNTIME = {  # knob -> the value the runtime runs
    "gate.ALPHA": lambda: SpecGate.ALPHA,
    "gate.FIRST_LOOK": lambda: SpecGate.FIRST_LOOK,
    "gate.NEAR_MISS": lambda: SpecGate.NEAR_MISS,
    "gate.STOP_INSIDE": lambda: SpecGate.STOP_INSIDE,
    "gate.PROBE_SHARE": lambda: SpecGate.PROBE_SHARE,
    "gate.PRIOR_TAU": lambda: SpecGate.PRIOR_TAU,
    "gate.RANK_HORIZON": lambda: SpecGate.RANK_HORIZON,
    "gate.LOOKUP_LOOKS": lambda: SpecGate.LOOKUP_LOOKS,
    "gate.LOOKUP_FAILING": lambda: SpecGate.LOOKUP_FAILING,
    "gate.HEAD_PRIOR": lambda: SpecGate.HEAD_PRIOR,
    "loop.PREDICTOR_SHARE": lambda: loop.PREDICTOR_SHARE,
    "loop.CHUNKED_WAIT_S": lambda: loop.CHUNKED_WAIT_S,
    "engine.PREFILL_CHUNK": lambda: engine.PREFILL_CHUNK,
    "engine.LOOKUP_FIRST": lambda: engine.lookup_first_match("cpu"),
    "pool.ucb_c": lambda: load_pool(str(DEFAULT_POOL)).ucb_c,
    "pool.lookup": lambda: load_pool(str(DEFAULT_POOL)).lookup,
    "lookup.DEPTH_PRIOR": lambda: LookupDepth.PRIOR,
    "lookup.DEPTH_WEIGHT": lambda: LookupDepth.WEIGHT,
    "head.VOCAB": lambda: _head_rows(),
    "head.STOP": lambda: stop_floor("cpu"),
    "head.FIRST": lambda: first_floor("cpu"),
    "oracle.PLAN_BUDGET": lambda: DynamicPlan({"a": [0]}, 4, 4, 1, PlanCosts.uniform(("a",), 1.0),
                                              lambda: 0).budget,
}
MEASURED = {"lookup.DEPTH_PRIOR": "prior"}


def _head_rows() -> int | None:
    """The rows a bind keeps of a vocabulary larger than any cut (None: every row)."""
    big = 1 << 20
    n = scored_rows(torch.arange(big)).numel()
    return None if n == big else n  # estimated on dev, not chosen from a grid


def test_every_knob_was_chosen_on_dev_from_its_grid():
    data = json.loads(TUNED_FILE.read_text())
    assert data["split"] == "dev"
    assert set(data["knobs"]) == set(RUNTIME)
    for name, k in data["knobs"].items():
        assert k["dev"] and k["chosen_by"] in data["sections"], name
        if name in MEASURED:
            assert k["value"] == data["sections"][k["chosen_by"]][MEASURED[name]], name
        else:
            assert k["value"] in k["grid"], name


@pytest.mark.parametrize("name", sorted(RUNTIME))
def test_the_runtime_runs_the_tuned_value(name):
    assert RUNTIME[name]() == knob(name)


def test_a_missing_or_broken_tuned_file_is_a_one_line_error(tmp_path):
    bad = tmp_path / "tuned.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read the tuned knobs"):
        tuned_knobs(bad)
    bad.write_text(json.dumps({"knobs": {"gate.ALPHA": {"grid": [0.1]}}}))
    with pytest.raises(ConfigError, match="without a value"):
        tuned_knobs(bad)
    with pytest.raises(ConfigError, match="no knob 'gate.NOPE'"):
        knob("gate.NOPE")


def test_a_sweep_setting_runs_from_its_own_tuned_file(tmp_path):
    """MEMSPEC_TUNED names the file a sweep's server reads (the setting under test), and
    the lookup gate's grid holds only settings that differ in what they do."""
    import subprocess
    import sys

    from memspec.bench import tune_lookup_gate as lg
    from memspec.common.tuned import TUNED_ENV

    path = lg.tuned_with(json.loads(TUNED_FILE.read_text()),
                         {"gate.LOOKUP_LOOKS": 8, "gate.LOOKUP_FAILING": None},
                         tmp_path / "t.json")
    code = ("from memspec.procs.decoder.sched.gate import SpecGate as G; "
            "print(G.LOOKUP_LOOKS, G.LOOKUP_FAILING, G.ALPHA)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, TUNED_ENV: str(path)},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["8", "None", str(knob("gate.ALPHA"))]
    assert (0, None) in lg.grid() and (8, (8, 1.25)) not in lg.grid()
    assert all(f is None or f[0] < looks for looks, f in lg.grid())


def _row(value, score, worst=1.0):
    return {"value": value, "over_scales": score, "worst_gmean": worst, "worst_prompt": worst}


def test_choose_keeps_the_bounds_then_the_score_then_the_current_value():
    rows = [_row(1, 1.30, worst=0.80), _row(2, 1.10), _row(3, 1.10), _row(4, 1.05)]
    assert tune.choose(rows, current=9)["value"] == 2  # 1 scores most but breaks the floor
    assert tune.choose(rows, current=3)["value"] == 3  # a tie keeps what runs today
    assert tune.choose([_row(1, 1.3, 0.5)], current=1)["value"] == 1  # nothing safe: the best


def test_ucb_grid_widens_when_the_best_c_is_at_its_top(monkeypatch):
    # the score peaks at c = 10: the grid must grow past 3.0 until a larger c scores less
    monkeypatch.setattr(tune, "_over_target", lambda p, reqs, cost, cfg, general, c=2.0: {
        "over_scales": 1.0 - abs(c - 10.0) / 100, "worst_gmean": 1.0, "worst_prompt": 1.0})
    res = tune.tune_ucb([], None, None, "general", current=2.0)
    assert res["grid"][-2:] == [9.0, 27.0]
    assert res["chosen"] == 9.0 and res["bracketed"]


def test_pool_with_lookup_rewrites_only_the_lookup_and_relative_paths(tmp_path):
    out = tune._pool_with_lookup(DEFAULT_POOL, 3, tmp_path)
    pool = load_pool(str(out))
    default = load_pool(str(DEFAULT_POOL))
    assert pool.lookup == 3
    assert [d.path for d in pool.drafts] == [d.path for d in default.drafts]
    assert (pool.K, pool.gamma, pool.N, pool.general) == (default.K, default.gamma, default.N,
                                                          default.general)


def test_a_rechosen_section_says_what_it_was_chosen_on(tmp_path):
    """`--only` re-chooses some sections: those carry this run's commit, pool and date, the
    kept ones their own (a knob never borrows another run's provenance)."""
    stamp = tune.section_stamp(DEFAULT_POOL)
    assert stamp["commit"] and stamp["pool"]["drafts_sha256"] and stamp["isa"]
    assert len(stamp["date"]) == 10 and "tuned" not in stamp
    kept = {"provenance": {"commit": "old", "date": "2026-01-01"}, "figure": 1.0}
    res = {"gate": {"figure": 1.1}, "ranking": kept}
    tune.stamp_sections(res, ["gate", "lookup"], stamp)  # lookup: not in res, skipped
    assert res["gate"]["provenance"] == stamp and res["gate"]["figure"] == 1.1
    assert res["ranking"]["provenance"]["commit"] == "old"
    assert "lookup" not in res


def test_real_sections_build_on_the_values_chosen_before_them(tmp_path, monkeypatch):
    """A real-run section's servers read the values this run chose so far (the gate the
    simulator just chose, not the committed one): each is tuned beside the others it
    ships with."""
    from memspec.common.tuned import TUNED_ENV

    monkeypatch.delenv(TUNED_ENV, raising=False)
    committed = json.loads(TUNED_FILE.read_text())
    so_far = tune.SoFar(committed, tmp_path)
    gate = json.loads(json.dumps(committed["sections"]["gate"]))
    gate["chosen"]["PRIOR_TAU"] = 2.5
    path = so_far.apply({"gate": gate})
    assert os.environ[TUNED_ENV] == str(path)
    assert tuned_knobs(path)["gate.PRIOR_TAU"]["value"] == 2.5
    assert tuned_knobs(path)["gate.ALPHA"] == committed["knobs"]["gate.ALPHA"] or \
        tuned_knobs(path)["gate.ALPHA"]["value"] == gate["chosen"]["ALPHA"]
    assert so_far.apply({"gate": gate}) != path  # a new file: readers cache by path
    so_far.restore()
    assert TUNED_ENV not in os.environ


def _fig(g):
    return {"gmean": g, "ci95": [g - 0.05, g + 0.05], "min": 0.95, "paired_gmean": g,
            "mean_acceptance_length": 2.0}


@pytest.mark.parametrize("sim_wins", [False, True])
def test_the_simulated_gate_ships_only_where_real_runs_prefer_it(monkeypatch, sim_wins):
    """The simulator chose gates that real runs then lost with (fb6b9f0): its choice goes up
    against the committed constants on dev, and a loss or a tie keeps the committed ones."""
    from memspec.bench import tune_gate_check as gc

    committed = json.loads(TUNED_FILE.read_text())
    now = gc.committed_gate(["PRIOR_TAU", "ALPHA"], committed)
    sim = {"PRIOR_TAU": 1000000 if now["PRIOR_TAU"] != 1000000 else 0.0, "ALPHA": now["ALPHA"]}
    seen = {}

    def fake_run(settings, rows, max_new, repeats, log):
        seen.update(settings)
        path = settings[gc.SIMULATED].env[tune.TUNED_ENV]
        seen["sim_tau"] = tuned_knobs(path)["gate.PRIOR_TAU"]["value"]
        hi, lo = _fig(1.2), _fig(1.1)
        return {"summary": {gc.SIMULATED: hi if sim_wins else lo,
                            gc.COMMITTED: lo if sim_wins else hi},
                "identical_tokens": True}

    monkeypatch.setattr(gc, "run_settings", fake_run)
    section = {"chosen": sim, "grid": {}, "figure": {"over_scales": 1.3, "worst_gmean": 1.0,
                                                     "worst_prompt": 0.9}}
    out = gc.check_gate(DEFAULT_POOL, 1, 8, 1, section)
    assert seen["sim_tau"] == sim["PRIOR_TAU"]  # the simulated server ran the simulated gate
    assert gc.COMMITTED in seen and "target-only" in seen
    assert out["chosen"] == (sim if sim_wins else now)
    assert out["simulated_choice"] == sim and out["committed"] == now
    line = gc.gate_dev_figure(out)
    assert ("kept the simulated" if sim_wins else "kept the committed") in line
    assert "1.300" in line  # the simulator's own figure stays on the record


def test_a_simulated_gate_equal_to_the_committed_one_runs_nothing(monkeypatch):
    from memspec.bench import tune_gate_check as gc

    committed = json.loads(TUNED_FILE.read_text())
    now = gc.committed_gate(["PRIOR_TAU"], committed)
    monkeypatch.setattr(gc, "run_settings", lambda *a: pytest.fail("ran real runs"))
    out = gc.check_gate(DEFAULT_POOL, 1, 8, 1, {"chosen": now, "figure": {}})
    assert out["chosen"] == now and out["real_check"] is None


def test_a_section_reading_tables_gets_tables_made_with_this_runs_head_knobs(
        tmp_path, monkeypatch):
    """head.STOP and head.VOCAB key the tables: once the run chose others, the pool's own
    tables do not load (the first full re-tune stopped there) and the dev prompts are
    traced again into a scratch folder the section reads."""
    from memspec.bench import evaluation
    from memspec.common.paths import HOME_ENV

    calls = []
    monkeypatch.setattr(tune.subprocess, "run", lambda cmd, **kw: calls.append((cmd, kw)) or
                        type("Done", (), {"returncode": 0, "stderr": ""})())
    before = os.environ.get(HOME_ENV)
    with tune.tables_home(DEFAULT_POOL, 2, tmp_path, reads=False):
        pass
    monkeypatch.setattr(evaluation, "load_pool_tables", lambda pool, which: object())
    with tune.tables_home(DEFAULT_POOL, 2, tmp_path, reads=True):
        assert os.environ.get(HOME_ENV) == before
    assert calls == []  # nothing to make: neither section reads tables it lacks

    def missing(pool, which):
        raise ConfigError("no acceptance tables for this pool's drafts")

    monkeypatch.setattr(evaluation, "load_pool_tables", missing)
    with tune.tables_home(DEFAULT_POOL, 2, tmp_path, reads=True):
        home = os.environ[HOME_ENV]
        assert home != before and home.startswith(str(tmp_path))
    assert os.environ.get(HOME_ENV) == before
    (cmd, kw), = calls
    assert cmd[2:4] == ["memspec", "trace"] and "dev:2" in cmd
    assert kw["env"][HOME_ENV] == home


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=TUNED_FILE.parent, capture_output=True, text=True)


def test_every_section_was_chosen_on_the_drafts_that_ship():
    """Each section of tuned.json names the commit, clean tree, pool and date it was chosen
    on, and that commit holds the drafts that ship (a knob tuned for older heads says so by
    failing here); the drafts' bytes it ran are the pool's now."""
    from memspec.common.provenance import pool_identity

    data = json.loads(TUNED_FILE.read_text())
    drafts_commit = _git("log", "-1", "--format=%H", "--", "drafts/").stdout.strip()
    here = pool_identity(DEFAULT_POOL).get("drafts_sha256")
    for name, sec in data["sections"].items():
        prov = sec.get("provenance")
        assert prov and prov.get("commit") and prov.get("clean") is True, name
        assert prov.get("date") and prov.get("isa"), name
        if drafts_commit and _git("cat-file", "-e", prov["commit"]).returncode == 0:
            assert _git("merge-base", "--is-ancestor", drafts_commit,
                        prov["commit"]).returncode == 0, f"{name}: tuned before the drafts"
        if here:
            assert prov["pool"]["drafts_sha256"] == here, f"{name}: tuned on other drafts"
