"""scripts/gpu_check.py, the CPU side: its comparison passes equal runs, fails each difference it holds to a
tolerance (SFT's trajectory, an RL run's first rollout), only reports what it does not (later RL iterations, update
statistics), and its summary reads what gpu_check.sh leaves."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def _write(root: Path, stage: str, metrics: list[dict], samples: list[dict] | None = None) -> None:
    (root / stage).mkdir(parents=True, exist_ok=True)
    (root / stage / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if samples is not None:
        (root / stage / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))


def _runs(root: Path, score1=0.25, norm1=0.5, score2=0.5, first="a", later="b", loss2=1.0, timing=1.0) -> Path:
    _write(root, "sft", [{"step": 10, "sft/loss": 2.0}, {"step": 20, "sft/loss": loss2}])
    for stage in ("ppo", "grpo"):
        _write(root, stage, [{"step": 1, "objective/score": score1, "optim/grad_norm": norm1, "timing/generate": timing},
                             {"step": 2, "objective/score": score2, "timing/generate": 2 * timing}],
               [{"step": 1, "response": first}] * 50 + [{"step": 2, "response": later}] * 50)
    return root


def test_equal_runs_pass_and_timings_are_not_compared(tmp_path):
    report = gpu_check.compare(_runs(tmp_path / "a"), _runs(tmp_path / "b", timing=9.0))
    assert report["ok"] and all(s["ok"] for s in report["stages"].values())
    assert report["stages"]["ppo"]["answers"] == {"count": [100, 100], "same": 1.0, "same_first_iteration": 1.0}


@pytest.mark.parametrize("changed, ok", [
    ({"score1": 0.25 * (1 + 10 * gpu_check.FIRST_RTOL)}, False),  # the first rollout's score: held
    ({"score1": 0.25 * (1 + 0.1 * gpu_check.FIRST_RTOL)}, True),
    ({"first": "c"}, False),  # the first rollout's answers: held
    ({"norm1": 0.9, "score2": 0.9, "later": "c"}, True),  # the update's statistics and later iterations: reported
])
def test_an_rl_run_is_held_on_its_first_rollout(tmp_path, changed, ok):
    report = gpu_check.compare(_runs(tmp_path / "a"), _runs(tmp_path / "b", **changed))
    assert report["ok"] is ok and report["stages"]["grpo"]["ok"] is ok and report["stages"]["sft"]["ok"]
    assert report["stages"]["ppo"]["worst"][-1]["rel_gap"] > 0 or "score2" not in changed


@pytest.mark.parametrize("loss2, ok", [(1.0 * (1 + 0.5 * gpu_check.LATER_RTOL), True),
                                       (1.0 * (1 + 2 * gpu_check.LATER_RTOL), False)])
def test_sfts_whole_trajectory_is_held(tmp_path, loss2, ok):
    report = gpu_check.compare(_runs(tmp_path / "a"), _runs(tmp_path / "b", loss2=loss2))
    assert report["stages"]["sft"]["ok"] is ok and report["stages"]["ppo"]["ok"]
    assert ok or "row 2 sft/loss" in report["stages"]["sft"]["failures"][0]


def test_missing_rows_fail(tmp_path):
    _runs(tmp_path / "a"), _runs(tmp_path / "b")
    _write(tmp_path / "b", "sft", [{"step": 10, "sft/loss": 2.0}])
    assert not gpu_check.compare(tmp_path / "a", tmp_path / "b")["stages"]["sft"]["ok"]


def test_summary_reads_the_parts_and_survives_a_half_written_one(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "env.json").write_text(json.dumps({"python": "3", "torch": "t", "cuda": None, "transformers": "x",
                                              "accelerate": "a", "peft": "p", "cpu_count": 2,
                                              "compute_device": "cpu", "mixed_precision_auto": "no"}))
    (out / "compare.json").write_text(json.dumps(gpu_check.compare(_runs(tmp_path / "a"), _runs(tmp_path / "b"))))
    (out / "vs_trl.json").write_text("{\"sides\": ")  # killed while writing
    (out / "steps.txt").write_text("env: rc 0, 3 s\nvs_trl: rc 124, 240 s\n")
    doc = gpu_check.summary(out)
    text = (out / "gpu_check.md").read_text()
    assert doc["vs_trl"] is None and "vs_trl.json" in doc["unreadable"][0]
    assert "Result: PASS" in text and "vs_trl: rc 124" in text and "compute device cpu" in text
