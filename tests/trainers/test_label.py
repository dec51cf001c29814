"""Stage 2 (label): pairing rules by hand, ordered pairs and counted ties from a tiny policy, CLI, bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from trainer_helpers import TINY, assert_one_line_error, run_cli, single_thread  # noqa: F401

from quartet.config import DataConfig, LabelConfig, from_dict
from quartet.data import load_preferences, load_samples
from quartet.errors import QuartetError
from quartet.trainers.label import LabelCounts, label, make_pairs

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA


def test_best_worst_by_hand():
    counts = LabelCounts()
    answers = ["a", "bb", "ccc", "a", ""]
    pairs = make_pairs(answers, [1.0, 3.0, 2.0, 1.0, 9.0], "best-worst", 0.5, counts)
    assert pairs == [("bb", "a", 3.0, 1.0)]  # the empty answer (score 9) and the duplicate "a" are left out
    assert (counts.empty, counts.duplicates, counts.ties) == (1, 1, 0)


def test_all_pairs_drop_and_count_near_ties():
    counts = LabelCounts()
    pairs = make_pairs(["x", "y", "z"], [1.0, 1.04, 2.0], "all-pairs", 0.05, counts)
    assert pairs == [("z", "y", 2.0, 1.04), ("z", "x", 2.0, 1.0)]
    assert counts.ties == 1  # y vs x: gap 0.04 <= min_gap


def test_best_worst_tie_and_too_few():
    counts = LabelCounts()
    assert make_pairs(["p", "q"], [0.5, 0.5], "best-worst", 0.0, counts) == []
    assert make_pairs(["p", "p", " "], [0.1, 0.2, 0.3], "best-worst", 0.0, counts) == []
    assert (counts.ties, counts.too_few, counts.duplicates, counts.empty) == (1, 1, 1, 1)


def make_cfg(tmp_path, **overrides) -> LabelConfig:
    base = {
        "policy": TINY,
        "prompts": {"path": "task:tiny-target/train", "limit": 12, "max_prompt_tokens": 32},
        "judge": "trainer_helpers:toy_length_judge",
        "num_samples": 4,
        "generation": {"max_new_tokens": 12, "batch_size": 24},
        "min_gap": 0.5,
        "output": str(tmp_path / "label" / "prefs.jsonl"),
    }
    base.update(overrides)
    return from_dict(LabelConfig, base)


@pytest.mark.parametrize("pairing", ["best-worst", "all-pairs"])
def test_label_writes_ordered_pairs_and_counts_ties(tmp_path, pairing):
    result = label(make_cfg(tmp_path, pairing=pairing))
    rows = [json.loads(line) for line in result.output.read_text().splitlines()]
    assert len(rows) == result.counts.pairs > 0
    assert result.counts.ties > 0  # integer scores from K=4 answers tie often
    for row in rows:
        assert set(row) == {"prompt", "chosen", "rejected", "chosen_score", "rejected_score"}
        assert row["chosen_score"] > row["rejected_score"] + 0.5
        assert row["chosen"] != row["rejected"] and row["chosen"].strip() and row["rejected"].strip()
    if pairing == "best-worst":
        assert result.counts.pairs + result.counts.ties + result.counts.too_few == result.counts.prompts == 12
    # the file is a valid `quartet rm` input as written
    assert len(load_preferences(DataConfig(path=str(result.output)))) == len(rows)
    assert (tmp_path / "label" / "prefs.summary.md").is_file()
    assert (tmp_path / "label" / "prefs.config.yaml").is_file()
    # every answer beside them, with the judge's score: K per prompt, the pairs' answers among them
    answers = [json.loads(line) for line in (tmp_path / "label" / "prefs.samples.jsonl").read_text().splitlines()]
    assert len(answers) == result.counts.samples == 12 * 4
    assert [a["sample"] for a in answers] == [0, 1, 2, 3] * 12
    scored = {(json.dumps(a["prompt"]), a["completion"]): a["score"] for a in answers}
    for row in rows:
        assert scored[json.dumps(row["prompt"]), row["chosen"]] == row["chosen_score"]
        assert scored[json.dumps(row["prompt"]), row["rejected"]] == row["rejected_score"]
    assert [(a.prompt, a.completion) for a in load_samples(DataConfig(path=str(result.output.with_name(
        "prefs.samples.jsonl"))))] == [(a["prompt"], a["completion"]) for a in answers]


def test_a_users_file_where_the_answers_go_is_refused(tmp_path):
    (tmp_path / "label").mkdir()
    (tmp_path / "label" / "prefs.samples.jsonl").write_text("mine\n")
    with pytest.raises(QuartetError, match="prefs.samples.jsonl exists and was not written by Quartet"):
        label(make_cfg(tmp_path))
    assert [p.name for p in (tmp_path / "label").iterdir()] == ["prefs.samples.jsonl"]
    assert (tmp_path / "label" / "prefs.samples.jsonl").read_text() == "mine\n"


def test_a_label_run_killed_while_writing_can_run_again(tmp_path, monkeypatch):
    """Killed while renaming its files into place, after the answers file and before the pairs: the files beside
    the config are Quartet's, so the same command runs again (and the stage counts as done only once the pairs
    are written)."""
    import quartet.atomic

    real = os.replace

    def killed_at_the_pairs(src, dst):
        if Path(dst).name == "prefs.jsonl":
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(quartet.atomic.os, "replace", killed_at_the_pairs)
    with pytest.raises(KeyboardInterrupt):
        label(make_cfg(tmp_path))
    monkeypatch.undo()
    assert (tmp_path / "label" / "prefs.samples.jsonl").is_file() and not (tmp_path / "label" / "prefs.jsonl").exists()
    assert not list((tmp_path / "label").glob(".*.tmp"))  # no temporary of the pairs left behind
    assert label(make_cfg(tmp_path)).output.is_file()


def test_same_seed_same_pairs(tmp_path):
    a = label(make_cfg(tmp_path / "a")).output.read_text()
    b = label(make_cfg(tmp_path / "b")).output.read_text()
    assert a == b


def test_unknown_judge_is_one_line_error_without_output(tmp_path):
    with pytest.raises(QuartetError, match="trainer_helpers.*no attribute"):
        label(make_cfg(tmp_path, judge="trainer_helpers:nope"))
    assert not (tmp_path / "label").exists()


def test_cli_label_then_bad_config(tmp_path):
    out = run_cli("label", f"policy={TINY}", "prompts.path=task:tiny-target/train", "prompts.limit=6",
                  "judge=trainer_helpers:toy_length_judge", "generation.max_new_tokens=12", "min_gap=0.5",
                  f"output={tmp_path / 'prefs.jsonl'}")
    assert out.returncode == 0, out.stderr
    assert "dropped as ties" in out.stdout
    assert (tmp_path / "prefs.jsonl").is_file()

    out = run_cli("label", "num_samples=1", f"output={tmp_path / 'other.jsonl'}")
    assert_one_line_error(out, "num_samples: must be >= 2")
    assert not (tmp_path / "other.jsonl").exists()
