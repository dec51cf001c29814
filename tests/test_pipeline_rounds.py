"""`quartet run` with `rounds: N`: round k+1 labels answers of round k's PPO policy, its reward model trains on every
round's pairs, its PPO starts from SFT again; `rounds: 1` is the pipeline as it was. Tiny models, a few steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from quartet.errors import ConfigError
from quartet.monitor.metrics import stage_dirs
from quartet.monitor.report import _stage_label
from quartet.pipeline import _steps, load_pipeline, run_pipeline

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA

LM = "tiny:llama?hidden=32&layers=1&heads=4&vocab=300"
ROOT = Path(__file__).parent.parent


def pipe(tmp_path: Path, **extra) -> Path:
    (tmp_path / "sft.jsonl").write_text('{"prompt": "ab", "completion": "aa"}\n{"prompt": "cd", "completion": "a1"}\n')
    (tmp_path / "pipe.yaml").write_text(json.dumps({
        "output_dir": str(tmp_path / "run"), "task": "tiny-target", "tracking": {"report_to": "none"},
        "sft": {"model": LM, "data": {"path": str(tmp_path / "sft.jsonl"), "chat_template": False}, "max_steps": 1,
                "precision": "fp32"},
        "label": {"num_samples": 4, "prompts": {"limit": 8}, "min_gap": 0.0,
                  "generation": {"max_new_tokens": 4, "batch_size": 32}},
        "rm": {"model": LM, "max_steps": 1, "precision": "fp32", "normalize_samples": 4, "eval_fraction": 0.25},
        "ppo": {"iterations": 1, "rollout_batch_size": 4, "minibatch_size": 4, "micro_batch_size": 4,
                "generation": {"max_new_tokens": 4, "batch_size": 4}, "precision": "fp32"},
        "eval": {"num_prompts": 2, "max_new_tokens": 4, "batch_size": 2},
        **extra,
    }))
    return tmp_path / "pipe.yaml"


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def no_report(out: Path) -> Path:
    """The report's plots cost ~15 s here; what it shows of the rounds is `stage_dirs`' names, checked below."""
    (out / "report.html").write_text("")
    return out / "report.html"


def test_round_two_labels_round_ones_policy_and_its_reward_model_trains_on_both_rounds(tmp_path, one_thread,
                                                                                       monkeypatch):
    monkeypatch.setattr("quartet.pipeline.write_report", no_report)
    cfg = load_pipeline(str(pipe(tmp_path, rounds=2)))
    out, r2 = tmp_path / "run", tmp_path / "run" / "rounds" / "2"
    times = run_pipeline(cfg)
    assert list(times) == ["sft", "label", "rm", "ppo", "label (round 2)", "rm (round 2)", "ppo (round 2)", "eval"]

    label2 = yaml.safe_load((r2 / "label" / "preferences.config.yaml").read_text())
    assert label2["policy"] == str(out / "ppo" / "model") and label2["seed"] == cfg.label.seed + 1
    first, second = lines(out / "label" / "preferences.jsonl"), lines(r2 / "label" / "preferences.jsonl")
    assert first and second
    combined = lines(r2 / "pairs.jsonl")  # what round 2's reward model read: both rounds' pairs, tagged
    assert combined == [dict(r, round=1) for r in first] + [dict(r, round=2) for r in second]
    rm2 = yaml.safe_load((r2 / "rm" / "config.yaml").read_text())
    assert rm2["data"]["path"] == str(r2 / "pairs.jsonl")
    rm1 = yaml.safe_load((out / "rm" / "config.yaml").read_text())
    normalise = ("normalize_policy", "normalize_prompts", "normalize_responses", "normalize_generation")
    assert rm2["normalize_policy"] == str(out / "sft" / "model")  # PPO starts from SFT: its answers score mean 0
    assert {k: rm2[k] for k in normalise} == {k: rm1[k] for k in normalise}
    ppo2 = yaml.safe_load((r2 / "ppo" / "config.yaml").read_text())
    assert ppo2["policy"] == str(out / "sft" / "model") and ppo2["reward"] == str(r2 / "rm" / "model")

    result = json.loads((out / "eval" / "eval.json").read_text())
    assert list(result["checkpoints"]) == [str(out / d / "model") for d in ("sft", "ppo", "rounds/2/ppo")]
    assert result["settings"]["reward_model"] == str(r2 / "rm" / "model")
    summary = (out / "summary.md").read_text()
    assert "| PPO round 1 |" in summary and "| PPO round 2 |" in summary and "## Rounds" in summary
    assert f"| 2 | `{out / 'ppo' / 'model'}` | {len(second)} | {len(first) + len(second)} pairs of rounds 1-2 |" in summary
    names = [name for name, _ in stage_dirs(out)]  # what the report and the doctor show, each round's stages
    assert names == ["sft", "rm", "ppo", "rm (round 2)", "ppo (round 2)"]
    assert _stage_label("ppo (round 2)", [{"stage": "ppo", "algorithm": "grpo"}]) == "grpo (round 2)"

    again = run_pipeline(load_pipeline(str(pipe(tmp_path, rounds=2))))  # every stage's output is there: reused
    assert {k: v for k, v in again.items() if k != "eval"} == dict.fromkeys(list(times)[:-1], 0.0)


def test_one_round_is_the_pipeline_as_it_was_and_the_demo_has_one(tmp_path):
    cfg = load_pipeline(str(pipe(tmp_path)))
    assert cfg.rounds == 1 and [s for s, _, _ in _steps(cfg)] == list(cfg.stages)
    assert all(c is cfg for _, c, _ in _steps(cfg))
    assert load_pipeline(str(ROOT / "configs" / "demo.yaml")).rounds == 1


@pytest.mark.parametrize("extra, message", [
    ({"rounds": 2, "stages": ["sft", "label", "dpo", "eval"]}, "rounds: 2 rounds need the label, rm, ppo stages"),
    ({"rounds": 2, "stages": ["sft", "label", "rm", "ppo", "dpo"]}, "leave dpo out of stages"),
    ({"rounds": 2, "ppo": {"reward": "task:tiny-target"}}, "leave ppo.reward unset"),
    ({"rounds": 0}, "pipeline.rounds: "),
    ({"label": {"judge": "none"}}, "pipeline.label.judge: none writes answers and no pairs"),
])
def test_bad_rounds_settings_are_one_line_errors(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        load_pipeline(str(pipe(tmp_path, **extra)))


def test_judge_none_alone_samples_for_people(tmp_path, one_thread, monkeypatch):
    monkeypatch.setattr("quartet.pipeline.write_report", no_report)
    cfg = load_pipeline(str(pipe(tmp_path, stages=["sft", "label"], label={"judge": "none", "prompts": {"limit": 2}})))
    assert list(run_pipeline(cfg)) == ["sft", "label"]
    answers = tmp_path / "run" / "label" / "preferences.samples.jsonl"
    assert len(lines(answers)) == 2 * 4 and not (tmp_path / "run" / "label" / "preferences.jsonl").exists()
    assert run_pipeline(cfg)["label"] == 0.0  # the answers file is the stage's result: reused
