"""Built-in tasks: prompt files shipped with the package plus a gold judge.

``get_task(name)`` returns a :class:`Task`; ``task:<name>/<split>`` works as a data path anywhere a
dataset file does, ``task:<name>`` as a reward spec (the gold judge) and ``task:<name>/<judge>`` as
one of the task's other judges (:attr:`Task.judges`).

- ``positive-review`` (default): write a short movie review continuing a neutral or mixed opening;
  gold judge = VADER compound sentiment of the response, in [-1, 1]. Splits: train (480),
  eval (96, films never seen in train), sft (198 demonstrations of mixed sentiment). Judges:
  ``relevance`` (MiniLM similarity of the response to the review opening) and ``on-task`` (VADER gated
  by that relevance: pays only for positive reviews of the film in the prompt).
- ``constraints``: IFEval-style verifiable instructions (word and sentence counts, required and banned words and
  letters, case, the final mark, bullets, a JSON object's keys, no commas; one to three per prompt); gold judge =
  1 when all are met, else 0. Splits: train (2000), eval (300, on topics never seen in train; a third combine
  a kind pair no train prompt does). Judge ``partial``: the share met.
- ``arithmetic``: integer problems at four levels; gold judge = 1 when the answer (``Answer: N``, else
  ``\\boxed{N}``, else the last number) is right, else 0. Splits: train (1668), eval (300: 75 per level, levels
  interleaved; no problem in both). Judge ``format``: 1 when the answer is marked, right or wrong.
- ``tiny-target``: short random-letter prompts for tests with tiny byte-level models; gold judge =
  fraction of response characters in :data:`quartet.tasks.tiny_target.TARGET_CHARS`, in [0, 1]. Judge
  ``relevance``: share of response characters found in the prompt (the gold judge pays for off-task text).
"""

from __future__ import annotations

import difflib

from quartet.errors import DataError
from quartet.tasks import arithmetic, constraints, positive_review, tiny_target
from quartet.tasks.task import RewardFn, Task

_TASKS: dict[str, Task] = {t.name: t for t in (positive_review.TASK, tiny_target.TASK, constraints.TASK, arithmetic.TASK)}


def list_tasks() -> list[str]:
    return sorted(_TASKS)


def get_task(name: str) -> Task:
    if name not in _TASKS:
        close = difflib.get_close_matches(name, list(_TASKS), n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known tasks: {', '.join(sorted(_TASKS))}"
        raise DataError(f"task:{name}: unknown task ({hint})")
    return _TASKS[name]


def cli(args=None) -> int:
    """``quartet tasks``: each built-in task with its splits, row counts and description."""
    for name in list_tasks():
        task = get_task(name)
        splits = ", ".join(f"{s} ({len(task.rows(s))} rows)" for s in task.splits)
        lo, hi = task.score_range
        print(f"{name}\n  {task.description}\n  splits: {splits}\n  gold judge range: [{lo:g}, {hi:g}]; "
              f"use as data `task:{name}/<split>`, as reward `task:{name}`")
        if task.judges:
            print(f"  other judges: {', '.join(f'task:{name}/{j}' for j in task.judges)}")
    return 0


__all__ = ["RewardFn", "Task", "cli", "get_task", "list_tasks"]
