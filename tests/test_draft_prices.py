"""Draft steps timed at start, once per draft shape, and kept per machine and build."""

from __future__ import annotations

import shutil

from test_engine import engine_with
from tinymodels import TINY_VOCAB

from memspec.common.config import parse_pool
from memspec.procs.decoder.oracle import draft_prices
from memspec.procs.decoder.sched.gate import GateCosts
from memspec.procs.decoder.service import open_drafts
from memspec.procs.decoder.slots import SlotBuffer


def test_each_draft_shape_is_timed_once_and_read_back_after(tmp_path, tiny_dir, tiny_heads,
                                                            monkeypatch):
    """Two heads of one shape share one timing, a draft model of another shape gets its own,
    and a restarted decoder reads both from the cache without timing anything (nor needing
    a slot); every draft's line is the verify plus its measured gamma steps."""
    monkeypatch.setenv("MEMSPEC_HOME", str(tmp_path / "home"))
    for name in ("h1", "h2"):
        shutil.copytree(tiny_heads[0], tmp_path / name)
    pool = parse_pool({"pool": {"target": str(tiny_dir / "target"), "dtype": "int4"},
                       "drafts": [{"name": "h1", "path": str(tmp_path / "h1"), "kind": "head"},
                                  {"name": "h2", "path": str(tmp_path / "h2"), "kind": "head"},
                                  {"name": "small", "path": str(tiny_dir / "small")}]},
                      tmp_path)
    files, quarantined = open_drafts(pool, TINY_VOCAB)
    assert not quarantined and set(files) == {"h1", "h2", "small"}
    eng = engine_with(tiny_dir, [], dtype="int4")
    timed: list[float] = []
    real = draft_prices.draft_gamma_s

    def counting(engine, bound, gamma):
        timed.append(real(engine, bound, gamma))
        return timed[-1]

    monkeypatch.setattr(draft_prices, "draft_gamma_s", counting)
    costs = GateCosts(target=(1e-3, 1e-6), verify=(2e-3, 2e-6), draft_prior_s=0.8e-3, gamma=4)
    priced = draft_prices.price_drafts(costs, eng, pool, SlotBuffer(1 << 20), files, "int4-test")
    assert len(timed) == 2 and all(s > 0 for s in timed)
    assert priced.spec["h1"] == priced.spec["h2"] == (2e-3 + timed[0], 2e-6)  # (files' order)
    assert priced.spec["small"] == (2e-3 + timed[1], 2e-6)

    again = draft_prices.price_drafts(costs, eng, pool, None, files, "int4-test")
    assert len(timed) == 2  # read back, nothing timed
    assert again.spec == priced.spec
