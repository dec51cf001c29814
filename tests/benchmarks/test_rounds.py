"""benchmarks/rounds.py: its accuracy and bootstrap over prompts, against hand-worked numbers and a slow loop."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "rounds.py"


@pytest.fixture(scope="module")
def rounds():
    spec = importlib.util.spec_from_file_location("rounds_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_accuracy_pools_pairs_and_resamples_prompts(rounds):
    correct = [[1.0, 1.0, 0.5], [0.0], [1.0, 0.0]]  # 3.5 right of 6 pairs
    mean, lo, hi = rounds.accuracy_ci(correct, n_boot=500, seed=3)
    assert mean == pytest.approx(3.5 / 6)
    # the same resamples drawn by hand: each pools the pairs of the prompts it drew
    draws = np.random.default_rng(3).integers(0, 3, size=(500, 3))
    slow = [sum(sum(correct[i]) for i in d) / sum(len(correct[i]) for i in d) for d in draws]
    assert (lo, hi) == pytest.approx(tuple(np.quantile(slow, [0.025, 0.975])))
    assert rounds.accuracy_ci([[1.0], [1.0, 1.0]]) == (1.0, 1.0, 1.0)


def test_the_paired_difference_uses_the_same_resamples(rounds):
    a, b = [[1.0, 1.0], [0.0]], [[1.0, 0.0], [0.0]]
    assert rounds.accuracy_ci(a, a) == (0.0, 0.0, 0.0)
    mean, lo, hi = rounds.accuracy_ci(a, b, n_boot=200)
    assert mean == pytest.approx(1 / 3) and 0.0 <= lo <= mean <= hi <= 0.5  # a prompt of 2 pairs, one of them won


def test_ranked_right_counts_a_tie_half(rounds):
    class RM:
        tokenizer = None

        def score_texts(self, texts, batch_size, max_length):
            return [float(len(t)) for t in texts]

    rows = [{"prompt": "p", "chosen": "long answer", "rejected": "short"},
            {"prompt": "p", "chosen": "ab", "rejected": "cd"},
            {"prompt": "q", "chosen": "x", "rejected": "yy"}]
    assert rounds.ranked_right(RM(), rows, 64, False) == [[1.0, 0.5], [0.0]]
