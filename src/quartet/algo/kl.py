"""KL estimators, the RLHF per-token reward, and the KL-coefficient controllers."""

from __future__ import annotations

import torch

from quartet.algo.stats import check_mask, last_token_index

KL_KINDS = ("k1", "k2", "k3")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman, "Approximating KL").

    k1 = log r, k2 = 0.5 (log r)^2, k3 = (1/r - 1) + log r, where log r = logprobs - ref_logprobs.
    k1 is unbiased but can be negative; k2 is biased, low variance; k3 is unbiased and never negative.
    All inputs and the output are (B, R).
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        # exp(ref - logp) - 1 - (ref - logp)
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {', '.join(KL_KINDS)}")


def full_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_v p(v) (log p(v) - log q(v)) over the last dimension, from log-probabilities (..., V) of the
    same vocabulary: the exact KL of two next-token distributions, where `kl_estimate` estimates it from sampled
    tokens. Returns (...)."""
    return (logprobs.exp() * (logprobs - ref_logprobs)).sum(-1)


def token_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    kind: str = "k1",
    length_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLHF token reward (Ziegler et al. 2019; InstructGPT): r_t = -beta * KL_t, plus the score at the last token.

    `length_coef` c: every response token also pays c, beside the KL term, so a sequence's return falls by c x its
    length: a length penalty in the reward, which every estimator sees (a verbosity control, e.g. c = 1e-3 per
    token against answers that pad themselves for a judge).
    scores: (B,) sequence score; logprobs, ref_logprobs, mask: (B, R).
    Returns (rewards, kl), both (B, R) and 0 on padding.
    """
    check_mask(mask)
    kl = kl_estimate(logprobs, ref_logprobs, kind) * mask
    rewards = -kl_coef * kl
    if length_coef:
        rewards = rewards - length_coef * mask
    last = last_token_index(mask)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last] += scores.to(rewards.dtype)
    return rewards, kl


class FixedKL:
    """Constant beta."""

    def __init__(self, coef: float):
        if coef < 0:
            raise ValueError(f"kl coefficient must be >= 0, got {coef}")
        self.value = float(coef)

    def update(self, observed_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKL(FixedKL):
    """Proportional beta controller of Ziegler et al. 2019 (Fine-Tuning LMs from Human Preferences, sec. 2.2).

    e = clip((KL - target) / target, -0.2, 0.2);  beta <- beta * (1 + e * n_steps / horizon).
    `n_steps` is the number of sequences since the last update. The fraction n_steps / horizon is capped
    at 1, so one update moves beta by at most 20% and beta can never become negative.
    """

    def __init__(self, init: float, target: float, horizon: int):
        super().__init__(init)
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target}, {horizon}")
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, observed_kl: float, n_steps: int) -> float:
        error = min(max((observed_kl - self.target) / self.target, -0.2), 0.2)
        self.value *= 1.0 + error * min(n_steps / self.horizon, 1.0)
        return self.value
