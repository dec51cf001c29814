"""PPO losses. All tensors are (B, R) over response tokens; each function returns (loss, stats)."""

from __future__ import annotations

import torch

from quartet.algo.stats import masked_mean, masked_var

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
RATIO_LEVELS = ("token", "sequence")
POLICY_LOSSES = {
    "ppo": "Schulman et al. 2017 (PPO clipped surrogate); clip-higher: Yu et al. 2025 (DAPO); dual-clip: Ye et al. "
           "2020 (Mastering Complex Control in MOBA Games)",
    "cispo": "MiniMax 2025 (MiniMax-M1, CISPO: clipped importance-sampling weights)",
}
"""the policy losses `clipped_policy_loss` and `cispo_loss` compute, with their papers (config reads the names)"""


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


def _ratio(log_ratio: torch.Tensor, mask: torch.Tensor, ratio_level: str) -> torch.Tensor:
    """rho per token, or GSPO's sequence ratio exp(mean over the sequence's tokens of log rho_t) on every token of
    its sequence (Zheng et al. 2025; its gradient still reaches every token). (B, R) -> (B, R)."""
    if ratio_level == "sequence":
        seq_log_ratio = masked_mean(log_ratio, mask, dim=1).unsqueeze(1)  # (B, 1)
        return torch.exp(seq_log_ratio).expand_as(log_ratio)
    if ratio_level == "token":
        return torch.exp(log_ratio)
    raise ValueError(f"unknown ratio level {ratio_level!r}; expected one of {', '.join(RATIO_LEVELS)}")


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
    clip_high: float | None = None,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7), as a loss to minimise.

    L = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) with rho = exp(logprobs - old_logprobs) per token
    (ratio_level="sequence": GSPO's sequence ratio, see `_ratio`). eps_low = `clip`, eps_high = `clip_high`
    (None: `clip`); a larger eps_high is DAPO's clip-higher (Yu et al. 2025): a token the policy found unlikely
    may gain more before its ratio clips, which keeps exploration alive. `dual_clip` c > 1 (Ye et al. 2020): where
    A < 0 the loss is also capped at c * |A|, so a ratio far above 1 on a bad token cannot make one update's loss
    unbounded. stats: policy/clipfrac (share of tokens where the clipped term is the active one), policy/approx_kl
    (k3 estimate of KL(old || new) on the rollout tokens), policy/ratio; with dual_clip, policy/dual_clipfrac (share
    of tokens at the c * |A| cap).
    """
    log_ratio = logprobs - old_logprobs
    ratio = _ratio(log_ratio, mask, ratio_level)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip, 1.0 + (clip if clip_high is None else clip_high))
    per_token = torch.maximum(unclipped, clipped)
    capped = None
    if dual_clip is not None:
        bound = -advantages * dual_clip  # c * |A| where A < 0
        capped = (advantages < 0) & (per_token > bound)
        per_token = torch.where(capped, bound, per_token)
    loss = aggregate(per_token, mask, aggregation, norm_len)
    with torch.no_grad():
        stats = {
            "policy/clipfrac": masked_mean((clipped > unclipped).float(), mask),
            "policy/approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
            "policy/ratio": masked_mean(ratio, mask),
        }
        if capped is not None:
            stats["policy/dual_clipfrac"] = masked_mean(capped.float(), mask)
    return loss, stats


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    max_weight: float,
    min_weight: float | None = None,
    aggregation: str = "token-mean",
    *,
    ratio_level: str = "token",
    norm_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax 2025, "MiniMax-M1", eq. 4): L = -sg(clip(rho, min_weight, max_weight)) * A * logprobs.

    PPO's clip zeroes the gradient of every token whose ratio left the trust region, and those are often the rare
    tokens that carry a reasoning step; CISPO clips the importance weight instead and stops its gradient, so every
    token keeps the gradient A * grad log pi, scaled by a bounded weight. Its gradient equals PPO's unclipped
    -A * rho * grad log pi with rho replaced by the clipped weight. min_weight None: no lower bound (as MiniMax-M1).
    The loss value itself means nothing (it is linear in log-probs); its gradient is the point.
    stats: policy/weight_clipfrac (share of tokens whose weight was clipped), policy/approx_kl, policy/ratio. Not
    policy/clipfrac: that is PPO's share of tokens outside its trust region, which the doctor reads as "the updates
    barely move the policy" when it stays at 0; CISPO's bound sits far out (5 by default), so its clipped share is
    near 0 in a healthy run and would raise that alarm falsely.
    """
    log_ratio = logprobs - old_logprobs
    ratio = _ratio(log_ratio, mask, ratio_level)
    weight = torch.clamp(ratio, min=min_weight, max=max_weight).detach()
    per_token = -weight * advantages * logprobs
    loss = aggregate(per_token, mask, aggregation, norm_len)
    with torch.no_grad():
        clipped = ratio > max_weight if min_weight is None else (ratio > max_weight) | (ratio < min_weight)
        stats = {
            "policy/weight_clipfrac": masked_mean(clipped.float(), mask),
            "policy/approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
            "policy/ratio": masked_mean(ratio, mask),
        }
    return loss, stats


def kept_rows_scale(mask: torch.Tensor, keep: torch.Tensor, aggregation: str = "token-mean") -> torch.Tensor:
    """The factor that turns a loss aggregated over every row of a batch, with the rows not kept contributing 0,
    into the same loss aggregated over the kept rows alone: DAPO's overlong filtering (truncated answers out of
    the loss) without changing the batch's shape. mask: (B, R); keep: (B,) 1.0 for rows kept. Tokens for
    token-mean, rows otherwise; 0 when no row is kept (the loss is then 0, not NaN)."""
    if aggregation == "token-mean":
        total, kept = mask.sum(), (mask * keep.unsqueeze(1)).sum()
    else:
        total, kept = torch.as_tensor(float(mask.shape[0])), keep.sum()
    return total / kept if kept > 0 else torch.zeros((), dtype=mask.dtype)


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
    ratio = masked_var(returns - values, mask, unbiased=False) / var_r.clamp(min=1e-12)
    return torch.where(var_r <= 1e-12, torch.zeros((), dtype=ratio.dtype, device=ratio.device), 1.0 - ratio)
