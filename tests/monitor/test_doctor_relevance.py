"""off_task_drift: score up while the on-task signal (rollout/relevance) falls; quiet otherwise."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from ppo_streams import broken_run, healthy_run

from quartet.monitor.doctor import LiveDoctor, diagnose
from quartet.monitor.metrics import read_metrics


def _with_relevance(records, fn):
    for i, r in enumerate(records):
        r["rollout/relevance"] = fn(i / (len(records) - 1))
    return records


@pytest.mark.parametrize("seed", range(4))
def test_drift_is_found_with_its_evidence(seed):
    findings = diagnose(broken_run("off_task_drift", seed=seed))
    assert [f.rule for f in findings] == ["off_task_drift"]
    f = findings[0]
    assert f.evidence["metric"] == "rollout/relevance" and len(f.evidence["values"]) == 10
    assert set(f.evidence["related"]) == {"objective/score", "rollout/length_mean"}
    assert f.symptom.startswith("rollout/relevance fell from 0.") and "objective/score rose" in f.symptom
    assert "cannot see whether a response is about its prompt" in f.cause
    assert "task:positive-review/on-task" in f.fix and "kl_coef" in f.fix and "judge:relevance" in f.fix
    # 0.5 - 0.3 t over 60 points: the 20% drop is reached around t = 0.33, step ~21; found soon after
    assert 15 <= f.step <= 30


@pytest.mark.parametrize("seed", range(6))
def test_noisy_but_flat_relevance_is_not_drift(seed):
    rng = random.Random(seed)
    records = _with_relevance(healthy_run(40, seed), lambda t: 0.4 + rng.gauss(0, 0.06))
    assert diagnose(records) == []


def test_relevance_falling_with_the_score_is_not_reward_hacking():
    records = _with_relevance(healthy_run(40), lambda t: 0.5 - 0.3 * t)
    for i, r in enumerate(records):
        r["objective/score"] = 0.6 - 0.4 * i / 39
        r["objective/gold"] = 0.6 - 0.4 * i / 39
    assert "off_task_drift" not in {f.rule for f in diagnose(records)}


def test_a_small_relevance_fall_is_tolerated():
    records = _with_relevance(healthy_run(40), lambda t: 0.5 - 0.08 * t)  # 16%: below the 20% threshold
    assert diagnose(records) == []


def test_stop_on_off_task_drift_stops_the_live_run():
    doctor = LiveDoctor(stop_on=["off_task_drift"])
    stopped = None
    for r in broken_run("off_task_drift"):
        doctor.update(r["step"], r)
        if doctor.should_stop:
            stopped = r["step"]
            break
    assert stopped is not None and stopped < 60
    assert doctor.stop_reason.startswith(f"doctor rule 'off_task_drift' fired at step {stopped}")


def test_the_demo_fixture_logs_no_relevance_so_the_rule_stays_silent():
    """The demo's PPO metrics predate rollout/relevance: the rule cannot judge that run (its answers did get
    shorter, 24 -> 16 tokens, as in the run issue 15 read as off-task) and must not guess from other keys."""
    records = read_metrics(Path(__file__).parent / "data" / "demo_ppo_metrics.jsonl")
    assert not any("rollout/relevance" in r for r in records)
    assert "off_task_drift" not in {f.rule for f in diagnose(records)}
