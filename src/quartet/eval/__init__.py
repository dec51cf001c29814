"""Evaluation: reward-model accuracy, policy evaluation (quartet.eval.evaluate) and the statistics they use."""

from quartet.eval.stats import (
    bootstrap_ci,
    distinct_n,
    mean_repetition_rate,
    ngrams,
    paired_bootstrap_diff,
    repetition_rate,
    win_rate,
)

__all__ = [
    "bootstrap_ci",
    "distinct_n",
    "mean_repetition_rate",
    "ngrams",
    "paired_bootstrap_diff",
    "repetition_rate",
    "win_rate",
]
