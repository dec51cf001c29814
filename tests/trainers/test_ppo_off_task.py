"""off_task_drift on a real run: a tiny model, a reward that pays for text unrelated to the prompt, and an
on-task judge logged every iteration as rollout/relevance."""

from __future__ import annotations

import json

import pytest

from builders import tiny_ppo
from quartet.trainers.ppo import PPOTrainer

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA


def test_off_task_reward_is_flagged_and_stop_on_ends_the_run(tmp_path):
    """tiny-target pays for 'a' and digits, which never occur in its prompts; its relevance judge is the share
    of response characters taken from the prompt. As the score rises, relevance must fall, and the doctor
    stops the run on off_task_drift (beta = 0: nothing holds the policy near the reference)."""
    cfg = tiny_ppo(tmp_path, monitor_judges={"relevance": "task:tiny-target/relevance"}, iterations=40,
                   rollout_batch_size=32, minibatch_size=16, micro_batch_size=16, ppo_epochs=4, kl_coef=0.0,
                   stop_on=["off_task_drift"],
                   **{"generation.max_new_tokens": 12, "generation.batch_size": 32, "optim.adam_eps": 1e-5})
    result = PPOTrainer(cfg, progress=False).train()
    assert result.stopped_by is not None and "off_task_drift" in result.stopped_by
    assert result.iterations < 40
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    ppo = [r for r in records if "rollout/relevance" in r]
    assert len(ppo) == result.iterations  # logged every iteration
    assert ppo[-1]["objective/score"] > ppo[0]["objective/score"]
    assert ppo[-1]["rollout/relevance"] < 0.8 * ppo[0]["rollout/relevance"]
    findings = [json.loads(line) for line in (result.run_dir / "findings.jsonl").read_text().splitlines()]
    drift = [f for f in findings if f["rule"] == "off_task_drift"]
    assert drift and drift[0]["evidence"]["metric"] == "rollout/relevance"
    samples = [json.loads(line) for line in (result.run_dir / "samples.jsonl").read_text().splitlines()]
    assert all(0.0 <= s["relevance"] <= 1.0 for s in samples)  # per sample too
    assert (result.run_dir / "model" / "model.safetensors").is_file()
