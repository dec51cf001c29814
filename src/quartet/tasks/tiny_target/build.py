"""Build the tiny-target prompt files, deterministically.

    python -m quartet.tasks.tiny_target.build      # rewrites train/eval.jsonl next to this file

Prompts are 4-8 random letters from b-z (never the target letter), distinct, disjoint across splits.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from quartet.atomic import atomic_write_text

HERE = Path(__file__).parent
SEED = 0
SIZES = {"train": 256, "eval": 64}
LETTERS = "bcdefghijklmnopqrstuvwxyz"


def build() -> dict[str, list[dict]]:
    rng = random.Random(SEED)
    seen: set[str] = set()
    out = {}
    for split, n in SIZES.items():
        rows = []
        while len(rows) < n:
            text = "".join(rng.choice(LETTERS) for _ in range(rng.randint(4, 8)))
            if text not in seen:
                seen.add(text)
                rows.append({"prompt": text})
        out[split] = rows
    return out


def main() -> None:
    for split, rows in build().items():
        atomic_write_text(HERE / f"{split}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        print(f"{split}: {len(rows)} rows")


if __name__ == "__main__":
    main()
