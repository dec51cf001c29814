"""VADER sentiment (Hutto & Gilbert 2014), the gold judge of the positive-review task.

The analyzer reads its lexicon on construction, so it is built once per process and reused.
"""

from __future__ import annotations

import functools


@functools.cache
def _analyzer():
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    return SentimentIntensityAnalyzer()


def vader_score(texts: list[str]) -> list[float]:
    """VADER compound score of each text, in [-1, 1] (0.0 for an empty text)."""
    analyzer = _analyzer()
    return [float(analyzer.polarity_scores(t)["compound"]) for t in texts]
