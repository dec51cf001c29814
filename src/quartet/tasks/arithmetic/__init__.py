"""arithmetic: integer problems at four levels; gold judge = 1 when the response's answer is right, else 0.

Prompts are built by ``python -m quartet.tasks.arithmetic.build`` (`answer.LEVELS`: one-digit +, -, x; two-digit
with one-digit + and -; two-digit with two-digit and two-digit x one-digit; two steps of one-digit numbers). Each
asks for the answer as ``Answer: <number>``; the judge reads the answer as `answer.extract_answer` does
(``Answer:``, else ``\\boxed{}``, else the last number) and compares it with the value of the prompt's expression,
which it computes itself: any prompt holding one integer expression can be judged, not only the shipped ones.

Judges: ``task:arithmetic`` (gold, 1/0) and ``task:arithmetic/format`` (1 when the answer is marked, ``Answer:
<number>`` or ``\\boxed{...}``, right or wrong): the format reward of DeepSeek-R1's recipe, for a reward list
(`ppo.reward_funcs`). Eval reports the gold judge as accuracy, level by level.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from quartet.errors import DataError
from quartet.tasks.arithmetic.answer import evaluate, extract_answer, has_answer_format, level_of
from quartet.tasks.task import Task

_EXPRESSION = re.compile(r"[(\d][\d\s+\-*\u00d7()]*[\d)]")


@functools.lru_cache(maxsize=8192)
def problem(prompt: str) -> tuple[str, int]:
    """(expression, its value) of the first integer expression in `prompt`; DataError when it holds none."""
    for candidate in _EXPRESSION.findall(prompt):
        if any(op in candidate for op in "+-*\u00d7"):
            try:
                return candidate.strip(), evaluate(candidate)
            except ValueError:
                continue
    raise DataError(f"task:arithmetic: the prompt holds no integer expression to check answers against: {prompt[:80]!r}")


def judge(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 when the response's answer equals the value of its prompt's expression, else 0.0."""
    return [float(extract_answer(r) == problem(p)[1]) for p, r in zip(prompts, responses)]


def answer_format(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 when the response marks its answer (``Answer: <number>`` or ``\\boxed{}``), right or wrong, else 0.0."""
    return [float(has_answer_format(r)) for r in responses]


def by_level(prompts: list[str], responses: list[str]) -> list[dict[str, float]]:
    """Each response's gold score under its prompt's level (``level 1`` .. ``level 4``; ``other`` for an expression
    of no level)."""
    out = []
    for p, score in zip(prompts, judge(prompts, responses)):
        level = level_of(problem(p)[0])
        out.append({f"level {level}" if level else "other": score})
    return out


RUBRIC = "\n".join([
    "- The answer gives the correct value of the arithmetic expression in the prompt.",
    "- It ends with the line `Answer: <number>`.",
])
"""the gold judge and the format reward in words, for an `llm:` judge"""

TASK = Task(
    name="arithmetic",
    description="Integer arithmetic at four levels; gold reward = 1 when the answer (`Answer: N`, \\boxed{N} or "
                "the last number) is right, else 0.",
    judge=judge,
    data_dir=Path(__file__).parent,
    splits=("train", "eval"),
    score_range=(0.0, 1.0),
    judges={"format": answer_format},
    rubric=RUBRIC,
    binary=True,
    breakdown=by_level,
)
