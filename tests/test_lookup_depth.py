"""The context lookup's proposal length (procs/decoder/lookup_depth.py): as many tokens as
pay for their verify rows, learnt from the request's own verifies."""

from __future__ import annotations

import pytest

from memspec.bench.tune_lookup_depth import prior_from_counts
from memspec.procs.decoder.lookup_depth import LookupDepth

STEP = (3.7e-3, 0.0)


def depth(verify_steps: float, prior=(0.57, 0.75, 0.75, 0.75), weight=8.0) -> LookupDepth:
    return LookupDepth(STEP, (verify_steps * STEP[0], 0.0), 4, prior, weight)


def test_cheap_rows_propose_everything_costly_rows_fewer():
    # dev's acceptance: all four pay where a 5-row verify costs 1.6 steps (AVX-512), two
    # where it costs 2.2 (AVX2 in the pipeline), one where rows cost a step each
    assert depth(1.6).choose(100) == 4
    assert depth(2.2).choose(100) == 2
    assert depth(5.0).choose(100) == 1


def test_rows_cost_interpolates_between_step_and_verify():
    d = LookupDepth((1e-3, 1e-6), (2e-3, 2e-6), 4, [0.5], 1.0)
    assert d.rows_cost(1, 100) == pytest.approx(1.0)
    assert d.rows_cost(5, 100) == pytest.approx(2.0)
    assert d.rows_cost(3, 100) == pytest.approx(1.5)


def test_the_request_own_verifies_move_the_choice():
    d = depth(2.2)
    for _ in range(30):  # a text whose repeats are whole: every proposal accepted
        d.observe(d.choose(100), d.choose(100))
    assert d.choose(100) == 4
    d = depth(1.6)
    for _ in range(30):  # a text that repeats single words: nothing past the first token
        k = d.choose(100)
        d.observe(k, 0)
    assert d.choose(100) == 1


def test_observe_counts_reached_depths_only():
    d = LookupDepth(STEP, STEP, 4, [0.5, 0.5, 0.5, 0.5], 0.0)
    d.observe(4, 1)  # depth 1 passed, depth 2 reached and failed, 3 and 4 not reached
    assert d.tries == [1.0, 1.0, 0.0, 0.0] and d.hits == [1.0, 0.0, 0.0, 0.0]
    d.observe(2, 2)  # a two-token proposal accepted whole: depth 3 not reached
    assert d.tries == [2.0, 2.0, 0.0, 0.0] and d.hits == [2.0, 1.0, 0.0, 0.0]


def test_prior_pads_and_is_clamped():
    d = LookupDepth(STEP, STEP, 6, [1.0, 0.0], 4.0)
    assert len(d.tries) == 6 and 0 < d.q(1) < 1 and 0 < d.q(2) < 1
    assert d.q(6) == d.q(2)
    with pytest.raises(ValueError):
        LookupDepth(STEP, STEP, 0, [0.5], 1.0)


def test_prior_from_accepted_counts():
    # 10 verifies: 4 accepted none, 2 one, 1 two, 0 three, 3 all four
    q = prior_from_counts([4, 2, 1, 0, 3], 4)
    assert q == [pytest.approx(0.6), pytest.approx(4 / 6, abs=1e-4), pytest.approx(0.75),
                 pytest.approx(1.0)]
    assert prior_from_counts([], 2) == [0.5, 0.5]
