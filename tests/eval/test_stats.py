"""quartet.eval.stats against hand-worked numbers and closed forms."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quartet.eval.stats import (
    bootstrap_ci,
    distinct_n,
    mean_repetition_rate,
    ngrams,
    paired_bootstrap_diff,
    repetition_rate,
    win_rate,
)


# --------------------------------------------------------------------------- distinct-n / repetition
def test_ngrams_of_short_sequence_are_empty():
    assert ngrams("a b", 3) == []
    assert ngrams([1, 2, 3], 2) == [(1, 2), (2, 3)]
    with pytest.raises(ValueError):
        ngrams("a", 0)


def test_distinct_n_hand_worked():
    # unigrams a b a b -> {a, b} / 4; bigrams ab ba ab -> {ab, ba} / 3
    assert distinct_n(["a b a b"], 1) == 0.5
    assert distinct_n(["a b a b"], 2) == pytest.approx(2 / 3)
    # token ids: (1,2) (2,3) (1,2) (2,4) -> 3 distinct of 4
    assert distinct_n([[1, 2, 3], [1, 2, 4]], 2) == 0.75


def test_distinct_n_corpus_vs_per_sequence():
    # every answer the same: each is fully diverse in itself, the corpus is not
    same = ["the cat sat", "the cat sat", "the cat sat", "the cat sat"]
    assert distinct_n(same, 2, per_sequence=True) == 1.0
    assert distinct_n(same, 2) == pytest.approx(2 / 8)


def test_distinct_n_accepts_one_text_or_one_token_list():
    assert distinct_n("a b a b", 1) == 0.5
    assert distinct_n([5, 6, 5, 6], 1) == 0.5


def test_tensors_and_arrays_compare_tokens_by_value():
    import torch

    rows = [[1, 2, 3], [1, 2, 4]]
    assert distinct_n(torch.tensor(rows), 2) == distinct_n(np.array(rows), 2) == 0.75
    assert distinct_n([torch.tensor(r) for r in rows], 2) == 0.75
    assert repetition_rate(torch.tensor([7] * 10), n=4) == pytest.approx(1 - 1 / 7)


def test_distinct_n_without_ngrams_is_zero():
    assert distinct_n([], 2) == 0.0
    assert distinct_n(["a", "b"], 2) == 0.0
    assert distinct_n(["a", "b"], 2, per_sequence=True) == 0.0


def test_repetition_rate_hand_worked():
    # 9 tokens -> 7 trigrams abc bca cab abc bca cab abc, 3 distinct -> 4 of 7 repeat
    assert repetition_rate("a b c a b c a b c", n=3) == pytest.approx(4 / 7)
    assert repetition_rate("one two three four five", n=4) == 0.0
    assert repetition_rate("too short", n=4) == 0.0
    # a loop of one token: k n-grams, 1 distinct
    assert repetition_rate([7] * 10, n=4) == pytest.approx(1 - 1 / 7)


def test_repetition_is_one_minus_per_sequence_distinct():
    text = "x y x y z x y z q"
    assert repetition_rate(text, n=2) == pytest.approx(1 - distinct_n([text], 2, per_sequence=True))
    assert mean_repetition_rate(["a a a a a", "a b c d e"], n=4) == pytest.approx((1 - 1 / 2 + 0) / 2)
    assert mean_repetition_rate([], n=4) == 0.0


# --------------------------------------------------------------------------- bootstrap
def test_bootstrap_constant_values_have_zero_width():
    assert bootstrap_ci([2.5] * 7) == (2.5, 2.5, 2.5)
    assert bootstrap_ci([4.0]) == (4.0, 4.0, 4.0)


def test_bootstrap_two_points_exact_distribution():
    # resample means of [0, 1] take 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4
    mean, lo, hi = bootstrap_ci([0.0, 1.0], n_boot=4000)
    assert (mean, lo, hi) == (0.5, 0.0, 1.0)
    # the 30% and 70% quantiles both fall inside the 1/2 mass at 0.5
    assert bootstrap_ci([0.0, 1.0], n_boot=4000, alpha=0.6) == (0.5, 0.5, 0.5)


def test_bootstrap_matches_normal_interval_for_large_samples():
    x = np.random.default_rng(1).normal(3.0, 2.0, size=500)
    mean, lo, hi = bootstrap_ci(x, n_boot=4000)
    half = 1.96 * x.std(ddof=1) / math.sqrt(x.size)
    assert mean == pytest.approx(x.mean())
    assert lo == pytest.approx(mean - half, abs=0.1 * half)
    assert hi == pytest.approx(mean + half, abs=0.1 * half)


def test_bootstrap_coverage_is_near_nominal():
    rng = np.random.default_rng(0)
    hits = 0
    trials = 200
    for t in range(trials):
        _, lo, hi = bootstrap_ci(rng.normal(0.0, 1.0, size=40), n_boot=1000, seed=t)
        hits += lo <= 0.0 <= hi
    # percentile bootstrap slightly under-covers at n=40; binomial sd at 200 trials is ~1.6 points
    assert 0.88 <= hits / trials <= 0.99


def test_bootstrap_is_deterministic_given_seed():
    x = np.random.default_rng(0).normal(size=30)
    assert bootstrap_ci(x, seed=3) == bootstrap_ci(x, seed=3)
    assert bootstrap_ci(x, seed=3) != bootstrap_ci(x, seed=4)


def test_bootstrap_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        bootstrap_ci([])
    with pytest.raises(ValueError, match="NaN"):
        bootstrap_ci([1.0, float("nan")])
    with pytest.raises(ValueError, match="alpha"):
        bootstrap_ci([1.0, 2.0], alpha=1.5)


def test_paired_diff_cancels_shared_difficulty():
    # per-prompt difficulty varies a lot, but a is always exactly 0.3 better
    difficulty = np.random.default_rng(0).normal(0, 5, size=50)
    a, b = difficulty + 0.3, difficulty
    mean, lo, hi = paired_bootstrap_diff(a, b)
    assert (mean, lo, hi) == pytest.approx((0.3, 0.3, 0.3))
    # resampling each list on its own would give an interval wider than the effect
    _, lo_a, hi_a = bootstrap_ci(a)
    assert hi_a - lo_a > 1.0


def test_paired_diff_equals_bootstrap_of_differences():
    a, b = [1.0, 2.0, 4.0, 3.0], [0.5, 2.5, 1.0, 3.0]
    assert paired_bootstrap_diff(a, b, seed=7) == bootstrap_ci([0.5, -0.5, 3.0, 0.0], seed=7)
    with pytest.raises(ValueError, match="equal lengths"):
        paired_bootstrap_diff([1.0], [1.0, 2.0])


# --------------------------------------------------------------------------- win rate
def test_win_rate_hand_worked():
    a = [1.0, 2.0, 3.0, 4.0]
    b = [0.0, 2.0, 5.0, 4.05]
    # win, tie, loss, loss -> (1 + 0.5) / 4
    assert win_rate(a, b) == 0.375
    # with eps 0.1 the last one is a tie too -> (1 + 0.5 + 0.5) / 4
    assert win_rate(a, b, tie_eps=0.1) == 0.5
    assert win_rate([1.0], [1.0]) == 0.5


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.tuples(st.floats(-10, 10), st.floats(-10, 10)), min_size=1, max_size=30),
    st.floats(0, 1),
)
def test_win_rate_is_antisymmetric(pairs, eps):
    a, b = [p[0] for p in pairs], [p[1] for p in pairs]
    assert win_rate(a, b, eps) + win_rate(b, a, eps) == pytest.approx(1.0)
    assert 0.0 <= win_rate(a, b, eps) <= 1.0
