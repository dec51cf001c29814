"""Build the constraints prompt files, deterministically.

    python -m quartet.tasks.constraints.build      # rewrites train/eval.jsonl next to this file

A prompt is a short request (a topic) followed by the sentences of one to three constraints
(quartet.tasks.constraints.checks). Constraints in one prompt never contradict each other: each kind has a slot
(two word counts, two case rules never meet), combos.CONFLICTS lists the kinds that cannot share a prompt (a JSON object
has no sentences to count nor a final question mark), and a banned letter is never one a required word or key holds.

Held out entirely: the topics of EVAL_TOPICS, and the kind pairs of combos.HELD_OUT, which never share a train prompt.
Eval holds singles, pairs and triples of seen combinations on its own topics, and a third of its prompts combine a
held-out pair. Rows: ``{"prompt", "topic", "constraints", "held_out"}``; ``held_out`` marks a held-out pair.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from quartet.atomic import atomic_write_text
from quartet.tasks.constraints.checks import KINDS, render
from quartet.tasks.constraints.combos import HELD_OUT, compatible, has_held_out_pair

HERE = Path(__file__).parent
SEED = 0
N_TRAIN = 2000
N_EVAL = 300

TOPICS = [
    "Describe a rainy afternoon.", "Tell me about your favorite season.", "Explain why people keep pets.",
    "Give advice to a student starting a new school.", "Describe the ocean at night.", "Explain how to make tea.",
    "Tell me about a good book.", "Describe a busy train station.", "Explain why sleep matters.",
    "Give tips for a job interview.", "Describe a mountain village.", "Explain what a library is for.",
    "Tell me about a memorable meal.", "Describe a city park in spring.", "Explain how bees help plants.",
    "Give advice for learning to cook.", "Describe a thunderstorm.", "Explain why people travel.",
    "Tell me about a favorite song.", "Describe an old bicycle.", "Explain how to plant a tree.",
    "Give tips for saving money.", "Describe a winter morning.", "Explain what friendship means.",
    "Tell me about a small town.", "Describe a crowded market.", "Explain why exercise is useful.",
    "Give advice for a first camping trip.", "Describe a quiet beach.", "Explain how a bicycle works.",
    "Tell me about a museum visit.", "Describe a kitchen in the morning.", "Explain why reading helps.",
    "Give tips for staying focused.", "Describe a forest path.", "Explain how rain forms.",
    "Tell me about a birthday party.", "Describe a lighthouse.", "Explain why maps are useful.",
    "Give advice for a long flight.", "Describe a snowy street.", "Explain how to care for a plant.",
    "Tell me about learning to swim.", "Describe a summer festival.", "Explain why music matters.",
    "Give tips for writing a letter.", "Describe a river in autumn.", "Explain how a clock works.",
    # eval only
    "Describe a desert at sunrise.", "Explain why people tell stories.", "Give advice for moving to a new city.",
    "Tell me about a favorite teacher.", "Describe a harbor at dawn.", "Explain how to bake bread.",
    "Give tips for a good night's sleep.", "Describe an empty classroom.", "Explain why trees lose their leaves.",
    "Tell me about a rainy holiday.", "Describe a garden after rain.", "Explain how to learn a new language.",
]
EVAL_TOPICS = TOPICS[-12:]
"""topics no train prompt uses"""

INCLUDE_WORDS = ("blue", "river", "quiet", "bright", "garden", "simple", "friend", "morning", "stone", "music",
                 "window", "honest")
EXCLUDE_WORDS = ("the", "and", "very", "good", "really", "also")
LETTERS_TO_COUNT = ("b", "k", "v", "w", "y", "z")
LETTERS_TO_AVOID = ("b", "k", "p", "v", "w", "y")
JSON_KEYS = ("title", "summary", "answer", "reason", "name", "mood", "color", "score")


def _params(rng: random.Random, kind: str) -> dict:
    draw = {
        "max_words": lambda: {"n": rng.choice((10, 15, 20))},
        "min_words": lambda: {"n": rng.choice((15, 20, 25))},
        "exact_words": lambda: {"n": rng.randint(1, 5)},
        "exact_sentences": lambda: {"n": rng.randint(1, 3)},
        "include_word": lambda: {"word": rng.choice(INCLUDE_WORDS)},
        "exclude_word": lambda: {"word": rng.choice(EXCLUDE_WORDS)},
        "letter_count": lambda: {"letter": rng.choice(LETTERS_TO_COUNT), "n": rng.choice((2, 3))},
        "exclude_letter": lambda: {"letter": rng.choice(LETTERS_TO_AVOID)},
        "lowercase": dict, "uppercase": dict, "no_commas": dict,
        "end_with": lambda: {"mark": rng.choice(("?", "!", "."))},
        "bullets": lambda: {"n": rng.randint(2, 4)},
        "json_keys": lambda: {"keys": rng.sample(JSON_KEYS, 2)},
    }[kind]
    return {"kind": kind, **draw()}


def _draw(rng: random.Random, size: int, held_out: bool) -> list[dict]:
    """`size` compatible constraints of distinct kinds; with `held_out`, holding a HELD_OUT pair, else none."""
    while True:
        if held_out:
            pair = sorted(rng.choice(sorted(sorted(p) for p in HELD_OUT)))
            kinds = [*pair, *rng.sample(sorted(set(KINDS) - set(pair)), size - 2)]
        else:
            kinds = rng.sample(sorted(KINDS), size)
        constraints = [_params(rng, k) for k in kinds]
        if compatible(constraints) and has_held_out_pair(constraints) == held_out:
            return constraints


def _rows(rng: random.Random, topics: list[str], plan: list[tuple[int, bool]], seen: set[str]) -> list[dict]:
    rows = []
    for size, held_out in plan:
        while True:
            topic, constraints = rng.choice(topics), _draw(rng, size, held_out)
            prompt = " ".join([topic, *(render(c) for c in constraints)])
            if prompt not in seen:
                break
        seen.add(prompt)
        rows.append({"prompt": prompt, "topic": topic, "constraints": constraints, "held_out": held_out})
    return rows


def build() -> dict[str, list[dict]]:
    rng = random.Random(SEED)
    seen: set[str] = set()
    third = N_EVAL // 3  # eval: singles, seen pairs and triples, held-out pairs and triples (with a third kind)
    eval_plan = [(1, False)] * third + [(2, False)] * (third * 3 // 5) + [(3, False)] * (third * 2 // 5)
    eval_plan += [(2, True)] * (third * 3 // 5) + [(3, True)] * (third * 2 // 5)
    train_plan = [(1, False)] * (N_TRAIN * 2 // 5) + [(2, False)] * (N_TRAIN * 2 // 5) + [(3, False)] * (N_TRAIN // 5)
    rng.shuffle(eval_plan)  # the first N prompts (num_prompts) mix singles, pairs and held-out pairs
    rng.shuffle(train_plan)
    train_topics = [t for t in TOPICS if t not in EVAL_TOPICS]
    return {"train": _rows(rng, train_topics, train_plan, seen), "eval": _rows(rng, EVAL_TOPICS, eval_plan, seen)}


def main() -> None:
    for split, rows in build().items():
        atomic_write_text(HERE / f"{split}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        print(f"{split}: {len(rows)} rows")


if __name__ == "__main__":
    main()
