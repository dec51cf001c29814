"""Judges: scorer functions behind one signature, and the built-in ones by name.

A judge (a reward function) is ``(prompts: list[str], responses: list[str]) -> list[float]``, one finite score per
response. Here: VADER sentiment (:mod:`quartet.judges.vader`), MiniLM relevance (:mod:`quartet.judges.relevance`),
judges combined from judges (:mod:`quartet.judges.compose`) and user callables bounded in time
(:mod:`quartet.judges.bounded`). :data:`JUDGES` names the built-in ones for the spec ``judge:<name>``.

A language model as judge (``llm:<model>``) compares two answers instead of scoring one: :mod:`quartet.judges.llm`
loads one (a local model, :mod:`~quartet.judges.llm_local`, or an OpenAI-compatible server,
:mod:`~quartet.judges.llm_http`), :mod:`~quartet.judges.pairwise` judges pairs in both orders and ranks answers by
their wins, :mod:`~quartet.judges.verdict_cache` keeps the verdicts on disk. Not imported here: they load
transformers, which the scorer functions do not need.

This package knows nothing of tasks: the tasks build their judges from these. A reward spec string (``task:<name>``,
``judge:<name>``, ``module:function``, combinations) becomes a checked reward function in
:mod:`quartet.rollout.rewards`.
"""

from __future__ import annotations

from collections.abc import Callable

from quartet.judges.relevance import relevance as relevance_judge
from quartet.judges.vader import vader_score

RewardFn = Callable[[list[str], list[str]], list[float]]


def _vader(prompts: list[str], responses: list[str]) -> list[float]:
    """VADER compound sentiment of each response alone, in [-1, 1]."""
    return vader_score(responses)


JUDGES: dict[str, RewardFn] = {"relevance": relevance_judge, "vader": _vader}
"""built-in judges, named in specs as ``judge:<name>``"""


__all__ = ["JUDGES", "RewardFn", "relevance_judge", "vader_score"]
