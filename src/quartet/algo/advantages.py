"""Advantage estimators: token-level GAE (PPO) and sequence-level REINFORCE."""

from __future__ import annotations

import torch

from quartet.algo.stats import check_mask, masked_sum


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, eq. 16), per row of a right-padded batch.

    delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lam * A_{t+1}.
    V after the last real token is 0 (the episode ends at EOS or at the length limit).
    rewards, values, mask: (B, R). Returns (advantages, returns = advantages + values), both 0 on padding.
    """
    check_mask(mask)
    B, R = rewards.shape
    values = values * mask
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    next_adv = torch.zeros_like(next_value)
    advantages = torch.zeros_like(values)
    for t in reversed(range(R)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = (delta + gamma * lam * next_adv) * mask[:, t]
        next_value = values[:, t]
        advantages[:, t] = next_adv
    returns = (advantages + values) * mask
    return advantages, returns


def reinforce_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, baseline: float | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-level estimator: one undiscounted return per sequence, broadcast to all its tokens.

    G_b = sum_t r_{b,t}; A_{b,t} = G_b - baseline_b (baseline: None, a scalar, or (B,)).
    Returns (advantages, returns), both (B, R) and 0 on padding. No critic is involved, so every token of a
    sequence gets the same credit: the contrast with GAE's per-token credit assignment.
    """
    check_mask(mask)
    seq_return = masked_sum(rewards, mask, dim=1)  # (B,)
    adv = seq_return if baseline is None else seq_return - baseline
    returns = seq_return.unsqueeze(1) * mask
    return adv.unsqueeze(1) * mask, returns
