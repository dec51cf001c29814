"""PPO losses. All tensors are (B, R) over response tokens; each function returns (loss, stats)."""

from __future__ import annotations

import torch

from quartet.algo.stats import masked_mean, masked_var

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
RATIO_LEVELS = ("token", "sequence")


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, aggregation: str = "token-mean", norm_len: int | None = None
) -> torch.Tensor:
    """"token-mean": mean over every real token of the batch (long answers weigh more);
    "seq-mean-token-mean": mean over tokens within each sequence, then over sequences (GRPO);
    "seq-mean-token-sum-norm": each sequence's token sum divided by the constant `norm_len` (the
    generation limit), then the mean over sequences (Dr.GRPO: no per-sequence length normalisation, so
    long wrong answers are not penalised less per token)."""
    if aggregation == "token-mean":
        return masked_mean(per_token, mask)
    if aggregation == "seq-mean-token-mean":
        return masked_mean(per_token, mask, dim=1).mean()
    if aggregation == "seq-mean-token-sum-norm":
        if not norm_len or norm_len <= 0:
            raise ValueError("seq-mean-token-sum-norm needs norm_len > 0 (the generation length limit)")
        return ((per_token * mask).sum(dim=1) / norm_len).mean()
    raise ValueError(f"unknown loss aggregation {aggregation!r}; expected one of {', '.join(AGGREGATIONS)}")


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    aggregation: str = "token-mean",
    *,
    ratio_level: str = "token",
    norm_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7), as a loss to minimise.

    L = -min(rho * A, clip(rho, 1 - eps, 1 + eps) * A) with rho = exp(logprobs - old_logprobs) per token;
    with ratio_level="sequence", rho is GSPO's length-normalised sequence ratio (Zheng et al. 2025):
    exp(mean over the sequence's tokens of log rho_t), the same for every token of the sequence (its
    gradient still reaches every token). stats: policy/clipfrac (share of tokens where the clipped term
    is the active one), policy/approx_kl (k3 estimate of KL(old || new) on the rollout tokens), policy/ratio.
    """
    log_ratio = logprobs - old_logprobs
    if ratio_level == "sequence":
        seq_log_ratio = masked_mean(log_ratio, mask, dim=1).unsqueeze(1)  # (B, 1)
        ratio = torch.exp(seq_log_ratio).expand_as(log_ratio)
    elif ratio_level == "token":
        ratio = torch.exp(log_ratio)
    else:
        raise ValueError(f"unknown ratio level {ratio_level!r}; expected one of {', '.join(RATIO_LEVELS)}")
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    per_token = torch.maximum(unclipped, clipped)
    loss = aggregate(per_token, mask, aggregation, norm_len)
    with torch.no_grad():
        stats = {
            "policy/clipfrac": masked_mean((clipped > unclipped).float(), mask),
            "policy/approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
            "policy/ratio": masked_mean(ratio, mask),
        }
    return loss, stats


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
    aggregation: str = "token-mean",
    norm_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Value loss 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2) (PPO2 / N+ details #9).

    clip=None gives plain 0.5 * MSE. stats: value/clipfrac, value/explained_variance = 1 - Var[R - V] / Var[R].
    """
    unclipped = (values - returns).square()
    if clip is None:
        per_token = unclipped
        clipfrac = torch.zeros((), dtype=values.dtype)
    else:
        v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        clipped = (v_clipped - returns).square()
        per_token = torch.maximum(unclipped, clipped)
        clipfrac = masked_mean((clipped > unclipped).float(), mask)
    loss = 0.5 * aggregate(per_token, mask, aggregation, norm_len)
    with torch.no_grad():
        stats = {
            "value/clipfrac": clipfrac.detach(),
            "value/explained_variance": explained_variance(values, returns, mask),
        }
    return loss, stats


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var[R - V] / Var[R] over real tokens: 1 is a perfect critic, 0 predicts the mean, < 0 worse."""
    var_r = masked_var(returns, mask, unbiased=False)
    if var_r <= 1e-12:
        return torch.zeros((), dtype=values.dtype)
    return 1.0 - masked_var(returns - values, mask, unbiased=False) / var_r
