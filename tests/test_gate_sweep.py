"""`memspec bench gate`: the sweep replays the runtime's gate under each setting and leaves the
gate's shipped constants as they were."""

from __future__ import annotations

import pytest
from test_gate import DRAFTS, cost, tables

from memspec.bench.gate_sweep import FLOOR, GMEAN_FLOOR, gate_constants, sweep
from memspec.procs.decoder.sched.gate import SpecGate
from memspec.sim.simulate import SimConfig, SimRequest


def test_constants_are_restored_even_when_a_setting_fails():
    before = SpecGate.ALPHA, SpecGate.FIRST_LOOK
    with pytest.raises(RuntimeError), gate_constants({"ALPHA": 0.9, "FIRST_LOOK": 99}):
        assert (SpecGate.ALPHA, SpecGate.FIRST_LOOK) == (0.9, 99)
        raise RuntimeError
    assert before == (SpecGate.ALPHA, SpecGate.FIRST_LOOK)


def test_the_sweep_tells_settings_apart_and_picks_one_within_the_bounds():
    """A draft that accepts little and one that accepts almost everything: a longer first
    look costs on the first, so the table differs by setting, and the pick is the setting
    that gains the most over the iteration costs among those within the bounds."""
    c = cost()
    reqs = [SimRequest("bad", "x", 60, tables(0.3, seed=1, length=128)),
            SimRequest("good", "x", 60, tables(0.95, seed=2, length=128))]
    cfg = SimConfig(DRAFTS, "general", K=2, N=4, gamma=4, plan=c.plan_costs())
    grid = {"FIRST_LOOK": (1, 8), "NEAR_MISS": (0.0,), "PRIOR_TAU": (10**6,)}  # free looks
    res = sweep(reqs, c, cfg, "general", grid=grid, scales=(1.0, 0.5))
    assert len(res["table"]) == 2 and len(res["scales"]) == 2
    short, long = (t["by_scale"][0]["min"] for t in res["table"])
    assert long < short  # eight looks at a draft that does not pay cost more than one
    ok = [t for t in res["table"] if t["worst_gmean"] >= GMEAN_FLOOR and t["worst_prompt"] >= FLOOR]
    assert res["best"] == max(ok or res["table"], key=lambda t: t["over_scales"])
    assert res["current"] is None  # the shipped constants are not in this grid
