"""positive-review: continue a neutral or mixed movie-review opening; gold judge = VADER of the response.

Prompt files are built by ``python -m quartet.tasks.positive_review.build``; see README.md here for
how much headroom SmolLM2-135M-Instruct leaves.
"""

from __future__ import annotations

from pathlib import Path

from quartet.judges.vader import vader_score
from quartet.tasks import Task


def judge(prompts: list[str], responses: list[str]) -> list[float]:
    """VADER compound score of each response alone (the prompt is ignored), in [-1, 1]."""
    return vader_score(responses)


TASK = Task(
    name="positive-review",
    description="Write a short movie review continuing a neutral or mixed opening; "
    "gold reward = VADER sentiment of the response in [-1, 1].",
    judge=judge,
    data_dir=Path(__file__).parent,
    splits=("train", "eval", "sft"),
    score_range=(-1.0, 1.0),
)
