"""The context lookup's proposal length (procs/decoder/drafts/lookup_depth.py): as many tokens as
pay for their verify rows, learnt from the request's own verifies."""

from __future__ import annotations

import pytest

from memspec.bench.tune_lookup_depth import MIN_VERIFIES, prior_by_match, prior_from_counts
from memspec.procs.decoder.drafts.lookup import NgramIndex
from memspec.procs.decoder.drafts.lookup_depth import LookupDepth, buckets

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
    assert d.tries == [[1.0, 1.0, 0.0, 0.0]] and d.hits == [[1.0, 0.0, 0.0, 0.0]]
    d.observe(2, 2)  # a two-token proposal accepted whole: depth 3 not reached
    assert d.tries == [[2.0, 2.0, 0.0, 0.0]] and d.hits == [[2.0, 1.0, 0.0, 0.0]]


def test_prior_pads_and_is_clamped():
    d = LookupDepth(STEP, STEP, 6, [1.0, 0.0], 4.0)
    assert len(d.tries[0]) == 6 and 0 < d.q(1) < 1 and 0 < d.q(2) < 1
    assert d.q(6) == d.q(2)
    with pytest.raises(ValueError):
        LookupDepth(STEP, STEP, 0, [0.5], 1.0)


def test_prior_from_accepted_counts():
    # 10 verifies: 4 accepted none, 2 one, 1 two, 0 three, 3 all four
    q = prior_from_counts([4, 2, 1, 0, 3], 4)
    assert q == [pytest.approx(0.6), pytest.approx(4 / 6, abs=1e-4), pytest.approx(0.75),
                 pytest.approx(1.0)]
    assert prior_from_counts([], 2) == [0.5, 0.5]


# dev's shape: a shortest match (2 tokens) is weak, a clause-long one strong
BY_MATCH = [[0, [0.47, 0.6, 0.7, 0.7]], [6, [0.82, 0.9, 0.9, 0.9]]]


def test_a_long_match_earns_a_longer_proposal_than_a_short_one():
    d = depth(2.2, prior=BY_MATCH)
    assert d.choose(100, match=2) < d.choose(100, match=8) == 4
    assert d.bucket(2) == d.bucket(5) == 0 and d.bucket(6) == d.bucket(8) == 1
    assert d.bucket(0) == 0  # no match (a datastore led): the first bucket


def test_each_match_bucket_learns_from_its_own_verifies():
    d = depth(1.6, prior=BY_MATCH)
    long_before = d.q(1, 8)
    for _ in range(40):  # short matches that never pay
        d.observe(d.choose(100, 2), 0, 2)
    assert d.q(1, 2) < 0.3 and d.q(1, 8) == long_before
    assert d.choose(100, 2) == 1 and d.choose(100, 8) == 4


def test_buckets_read_both_prior_forms():
    assert buckets([0.5, 0.6]) == [(0, [0.5, 0.6])]
    assert buckets([[6, [0.9]], [0, [0.4]]]) == [(0, [0.4]), (6, [0.9])]


def test_the_engine_match_is_the_longest_suffix_seen_before():
    ng = NgramIndex(2, [1, 2, 3, 4, 9, 1, 2, 3, 4])
    assert ng.match([9, 1, 2, 3, 4]) == 4 and ng.propose([9, 1, 2, 3, 4]) == 9
    assert ng.match([7, 3, 4]) == 2 and ng.match([4, 7]) == 0


def test_prior_by_match_buckets_and_folds_thin_ones():
    n = MIN_VERIFIES
    verifies = [(2, 0)] * n + [(2, 4)] * n + [(4, 1)] * 3 + [(8, 4)] * n
    prior, counts = prior_by_match(verifies, 4)
    # 2-token matches, the 3-5 bucket too thin to stand alone (folded into the one below),
    # then 6+
    assert [c[0] for c in counts] == [0, 6]
    assert counts[0][1] == [n, 3, 0, 0, n] and counts[1][1] == [0, 0, 0, 0, n]
    assert prior[1][1] == [1.0, 1.0, 1.0, 1.0]
    assert prior_by_match([], 4)[1] == [[0, [0, 0, 0, 0, 0]]]
