"""Synthetic DPO metric streams: a healthy run and one where both answers' log-probs go down."""

from __future__ import annotations

import math
import random

BETA = 0.1


def dpo_run(n: int = 40, seed: int = 0, chosen_end: float = 0.3, rejected_end: float = -8.0) -> list[dict]:
    """Implicit rewards beta (log pi - log pi_ref) moving linearly from 0 to `chosen_end` / `rejected_end`
    nats (times beta), with batch noise; loss falling, accuracy rising, KL growing."""
    rng = random.Random(seed)
    g = rng.gauss
    records = []
    for i in range(n):
        t = i / max(n - 1, 1)
        chosen = BETA * (chosen_end * t + g(0, 0.4))
        rejected = BETA * (rejected_end * t + g(0, 0.4))
        margin = chosen - rejected
        records.append({
            "stage": "dpo",
            "step": 10 * (i + 1),
            "time": 1_700_000_000.0 + 2 * i,
            "dpo/loss": math.log1p(math.exp(-margin)) + abs(g(0, 0.02)),
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
            "rewards/margins": margin,
            "rewards/accuracy": min(1.0, 0.5 + 0.5 * t + abs(g(0, 0.03))),
            "logps/chosen": -60.0 + chosen / BETA + g(0, 3.0),
            "logps/rejected": -62.0 + rejected / BETA + g(0, 3.0),
            "dpo/beta": BETA,
            "optim/lr": 1e-6,
            "optim/grad_norm": 2.0 * math.exp(g(0, 0.2)),
            "memory/peak_rss_mb": 900.0,
        })
    return records


def healthy_dpo_run(n: int = 40, seed: int = 0) -> list[dict]:
    """The chosen answers keep their likelihood (+0.3 nats), the rejected ones lose 8 nats."""
    return dpo_run(n, seed)


def both_down_dpo_run(n: int = 40, seed: int = 0) -> list[dict]:
    """The margin grows, but by pushing both answers down: chosen -6 nats, rejected -10 nats."""
    return dpo_run(n, seed, chosen_end=-6.0, rejected_end=-10.0)
