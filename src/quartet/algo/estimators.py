"""The policy-gradient family as a registry of advantage estimators.

PPO, GRPO, Dr.GRPO, RLOO, REINFORCE++ and ReMax share everything but credit assignment: how the
per-token rewards (the score at the last token, minus beta * KL per token when the KL is in the reward)
become per-token advantages. Each estimator here maps

    rewards (B, R), mask (B, R) [, values (B, R), greedy_scores (B,)] -> (advantages (B, R), returns (B, R))

with the G samples of one prompt contiguous. Advantages come back *before* batch whitening: whitening is a
statistic of the whole batch, which the trainer computes over all processes (`whiten` says whether the
method whitens by default). `returns` are the critic's regression targets (GAE) or, for critic-free
estimators, the sequence / to-go returns the advantages were made from (logged, not trained on).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from quartet.algo.advantages import gae, group_advantages, reinforce_pp_returns, returns_to_go
from quartet.algo.stats import masked_sum


@dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    needs_critic: bool
    """GAE needs values V(s_t) from a critic"""
    group: bool
    """needs samples_per_prompt >= 2 (a baseline from the prompt's other samples)"""
    needs_greedy: bool
    """ReMax: the trainer also generates and scores a greedy response per prompt"""
    whiten: bool
    """whiten advantages over the batch unless the config says otherwise"""
    paper: str
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    title: str = ""
    """the algorithm the PPO loop becomes with this estimator, as people name it (logs, summaries, reports, cards)"""

    @property
    def algorithm(self) -> str:
        """the same as one lower-case word, for records, tags and progress bars: the estimator's name, "ppo" for
        GAE (the metrics' `stage` stays "ppo" for them all: code keys on it)"""
        return "ppo" if self.name == "gae" else self.name

    def __call__(self, rewards, mask, *, values=None, group_size=1, gamma=1.0, lam=1.0, greedy_scores=None,
                 scale_rewards=None):
        """`scale_rewards`: grpo's and dr_grpo's divisor (`group_advantages`' scale; None: the estimator's own)."""
        if self.needs_critic and values is None:
            raise ValueError(f"advantage '{self.name}' needs values from a critic")
        if self.needs_greedy and greedy_scores is None:
            raise ValueError(f"advantage '{self.name}' needs the greedy responses' scores")
        if scale_rewards is not None and self.name not in SCALABLE:
            raise ValueError(f"scale_rewards applies to {' and '.join(SCALABLE)}, not to advantage '{self.name}'")
        return self.fn(rewards, mask, values=values, group_size=group_size, gamma=gamma, lam=lam,
                       greedy_scores=greedy_scores, scale_rewards=scale_rewards)


def _gae(rewards, mask, *, values, gamma, lam, **_):
    return gae(rewards, values, mask, gamma, lam)


def _group(kind: str):
    def fn(rewards, mask, *, group_size, scale_rewards=None, **_):
        seq = masked_sum(rewards, mask, dim=1)  # (B,) sequence return: score - beta * KL when KL is in the reward
        adv = group_advantages(seq, group_size, kind, scale=scale_rewards)
        return adv.unsqueeze(1) * mask, seq.unsqueeze(1) * mask

    return fn


def _reinforce_pp(baseline: bool):
    def fn(rewards, mask, *, group_size, gamma, **_):
        rtg = returns_to_go(rewards, mask, gamma)
        adv = reinforce_pp_returns(rewards, mask, gamma, group_size if baseline else None)
        return adv, rtg

    return fn


def _remax(rewards, mask, *, greedy_scores, **_):
    rtg = returns_to_go(rewards, mask, 1.0)
    return (rtg - greedy_scores.to(rtg.dtype).unsqueeze(1)) * mask, rtg


SCALABLE = ("grpo", "dr_grpo")
"""the estimators whose advantage is r - mean_G over a divisor that `scale_rewards` (TRL's name) chooses"""

ESTIMATORS: dict[str, AdvantageEstimator] = {
    e.name: e
    for e in [
        AdvantageEstimator("gae", True, False, False, True, "Schulman et al. 2016 (GAE) + 2017 (PPO)", _gae,
                           title="PPO"),
        AdvantageEstimator("grpo", False, True, False, False, "Shao et al. 2024 (DeepSeekMath)", _group("grpo"),
                           title="GRPO"),
        AdvantageEstimator("dr_grpo", False, True, False, False, "Liu et al. 2025 (Dr. GRPO)", _group("dr_grpo"),
                           title="Dr. GRPO"),
        AdvantageEstimator("rloo", False, True, False, False, "Ahmadian et al. 2024 (RLOO)", _group("rloo"),
                           title="RLOO"),
        AdvantageEstimator("reinforce_pp", False, False, False, True, "Hu 2025 (REINFORCE++)", _reinforce_pp(False),
                           title="REINFORCE++"),
        AdvantageEstimator("reinforce_pp_baseline", False, True, False, True, "Hu 2025 (REINFORCE++ baseline)",
                           _reinforce_pp(True), title="REINFORCE++ baseline"),
        AdvantageEstimator("remax", False, False, True, False, "Li et al. 2023 (ReMax)", _remax, title="ReMax"),
    ]
}


def get_estimator(name: str) -> AdvantageEstimator:
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; expected one of {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name]
