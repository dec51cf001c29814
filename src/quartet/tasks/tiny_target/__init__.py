"""tiny-target: a task a tiny random-init byte-level model learns in seconds (for tests and smoke runs).

Prompts are short random lowercase strings (``python -m quartet.tasks.tiny_target.build`` writes
them); the gold judge is the fraction of response characters that are in :data:`TARGET_CHARS`.
A policy maximises it by answering with "a" and digits only (none of them appear in the prompts, so
copying the prompt earns nothing; 11 of the 256 byte tokens score, so a random byte model finds them).
"""

from __future__ import annotations

from pathlib import Path

from quartet.tasks import Task

TARGET_CHARS = frozenset("a0123456789")
"""characters that score; the judge is the share of response characters in this set"""


def judge(prompts: list[str], responses: list[str]) -> list[float]:
    """Fraction of each response's characters in TARGET_CHARS, in [0, 1]; an empty response scores 0."""
    return [sum(c in TARGET_CHARS for c in r) / len(r) if r else 0.0 for r in responses]


TASK = Task(
    name="tiny-target",
    description="Random-letter prompts; gold reward = fraction of response characters that are 'a' or a digit (in [0, 1]).",
    judge=judge,
    data_dir=Path(__file__).parent,
    splits=("train", "eval"),
    score_range=(0.0, 1.0),
)
