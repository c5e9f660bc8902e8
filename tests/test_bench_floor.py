"""`memspec bench floor`'s statistics: paired repeats cancel the machine's drift."""

from __future__ import annotations

import pytest

from memspec.bench.floor import ratio_summary


def _row(speeds: list[float], tokens: int = 128) -> dict:
    ranked = sorted(speeds)
    return {"e2e_tok_s": ranked[(len(ranked) - 1) // 2], "tokens": tokens,
            "repeats_e2e_tok_s": speeds}


def test_paired_repeats_see_through_a_drifting_machine():
    # memspec is 0.95x target-only in every repeat, but the machine ran at 1.0, 1.5 and 0.7
    # of its speed in turn, and memspec's median repeat fell in another minute than
    # target-only's: the ratio of medians is off, the paired one is exact
    drift = (1.0, 1.5, 0.7)
    runs = [{"id": f"p{i}", "domain": d,
             "memspec": _row([95 * f for f in (drift if i % 2 else drift[::-1])][:2]
                             + [95 * 1.6]),
             "target-only": _row([100 * f for f in (drift if i % 2 else drift[::-1])][:2]
                                 + [100 * 1.6])}
            for i, d in enumerate(("code", "math", "law", "code"))]
    s = ratio_summary(runs, "memspec", "target-only")
    assert s["paired_gmean"] == pytest.approx(0.95)
    assert s["paired_min"] == pytest.approx(0.95)
    lo, hi = s["ci95"]
    assert lo <= s["gmean"] <= hi


def test_a_slower_policy_is_caught_by_its_interval():
    runs = [{"id": f"p{i}", "domain": "code", "memspec": _row([80.0, 82.0, 81.0]),
             "target-only": _row([100.0, 101.0, 99.0])} for i in range(6)]
    s = ratio_summary(runs, "memspec", "target-only")
    assert s["ci95"][1] < 0.9  # clearly below: a bound of 0.97 is not met


def test_the_horizon_sweep_chooses_the_fastest_safe_setting_and_its_pool_copy_works(tmp_path):
    """`bench horizon`: the best geometric mean whose worst prompt clears the floor (ties to
    the larger horizon: fewer rankings); its pool copies keep the pool's drafts and head."""
    from memspec.bench.horizon import FLOOR, NEVER, choose, pool_with_horizon
    from memspec.common.config import load_pool
    from memspec.procs.predictor.ranker import head_path_for

    by_h = {0: {"gmean": 1.20, "min": FLOOR - 0.01}, 64: {"gmean": 1.15, "min": 0.95},
            128: {"gmean": 1.1499, "min": 0.97}, NEVER: {"gmean": 1.05, "min": 0.99}}
    assert choose(by_h) == 128
    src = load_pool("pools/stores.toml", check=False)
    copy = load_pool(pool_with_horizon("pools/stores.toml", 64, tmp_path / "p.toml"),
                     check=False)
    assert copy.rank_horizon == 64 and copy.drafts == src.drafts and copy.target == src.target
    assert copy.predictor_head == head_path_for(src)
