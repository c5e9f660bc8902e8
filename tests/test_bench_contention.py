"""`memspec bench contention`'s judge of a load that ends mid-request: a run that ended
before it could show its speed back is too short to judge, never a miss; a long run that
stays slow is one."""

from __future__ import annotations

from memspec.bench.contention import RECOVERY_BOUND_S, _recoveries


def _timeline(gaps: list[float], threads: list[int]) -> list[list[float]]:
    t, out = 0.0, []
    for gap, th in zip(gaps, threads, strict=True):
        t += gap
        out.append([t, 1, th])
    return out


def _row(after_slow: int, after_fast: int, slow_after_load: bool = False) -> dict:
    """20 tokens under the load (10 ms each, one thread), the load ends at 0.205 s, then
    `after_slow` more at 10 ms and `after_fast` at the quiet 5 ms (two threads)."""
    before, n = 20, 20 + after_slow + after_fast
    gaps = [0.01] * (before + after_slow) + [0.005 if not slow_after_load else 0.01] * after_fast
    threads = [1] * (before + after_slow) + [2 if not slow_after_load else 1] * after_fast
    run = {"timeline": _timeline(gaps, threads), "load_on_off_s": [0.0, 0.205],
           "reference_timeline": _timeline([0.005] * n, [2] * n)}
    return {"loads": {"startstop": {"memspec": run}}}


def _recovery(row: dict) -> dict:
    _recoveries(row)
    return row["loads"]["startstop"]["memspec"]["recovery"]


def test_a_run_that_ends_before_its_speed_could_show_is_too_short_to_judge():
    r = _recovery(_row(22, 13))  # 35 tokens after the load, the threads back after 22
    assert r["tokens_after_load"] == 35 and r["rate_back_s"] is None
    assert r["ended_first"]  # (before: counted as "never back")
    assert 0.2 < r["threads_back_s"] < 0.25


def test_a_long_run_is_judged_back_or_never_back():
    back = _recovery(_row(15, 300))
    assert not back["ended_first"] and back["rate_back_s"] < RECOVERY_BOUND_S
    slow = _recovery(_row(15, 300, slow_after_load=True))
    assert not slow["ended_first"] and slow["rate_back_s"] is None  # never back: a miss
