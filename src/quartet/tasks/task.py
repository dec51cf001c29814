"""The :class:`Task` record: a built-in task's prompt files and its judges.

A task reads its own shipped JSONL files: they are package data Quartet wrote (``build.py`` beside each), not user
input, so they need none of the guards `quartet.data.readers` puts on a user's file. The data layer sits above
this one and resolves ``task:<name>/<split>`` paths through :func:`quartet.tasks.get_task`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from quartet.errors import DataError

RewardFn = Callable[[list[str], list[str]], list[float]]


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    judge: RewardFn
    """gold reward: (prompts, responses) -> scores"""
    data_dir: Path
    splits: tuple[str, ...]
    score_range: tuple[float, float]
    """the judge's scores always lie in this closed interval"""
    judges: dict[str, RewardFn] = field(default_factory=dict)
    """other judges of the task by name (reward spec ``task:<name>/<judge>``): an on-task signal, composites"""
    rubric: str = ""
    """the principles an `llm:` judge compares the task's answers by (quartet.judges.llm), one per line; empty: the
    judges' generic rubric"""
    binary: bool = False
    """the gold judge scores right (1) or wrong (0): eval reports its mean as accuracy, pass@1, with pass@k"""
    breakdown: Callable[[list[str], list[str]], list[dict[str, float]]] | None = None
    """(prompts, responses) -> each response's scores by group (a level, a constraint kind), which eval reports
    group by group beside the gold judge's mean; None: no groups"""

    def split_path(self, split: str) -> Path:
        """The JSONL file of ``split``; DataError naming the known splits otherwise."""
        if split not in self.splits:
            raise DataError(f"task:{self.name}/{split}: unknown split (choose from {', '.join(self.splits)})")
        return self.data_dir / f"{split}.jsonl"

    def rows(self, split: str) -> list[dict]:
        """Every row of ``split``: one JSON object per non-blank line, as `quartet.data.read_rows` reads a JSONL."""
        text = self.split_path(split).read_text(encoding="utf-8-sig")
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def prompts(self, split: str) -> list[str]:
        return [row["prompt"] for row in self.rows(split)]


__all__ = ["RewardFn", "Task"]
