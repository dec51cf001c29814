"""The no_group_signal rule: a batch most of whose prompt groups scored the same for every sample (GRPO's
advantage 0) is flagged with its fix; healthy group runs, short runs and the demo's PPO run stay quiet."""

import random
from pathlib import Path

from ppo_streams import healthy_run

from quartet.monitor.doctor import diagnose
from quartet.monitor.metrics import read_metrics


def with_groups(share, dropped=None, n=30, seed=0):
    """A healthy run whose batches had `share(t)` of their groups flat (t in [0, 1]), plus noise."""
    rng = random.Random(seed + 7)
    records = healthy_run(n, seed)
    for i, r in enumerate(records):
        t = i / (n - 1)
        r["rollout/zero_std_groups"] = min(max(share(t) + rng.gauss(0, 0.04), 0.0), 1.0)
        if dropped is not None:
            r["rollout/dropped_groups"] = dropped
    return records


def test_fires_when_most_groups_carry_no_signal_and_names_its_fix():
    (f,) = diagnose(with_groups(lambda t: 0.8))
    assert f.rule == "no_group_signal" and f.severity == "warning" and f.step == 3
    assert f.evidence["metric"] == "rollout/zero_std_groups"
    assert "dynamic_sampling: true" in f.fix and "easier curriculum" in f.fix and "samples_per_prompt" in f.fix


def test_with_dynamic_sampling_on_the_fix_is_more_rounds():
    (f,) = diagnose(with_groups(lambda t: 0.7, dropped=0.6))
    assert "raise dynamic_sampling_rounds" in f.fix and "rollout/dropped_groups" in f.evidence["related"]


def test_fires_when_a_run_drifts_into_groups_without_signal():
    findings = diagnose(with_groups(lambda t: 0.1 + 0.8 * t))  # the policy solves every prompt by the end
    assert [f.rule for f in findings] == ["no_group_signal"] and findings[0].step > 15


def test_silent_on_healthy_group_runs_and_on_short_ones():
    for seed in range(6):
        assert diagnose(with_groups(lambda t: 0.4 - 0.2 * t, seed=seed)) == []
        assert diagnose(with_groups(lambda t: 0.9, n=2, seed=seed)) == []  # two points are not a trend


def test_silent_on_the_demo_run():
    data = Path(__file__).parent / "data"
    for name in ("demo_ppo_metrics.jsonl", "demo_ppo_metrics_on_task.jsonl"):
        assert "no_group_signal" not in {f.rule for f in diagnose(read_metrics(data / name))}
