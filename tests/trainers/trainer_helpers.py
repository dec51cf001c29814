"""Small data sets and a subprocess runner shared by the sft / label / rm tests (on sys.path via pytest)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TINY = "tiny:llama?hidden=64&layers=2&heads=4&vocab=300"
HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def single_thread():
    """Tiny models gain nothing from threads, and on a shared CPU extra threads only wait on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def memorise_rows(n: int = 8, seed: int = 0) -> list[dict]:
    """`key i` -> a random 8-letter code: nothing to generalise, only to remember."""
    rng = random.Random(seed)
    return [{"prompt": f"key {i}", "completion": "".join(rng.choice("abcdefghij") for _ in range(8))} for i in range(n)]


WORDS = "red blue green cat dog sun moon tree river stone bird fish cloud rain wind".split()


def keyword_pairs(n: int, seed: int = 0) -> list[dict]:
    """Preference pairs with a known rule: the chosen answer says `yes`, the rejected one says `no`;
    the other words are random, so only the rule separates them."""
    rng = random.Random(seed)

    def words(k):
        return " ".join(rng.choice(WORDS) for _ in range(k))

    return [{"prompt": words(2), "chosen": f"{words(2)} yes {words(1)}", "rejected": f"{words(2)} no {words(1)}"}
            for _ in range(n)]


def run_cli(*args, cwd=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "quartet.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)


def assert_one_line_error(out, *fragments):
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.strip().splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def toy_length_judge(prompts, responses):
    """Integer scores (a quarter of the length, rounded down): many ties, some clear pairs."""
    return [float(len(r) // 4) for r in responses]
