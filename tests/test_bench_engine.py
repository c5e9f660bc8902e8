"""`memspec bench engine`'s timing arithmetic: costs timed round by round, ratios per round."""

from __future__ import annotations

from memspec.bench.engine import _paired, _rounds_ms


def test_rounds_time_each_cost_once_per_round_in_turn():
    calls: list[str] = []
    times = _rounds_ms({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                       reps=3, warm=1)
    assert calls == ["a", "b"] * 4  # one warm round, then three timed ones, in turn
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    assert all(t >= 0 for v in times.values() for t in v)


def test_a_ratio_is_the_median_of_each_rounds_own():
    # rounds at three machine speeds; b costs half of a within every round but the third,
    # which a burst of load hit between the two timings
    times = {"a": [2.0, 6.0, 6.0], "b": [1.0, 3.0, 1.0]}
    assert _paired(times, "a", "b") == 2.0  # the medians' ratio would say 6
