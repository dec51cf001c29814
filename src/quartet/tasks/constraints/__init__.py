"""constraints: IFEval-style verifiable instructions; gold judge = 1 when the response meets every one, else 0.

Prompts are built by ``python -m quartet.tasks.constraints.build``: a short request followed by one to three
constraint sentences (word and sentence counts, required and banned words and letters, case, the final mark,
bullet points, a JSON object's keys, no commas; quartet.tasks.constraints.checks says how each is read). The judge
reads the constraints back from the prompt text, so a prompt a user writes with the same sentences is judged too;
a prompt with none is a DataError. Kind pairs in combos.HELD_OUT meet only in eval prompts.

Judges: ``task:constraints`` (gold: all met, 1/0) and ``task:constraints/partial`` (the share met, in [0, 1]: a
denser reward for a 3-constraint prompt). Eval reports the gold judge as accuracy, with each kind's share of its
constraints met, the accuracy by number of constraints, and on the held-out pairs.
"""

from __future__ import annotations

import functools
from pathlib import Path

from quartet.errors import DataError
from quartet.tasks.constraints.checks import check, parse
from quartet.tasks.constraints.combos import has_held_out_pair
from quartet.tasks.task import Task


@functools.lru_cache(maxsize=8192)
def _constraints(prompt: str) -> tuple[dict, ...]:
    found = parse(prompt)
    if not found:
        raise DataError(f"task:constraints: the prompt states no constraint the judge can check: {prompt[:80]!r}")
    return tuple(found)


def constraints_of(prompt: str) -> list[dict]:
    """The constraints `prompt` states (checks.parse); DataError when it states none."""
    return list(_constraints(prompt))


def _met(prompt: str, response: str) -> list[bool]:
    return [check(c, response) for c in _constraints(prompt)]


def judge(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 when the response meets every constraint of its prompt, else 0.0."""
    return [float(all(_met(p, r))) for p, r in zip(prompts, responses)]


def partial(prompts: list[str], responses: list[str]) -> list[float]:
    """The share of its prompt's constraints the response meets, in [0, 1]."""
    return [sum(met) / len(met) for met in (_met(p, r) for p, r in zip(prompts, responses))]


def by_kind(prompts: list[str], responses: list[str]) -> list[dict[str, float]]:
    """Each response's groups: every constraint kind of its prompt (1 met, 0 not), ``<k> constraint(s)`` (all met),
    and ``held-out pairs`` (all met) when the prompt combines a pair no train prompt does."""
    out = []
    for p, r in zip(prompts, responses):
        found, met = _constraints(p), _met(p, r)
        groups = {c["kind"]: float(ok) for c, ok in zip(found, met)}
        groups[f"{len(found)} constraint{'s' if len(found) > 1 else ''}"] = float(all(met))
        if has_held_out_pair(list(found)):
            groups["held-out pairs"] = float(all(met))
        out.append(groups)
    return out


RUBRIC = "\n".join([
    "- The answer meets every instruction about its form in the prompt: length, words, letters, case, final "
    "punctuation, bullet points, JSON.",
    "- Among answers that meet them equally, the one that also answers the request well is better.",
])
"""the gold judge in words, for an `llm:` judge"""

TASK = Task(
    name="constraints",
    description="IFEval-style verifiable instructions (counts, words, letters, case, ending, bullets, JSON; 1-3 per "
                "prompt); gold reward = 1 when all are met, else 0.",
    judge=judge,
    data_dir=Path(__file__).parent,
    splits=("train", "eval"),
    score_range=(0.0, 1.0),
    judges={"partial": partial},
    rubric=RUBRIC,
    binary=True,
    breakdown=by_kind,
)
