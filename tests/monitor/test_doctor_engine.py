"""engine_mismatch: the gap between the sampling engine's and the trainer's log-probs growing or large."""

import random

from ppo_streams import healthy_run

from quartet.monitor.doctor import diagnose


def with_gap(records, mean, max_=lambda t, g: 1.0 + abs(g(0, 0.3))):
    g = random.Random(7).gauss
    n = len(records)
    for i, r in enumerate(records):
        t = i / max(n - 1, 1)
        r["rollout/logprob_diff_mean"] = mean(t, g)
        r["rollout/logprob_diff_max"] = max_(t, g)
    return records


def test_healthy_bf16_gap_is_quiet():
    # a bf16 engine beside an fp32 trainer: ~0.02 nats per token with noise, single tokens off by up to ~2 nats
    for seed in range(5):
        records = with_gap(healthy_run(60, seed), lambda t, g: 0.02 + abs(g(0, 0.005)),
                           lambda t, g: 1.0 + abs(g(0, 0.5)))
        assert diagnose(records) == []


def test_gap_that_rises_a_little_with_the_policy_is_quiet():
    # 0.02 -> 0.05: more than 2x but only 0.03 nats more, as when the policy moves to less certain tokens
    records = with_gap(healthy_run(60, 0), lambda t, g: 0.02 + 0.03 * t + abs(g(0, 0.003)))
    assert diagnose(records) == []


def test_growing_gap_fires_once_with_its_evidence():
    records = with_gap(healthy_run(60, 0), lambda t, g: 0.02 + 0.3 * t + abs(g(0, 0.003)))
    findings = diagnose(records)
    assert [f.rule for f in findings] == ["engine_mismatch"]
    f = findings[0]
    assert f.severity == "warning" and "tis_cap" in f.fix
    # fires at the first step where the median of the last 3 is >= 3x the start and 0.05 nats above it
    gaps = [r["rollout/logprob_diff_mean"] for r in records]
    start = sorted(gaps[:3])[1]
    first = next(i for i in range(5, 60) if sorted(gaps[i - 2 : i + 1])[1] >= 3 * start
                 and sorted(gaps[i - 2 : i + 1])[1] > start + 0.05)
    assert f.step == records[first]["step"]
    assert f.evidence["metric"] == "rollout/logprob_diff_mean"
    assert "rollout/logprob_diff_max" in f.evidence["related"]


def test_large_gap_from_the_start_fires_after_three_points():
    # e.g. the engine never received the trained weights (LoRA not merged): large from the first iteration
    records = with_gap(healthy_run(10, 0), lambda t, g: 0.8 + abs(g(0, 0.05)))
    findings = diagnose(records)
    assert [(f.rule, f.step) for f in findings] == [("engine_mismatch", 3)]
    assert diagnose(records[:2]) == []


def test_runs_without_engine_logprobs_are_untouched():
    assert diagnose(healthy_run(60, 3)) == []
