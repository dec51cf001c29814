"""The gap between the engine that samples and the trainer that scores the same weights.

An inference engine (vLLM) computes the probability of each sampled token with its own kernels, precision
and weight layout, so pi_engine differs a little from the trainer's pi_old even right after a weight sync.
PPO's ratio is taken against pi_old while the tokens were drawn from pi_engine: the update is slightly
off-policy. Truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training"; TRL's vllm_importance_sampling_correction, veRL's rollout importance
sampling) reweights each token's policy loss by min(pi_old / pi_engine, C): the truncation at C bounds the
variance that a token the engine found unlikely would otherwise bring.
"""

from __future__ import annotations

import math

import torch

from quartet.algo.stats import masked_mean


def truncated_importance_weights(
    old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor, cap: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights w = min(exp(old_logprobs - engine_logprobs), cap), 0 on padding. All inputs (B, R).

    The weights are constants (no gradient): they correct which tokens were sampled, not the policy's
    gradient. Because w > 0, w * max(-A rho, -A clip(rho)) = max(-(w A) rho, -(w A) clip(rho)), so
    weighting PPO's clipped per-token loss is the same as passing advantages * w to it.
    stats: policy/tis_weight (mean weight over real tokens), policy/tis_capped (share of tokens at the cap).
    """
    if not cap > 0:
        raise ValueError(f"truncated_importance_weights: cap must be > 0, got {cap}")
    log_ratio = (old_logprobs - engine_logprobs).detach()
    # exp of the log-ratio capped first: the same as min(exp, cap) and never overflows
    weights = torch.exp(log_ratio.clamp(max=math.log(cap))) * mask
    stats = {
        "policy/tis_weight": masked_mean(weights, mask).detach(),
        "policy/tis_capped": masked_mean((log_ratio >= math.log(cap)).to(weights.dtype), mask).detach(),
    }
    return weights, stats


def logprob_gap(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """|old_logprobs - engine_logprobs| over real tokens: rollout/logprob_diff_mean and _max (nats per token)."""
    gap = (old_logprobs - engine_logprobs).abs() * mask
    return {
        "rollout/logprob_diff_mean": masked_mean(gap, mask).item(),
        "rollout/logprob_diff_max": gap.max().item(),
    }
