"""Build the arithmetic prompt files, deterministically.

    python -m quartet.tasks.arithmetic.build      # rewrites train/eval.jsonl next to this file

Each level is a set of expression shapes (`answer.shape`: an operand's digit count, the operators); a problem
draws a shape of its level, then its operands (one-digit operands from 1-9, two-digit from 10-99). Every problem
is one expression: no problem appears in both splits, nor twice in one (whatever its phrasing). Eval takes its
problems first, EVAL_PER_LEVEL per level, its levels interleaved (the first 4k prompts hold k of each); level 1
has only 243 problems, so its train split holds what remains (168).
Rows: ``{"prompt", "expression", "answer", "level"}``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from quartet.atomic import atomic_write_text
from quartet.tasks.arithmetic.answer import LEVELS, evaluate

HERE = Path(__file__).parent
SEED = 0
EVAL_PER_LEVEL = 75
TRAIN_PER_LEVEL = 500

TEMPLATES = (
    'What is {expression}? End your reply with "Answer: " and the number.',
    'Calculate {expression}. Give the result on the last line as "Answer: <number>".',
    'Solve: {expression}. Finish with "Answer: " followed by the result.',
)
"""the phrasings, each asking for the format `answer.marked_answer` reads first"""


def _draw(rng: random.Random, level: int) -> str:
    parts = rng.choice(LEVELS[level]).split()
    return " ".join(str(rng.randint(1, 9) if p == "1" else rng.randint(10, 99)) if p.isdigit() else p for p in parts)


def build() -> dict[str, list[dict]]:
    rng = random.Random(SEED)
    seen: set[str] = set()
    out: dict[str, list[list[dict]]] = {"train": [], "eval": []}  # split -> level -> rows
    for split, per_level in (("eval", EVAL_PER_LEVEL), ("train", TRAIN_PER_LEVEL)):
        for level in LEVELS:
            rows, misses = [], 0
            while len(rows) < per_level and misses < 10_000:  # level 1 runs out of new problems
                expression = _draw(rng, level)
                if expression in seen:
                    misses += 1
                    continue
                seen.add(expression)
                prompt = rng.choice(TEMPLATES).format(expression=expression)
                rows.append({"prompt": prompt, "expression": expression, "answer": evaluate(expression),
                             "level": level})
            out[split].append(rows)
    # eval interleaves the levels, so its first 4k prompts (num_prompts) hold k of each; train is shuffled
    eval_rows = [row for group in zip(*out["eval"]) for row in group]
    train_rows = [row for rows in out["train"] for row in rows]
    rng.shuffle(train_rows)
    return {"train": train_rows, "eval": eval_rows}


def main() -> None:
    for split, rows in build().items():
        atomic_write_text(HERE / f"{split}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        print(f"{split}: {len(rows)} rows")


if __name__ == "__main__":
    main()
