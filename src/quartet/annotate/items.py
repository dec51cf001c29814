"""What a person judges: a samples file's answers grouped by prompt, K answers to one item.

A samples file is what `quartet label` writes beside its pairs (`<stem>.samples.jsonl`, one row per answer:
`prompt`, `completion`, optional `score`). Rows with the same prompt form one item, in the order the prompt first
appears, its answers in file order. Duplicate and empty answers stay: the person sees what the policy gave (the
export drops pairs of identical texts). An item's id hashes its prompt and answers, so the same file gives the same
ids after a restart and a judgment can never land on another item's answers.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from quartet.atomic import atomic_write_text
from quartet.config import DataConfig
from quartet.data.readers import read_table
from quartet.data.schemas import Prompt, load_samples
from quartet.errors import DataError


@dataclass(frozen=True)
class Item:
    id: str
    """first 16 hex digits of sha256(json.dumps([prompt, answers]))"""
    prompt: Prompt
    """text, or chat messages ending with a user turn, as the samples file holds it"""
    answers: tuple[str, ...]
    """the K answers, in file order; the page numbers them 1..K"""
    scores: tuple[float | None, ...]
    """each answer's `score` column (the AI judge's), None where the file has none"""


def item_id(prompt: Prompt, answers) -> str:
    return hashlib.sha256(json.dumps([prompt, list(answers)]).encode()).hexdigest()[:16]


def load_items(path: str | os.PathLike) -> list[Item]:
    """The items of samples file `path`; a row that cannot be used is a DataError naming file, row and field."""
    table = read_table(path)
    if "completion" not in table.rows[0] and "prompt" in table.rows[0]:
        raise DataError(f"{table.where(0)}: no field 'completion': a prompts file has no answers to rank; sample "
                        f"them first: quartet label judge=none prompts.path={path}")
    examples = load_samples(DataConfig(path=str(path)))  # the shared checks of prompt and completion
    groups: dict[str, tuple[Prompt, list[str], list[float | None], int]] = {}
    for i, (example, row) in enumerate(zip(examples, table.rows)):
        key = json.dumps(example.prompt)
        prompt, answers, scores, _ = groups.setdefault(key, (example.prompt, [], [], i))
        answers.append(example.completion)
        scores.append(_score(row.get("score"), table.where(i)))
    items = []
    for prompt, answers, scores, first in groups.values():
        if len(answers) < 2:
            raise DataError(f"{table.where(first)}: field 'prompt' has one answer in the file; ranking needs 2 or "
                            f"more per prompt (quartet label num_samples=K)")
        items.append(Item(item_id(prompt, answers), prompt, tuple(answers), tuple(scores)))
    return items


def _score(value, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{where}: field 'score' must be a finite number or null, got {value!r}")
    return float(value)


def save_items(path: str | os.PathLike, items: list[Item]) -> None:
    """Write the served items beside their judgments (one JSON object a line), so the folder alone can be exported
    after the samples file moved or changed."""
    lines = [json.dumps({"id": it.id, "prompt": it.prompt, "answers": list(it.answers), "scores": list(it.scores)},
                        ensure_ascii=False) for it in items]
    atomic_write_text(Path(path), "".join(line + "\n" for line in lines))


def read_saved_items(path: str | os.PathLike) -> list[Item]:
    """The items `save_items` wrote; a changed file (an id that no longer hashes its text) is a DataError."""
    items = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                row = json.loads(line)
                item = Item(row["id"], row["prompt"], tuple(row["answers"]), tuple(row["scores"]))
            except (ValueError, KeyError, TypeError) as e:
                raise DataError(f"{path} line {n}: not an item written by quartet annotate ({e})") from None
            if item_id(item.prompt, item.answers) != item.id:
                raise DataError(f"{path} line {n}: item {item.id} does not match its prompt and answers (the file "
                                f"was edited); its judgments would land on other answers")
            items.append(item)
    return items
