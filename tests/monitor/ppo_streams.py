"""Synthetic PPO metric streams: a realistic healthy run and one broken variant per doctor rule."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path


def healthy_run(n: int = 60, seed: int = 0, stage: str = "ppo") -> list[dict]:
    """Score rising slowly, KL rising to ~4 nats, entropy slowly falling, clipfrac 0.02-0.2, length stable,
    EOS rate high, value loss falling, explained variance rising, gold tracking the proxy, relevance to the
    prompt nearly flat (0.50 -> 0.47, noise sd 0.02)."""
    rng = random.Random(seed)
    g = rng.gauss
    records = []
    for i in range(n):
        t = i / max(n - 1, 1)
        score = 0.1 + 0.5 * t + g(0, 0.03)
        kl = max(4.0 * t**1.2 + g(0, 0.05), -0.05)
        records.append({
            "stage": stage,
            "step": i + 1,
            "time": 1_700_000_000.0 + 3 * i,
            "objective/score": score,
            "objective/gold": 0.2 + 0.4 * t + g(0, 0.03),
            "objective/kl": kl,
            "objective/kl_coef": 0.05,
            "objective/reward": score - 0.05 * kl,
            "objective/non_score_reward": -0.05 * kl,
            "policy/loss": g(0, 0.05),
            "policy/entropy": 2.5 - 0.6 * t + g(0, 0.03),
            "policy/clipfrac": min(max(0.03 + 0.1 * t + g(0, 0.01), 0.02), 0.2),
            "policy/approx_kl": 0.01 + abs(g(0, 0.003)),
            "value/loss": 0.1 + 0.9 * math.exp(-3 * t) + abs(g(0, 0.02)),
            "value/clipfrac": 0.05 + abs(g(0, 0.01)),
            "value/explained_variance": 0.7 - math.exp(-8 * t) + g(0, 0.03),
            "rollout/length_mean": 30 + g(0, 1.5),
            "rollout/length_max": 48,
            "rollout/eos_rate": min(0.95 + g(0, 0.02), 1.0),
            "rollout/distinct_1": 0.5 + g(0, 0.01),
            "rollout/distinct_2": 0.8 - 0.1 * t + g(0, 0.01),
            "rollout/repetition": 0.02 + 0.02 * t + abs(g(0, 0.005)),
            "rollout/relevance": 0.5 - 0.03 * t + g(0, 0.02),
            "optim/lr": 1e-5,
            "optim/grad_norm": 0.5 * math.exp(g(0, 0.2)),
            "timing/total": 3.0 + g(0, 0.1),
            "memory/peak_rss_mb": 900.0,
        })
    return records


def broken_run(rule: str, n: int = 60, seed: int = 0) -> list[dict]:
    """A healthy run with one failure mode injected; each should trigger ``rule``."""
    rng = random.Random(seed + 1000)
    g = rng.gauss
    records = healthy_run(n, seed)
    for i, r in enumerate(records):
        t = i / (n - 1)
        if rule == "nan" and i == 19:
            r["policy/loss"] = float("nan")
        elif rule == "grad_spike" and i == 29:
            r["optim/grad_norm"] = 40.0
        elif rule == "reward_flat_kl_zero":
            r["objective/kl"] = abs(g(0, 0.003))
            r["objective/score"] = 0.1 + g(0, 0.03)
        elif rule == "kl_blowup":
            r["objective/kl"] = 0.2 * 1.12**i
        elif rule == "negative_kl":
            r["objective/kl"] = -0.6 + g(0, 0.1)
        elif rule == "reward_hacking_length":
            r["rollout/length_mean"] = 30 + 40 * t + g(0, 1.5)
        elif rule == "reward_hacking_repetition":
            r["rollout/distinct_2"] = 0.8 - 0.6 * t + g(0, 0.01)
            r["rollout/repetition"] = 0.02 + 0.5 * t + abs(g(0, 0.005))
        elif rule == "off_task_drift":
            r["rollout/relevance"] = 0.5 - 0.3 * t + g(0, 0.02)
        elif rule == "overoptimization":
            r["objective/gold"] = 0.2 + 0.6 * min(t, 0.5) - 1.2 * max(t - 0.5, 0) + g(0, 0.03)
        elif rule == "entropy_collapse":
            r["policy/entropy"] = 2.5 * math.exp(-6 * t) + abs(g(0, 0.003))
        elif rule == "clipfrac_zero":
            r["policy/clipfrac"] = 0.0
        elif rule == "clipfrac_high":
            r["policy/clipfrac"] = 0.45 + g(0, 0.03)
        elif rule == "value_loss_explosion" and t > 0.7:
            r["value/loss"] = 0.2 * 3 ** ((t - 0.7) * 20)
        elif rule == "value_loss_stuck":
            r["value/loss"] = 1.0 + g(0, 0.05)
            r["value/explained_variance"] = 0.02 + g(0, 0.02)
        elif rule == "explained_variance_negative":
            r["value/explained_variance"] = -0.4 + g(0, 0.05)
        elif rule == "truncation":
            r["rollout/eos_rate"] = 0.2 + g(0, 0.03)
        elif rule == "no_group_signal":  # most of GRPO's groups all right or all wrong
            r["rollout/zero_std_groups"] = min(0.75 + g(0, 0.05), 1.0)
        elif rule == "engine_mismatch":  # an engine falling behind the trained weights
            r["rollout/logprob_diff_mean"] = 0.02 + 0.3 * t + abs(g(0, 0.003))
            r["rollout/logprob_diff_max"] = 1.0 + 4 * t + abs(g(0, 0.2))
    return records


# rules that may legitimately fire together with the injected one
ALSO_ALLOWED = {
    "reward_hacking_repetition": {"entropy_collapse"},
    "value_loss_explosion": {"explained_variance_negative"},
    "value_loss_stuck": {"explained_variance_negative"},
    "reward_flat_kl_zero": {"clipfrac_zero"},
}


def write_run(run_dir: Path, records: list[dict]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return run_dir
