"""positive-review: continue a neutral or mixed movie-review opening; gold judge = VADER of the response.

Prompt files are built by ``python -m quartet.tasks.positive_review.build``; see README.md here for
how much headroom SmolLM2-135M-Instruct leaves.

VADER reads the response alone, so "Your review is fantastic!" scores as high as a glowing review of
the film. The task's other judges see that:

- ``task:positive-review/relevance``: MiniLM cosine similarity of the response to the review opening
  inside the prompt (not the instruction around it, whose words "movie review" would make praise of
  the user's review look relevant);
- ``task:positive-review/on-task``: VADER gated by that relevance (quartet.judges.compose.gate): full
  VADER at relevance >= ON_TASK_HI, -1 (VADER's minimum) at <= ON_TASK_LO, linear in between, so it
  pays only for positive reviews of the film in the prompt. README.md here has the measurements the
  thresholds come from.
"""

from __future__ import annotations

import re
from pathlib import Path

from quartet.judges.compose import gate
from quartet.judges.relevance import relevance_to
from quartet.judges.vader import vader_score
from quartet.tasks.positive_review.build import INSTRUCTIONS
from quartet.tasks.task import Task

ON_TASK_LO, ON_TASK_HI = 0.15, 0.35
"""relevance at or below LO pays the floor, at or above HI the full VADER score (see README.md)"""

_INSTRUCTION_RES = [
    re.compile("^" + re.escape(t).replace(re.escape("{opening}"), "(?P<opening>.+)") + "$", re.S)
    for t in INSTRUCTIONS
]


def judge(prompts: list[str], responses: list[str]) -> list[float]:
    """VADER compound score of each response alone (the prompt is ignored), in [-1, 1]."""
    return vader_score(responses)


def opening(prompt: str) -> str:
    """The review opening inside one of the task's instructions; any other prompt is returned whole."""
    for pattern in _INSTRUCTION_RES:
        m = pattern.match(prompt.strip())
        if m:
            return m.group("opening")
    return prompt


relevance = relevance_to(opening)
on_task = gate(judge, relevance, lo=ON_TASK_LO, hi=ON_TASK_HI, floor=-1.0)

RUBRIC = "\n".join([
    "- The answer is a positive, well-written movie review that continues the given opening.",
    "- It is about the same film as the opening, not another film and not the reviewer.",
    "- It reads as fluent, specific prose, not generic praise.",
])
"""what an `llm:` judge compares this task's answers by: what the gold judge (VADER) pays for, and what the on-task
judge guards (the same film, no praise of anything else)"""

TASK = Task(
    name="positive-review",
    description="Write a short movie review continuing a neutral or mixed opening; "
    "gold reward = VADER sentiment of the response in [-1, 1].",
    judge=judge,
    data_dir=Path(__file__).parent,
    splits=("train", "eval", "sft"),
    score_range=(-1.0, 1.0),
    judges={"relevance": relevance, "on-task": on_task},
    rubric=RUBRIC,
)
