"""`quartet label judge=none`: the answers only, for people to rank (`quartet annotate`); no pairs file."""

from __future__ import annotations

import json

import pytest
from test_label import make_cfg
from trainer_helpers import TINY, single_thread  # noqa: F401

from quartet.cli import main
from quartet.config import DataConfig
from quartet.data import load_samples
from quartet.errors import QuartetError
from quartet.trainers.label import label

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_judge_none_writes_the_judged_runs_answers_unscored_and_no_pairs(tmp_path):
    """The same seed draws the same answers whether a judge scores them or not: the judge only reads them."""
    judged = label(make_cfg(tmp_path / "a"))
    result = label(make_cfg(tmp_path / "b", judge="none"))
    out = tmp_path / "b" / "label"
    assert sorted(p.name for p in out.iterdir()) == ["prefs.config.yaml", "prefs.samples.jsonl", "prefs.summary.md"]
    answers = read(out / "prefs.samples.jsonl")
    assert [(a["prompt"], a["completion"], a["sample"]) for a in answers] == [
        (a["prompt"], a["completion"], a["sample"]) for a in read(tmp_path / "a" / "label" / "prefs.samples.jsonl")]
    assert all(a["score"] is None for a in answers) and len(answers) == 12 * 4 == result.counts.samples
    assert result.score_mean is None and result.counts.pairs == 0 and judged.counts.pairs > 0
    assert len(load_samples(DataConfig(path=str(out / "prefs.samples.jsonl")))) == 48  # what `quartet rm` normalises on
    summary = (out / "prefs.summary.md").read_text()
    assert f"quartet annotate {out / 'prefs.samples.jsonl'} --out {out / 'annotate'}" in summary
    assert "judge: none" in summary and "judge score mean" not in summary


def test_judge_none_over_a_judged_run_removes_its_pairs_and_keeps_a_users_file(tmp_path):
    label(make_cfg(tmp_path))
    pairs = tmp_path / "label" / "prefs.jsonl"
    assert pairs.is_file()
    label(make_cfg(tmp_path, judge="none"))  # the pairs came from other draws: they go with the run they belong to
    assert not pairs.exists() and all(a["score"] is None for a in read(tmp_path / "label" / "prefs.samples.jsonl"))

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "prefs.jsonl").write_text("a user's file\n")
    with pytest.raises(QuartetError, match="prefs.jsonl exists and was not written by Quartet"):
        label(make_cfg(tmp_path, judge="none", output=str(mine / "prefs.jsonl")))
    assert [p.name for p in mine.iterdir()] == ["prefs.jsonl"] and (mine / "prefs.jsonl").read_text() == "a user's file\n"


def test_cli_label_judge_none(tmp_path, capsys):
    code = main(["label", f"policy={TINY}", "prompts.path=task:tiny-target/train", "prompts.limit=3", "judge=none",
                 "generation.max_new_tokens=4", f"output={tmp_path / 'p.jsonl'}"])
    assert code == 0
    assert f"next: quartet annotate {tmp_path / 'p.samples.jsonl'}" in capsys.readouterr().out
    assert len(read(tmp_path / "p.samples.jsonl")) == 3 * 4 and not (tmp_path / "p.jsonl").exists()
