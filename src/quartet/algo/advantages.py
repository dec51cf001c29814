"""Advantage estimators: token-level GAE (PPO) and sequence-level REINFORCE."""

from __future__ import annotations

import torch

from quartet.algo.stats import check_mask, masked_sum, masked_whiten


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


# ---------------------------------------------------------------------------- critic-free estimators
# Scores and sequence returns are (N,) with the G samples of one prompt contiguous (N = prompts x G).
GROUP_KINDS = ("grpo", "dr_grpo", "rloo")
SCALES = ("group", "batch", "none")


def _groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 1 or x.shape[0] % group_size:
        raise ValueError(f"{x.shape[0]} scores do not split into groups of {group_size}")
    return x.reshape(-1, group_size)


def group_advantages(scores: torch.Tensor, group_size: int, kind: str, eps: float = 1e-6,
                     scale: str | None = None) -> torch.Tensor:
    """One advantage per sample from the other samples of its prompt's group. scores: (N,) -> (N,).

    "grpo": (r - mean_G) / (std_G + eps) with the unbiased std (Shao et al. 2024, DeepSeekMath; as veRL
            and TRL compute it);
    "dr_grpo": r - mean_G (Liu et al. 2025, "Understanding R1-Zero-Like Training": no std division, which
            weights easy and hard prompts unequally);
    "rloo": r_i - mean of the other G - 1 samples (Ahmadian et al. 2024, "Back to Basics"), an unbiased
            baseline; equals G / (G - 1) * (r_i - mean_G).
    `scale` (TRL's scale_rewards) sets the divisor of r - mean_G for grpo and dr_grpo: "group" (grpo's std_G),
    "batch" (the unbiased std of all N scores: the group's mean, the batch's scale, as "Tricks or Traps? A Deep
    Dive into RL for LLM Reasoning", Liu et al. 2025, recommend), "none" (dr_grpo's); None: the kind's own.
    A group whose scores are all equal gets advantage 0 (never NaN).
    """
    if kind not in GROUP_KINDS:
        raise ValueError(f"unknown group advantage {kind!r}; expected one of {', '.join(GROUP_KINDS)}")
    if kind != "dr_grpo" and group_size < 2:
        raise ValueError(f"{kind} needs a group of at least 2 samples per prompt, got {group_size}")
    if scale is not None and (kind == "rloo" or scale not in SCALES):
        raise ValueError(f"scale {scale!r} applies to grpo and dr_grpo only, and is one of {', '.join(SCALES)}")
    g = _groups(scores, group_size)
    mean = g.mean(dim=1, keepdim=True)
    scale = scale or {"grpo": "group", "dr_grpo": "none"}.get(kind)
    if kind == "rloo":
        adv = g - (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    elif scale == "none":
        adv = g - mean
    elif scale == "batch":
        adv = (g - mean) / (scores.std(unbiased=True) + eps)
    else:
        adv = (g - mean) / (g.std(dim=1, keepdim=True, unbiased=True) + eps)
    return torch.where(flat_groups(scores, group_size).unsqueeze(1), torch.zeros_like(adv), adv).reshape(-1)


def flat_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) scores -> (N / G,) bool: the groups whose G scores are all equal. Their group advantage is 0: with a
    right-or-wrong reward they are the prompts every sample solved or every sample failed, which teach nothing
    (DAPO's dynamic sampling drops them, Yu et al. 2025)."""
    g = _groups(scores, group_size)
    return (g == g[:, :1]).all(dim=1)


def fill_groups(flat: torch.Tensor, target: int) -> torch.Tensor:
    """DAPO's dynamic-sampling choice: (groups sampled,) bool `flat_groups` over every round in sampling order ->
    the indices of the `target` groups to train on, in sampling order: the groups with signal first come first
    served, then, when too few were found, the first flat ones (advantage 0: the batch keeps its size)."""
    order = torch.cat([(~flat).nonzero().flatten(), flat.nonzero().flatten()])
    if len(order) < target:
        raise ValueError(f"fill_groups: {len(order)} groups sampled, {target} needed")
    return order[:target].sort().values


def returns_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{s >= t} gamma^(s - t) r_s over each row's real tokens. (B, R) -> (B, R), 0 on padding."""
    check_mask(mask)
    out = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + gamma * running) * mask[:, t]
        out[:, t] = running
    return out


def reinforce_pp_returns(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float, group_size: int | None = None
) -> torch.Tensor:
    """REINFORCE++ before its batch whitening: returns-to-go, minus the group mean of the sequence returns
    when `group_size` is given (the "baseline" variant). (B, R), 0 on padding."""
    rtg = returns_to_go(rewards, mask, gamma)
    if group_size is not None:
        seq = masked_sum(rewards, mask, dim=1)
        rtg = rtg - _groups(seq, group_size).mean(dim=1).repeat_interleave(group_size).unsqueeze(1)
    return rtg * mask


def reinforce_pp_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float, group_size: int | None = None
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025, "REINFORCE++: a simple and efficient approach"): token returns-to-go of the
    KL-shaped reward, optionally minus the group mean of sequence returns, whitened over every real token
    of the batch (the global normalisation that replaces a critic). (B, R), 0 on padding."""

    return masked_whiten(reinforce_pp_returns(rewards, mask, gamma, group_size), mask) * mask


def remax_advantages(rewards: torch.Tensor, mask: torch.Tensor, greedy_scores: torch.Tensor) -> torch.Tensor:
    """ReMax (Li et al. 2023): undiscounted returns-to-go minus the score of the greedy response to the same
    prompt, a baseline that costs one greedy generation instead of a critic. greedy_scores: (B,) (already
    repeated for the samples of each prompt). (B, R), 0 on padding."""
    return (returns_to_go(rewards, mask, 1.0) - greedy_scores.to(rewards.dtype).unsqueeze(1)) * mask
