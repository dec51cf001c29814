"""Direct preference losses: the policy learns from (chosen, rejected) pairs with no reward model.

Inputs are per-pair sequence log-probs, all (B,): the policy's and the reference's log pi(y | x) of the
chosen and the rejected response (sums over response tokens, or means for the length-normalised variant).
With h = (log pi(y_c) - log pi_ref(y_c)) - (log pi(y_r) - log pi_ref(y_r)), the log-ratio difference:

    sigmoid  -log sigmoid(beta h)          DPO (Rafailov et al. 2023, eq. 7): Bradley-Terry on the implicit
                                           reward beta log pi / pi_ref; optimum pi ~ pi_ref exp(r / beta)
             label smoothing eps: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h), the
             conservative DPO of Mitchell (2023) for labels flipped with probability eps
    ipo      (h - 1 / (2 beta))^2           IPO (Azar et al. 2023, eq. 17): regresses h onto a fixed target,
                                           so it cannot push the margin to infinity on deterministic data
    hinge    max(0, 1 - beta h)            SLiC-HF calibration loss (Zhao et al. 2023) on the log-ratios

`ref_*` None means reference-free (log pi_ref = 0), which with length-normalised log-probs and a margin
gamma inside the sigmoid is SimPO (Meng et al. 2024): -log sigmoid(beta h - gamma).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PREFERENCE_LOSSES = ("sigmoid", "ipo", "hinge")


def preference_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    beta: float,
    kind: str = "sigmoid",
    label_smoothing: float = 0.0,
    gamma: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean preference loss over the B pairs (see the module docstring) and its stats.

    stats (means over pairs, no gradient): rewards/chosen and rewards/rejected, the implicit rewards
    beta (log pi - log pi_ref); rewards/margins, their difference; rewards/accuracy, the share of pairs
    whose chosen reward is strictly higher; logps/chosen and logps/rejected, the policy's log-probs.
    """
    if kind not in PREFERENCE_LOSSES:
        raise ValueError(f"unknown preference loss {kind!r}; expected one of {', '.join(PREFERENCE_LOSSES)}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if kind != "sigmoid" and (label_smoothing or gamma):
        raise ValueError(f"label_smoothing and gamma apply to the sigmoid loss only, not {kind!r}")
    chosen_ratio = chosen_logps - (ref_chosen_logps if ref_chosen_logps is not None else 0.0)
    rejected_ratio = rejected_logps - (ref_rejected_logps if ref_rejected_logps is not None else 0.0)
    h = chosen_ratio - rejected_ratio
    if kind == "sigmoid":
        z = beta * h - gamma
        per_pair = -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    elif kind == "ipo":
        per_pair = (h - 1.0 / (2.0 * beta)).square()
    else:
        per_pair = torch.relu(1.0 - beta * h)
    with torch.no_grad():
        chosen_rewards, rejected_rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
        stats = {
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "rewards/accuracy": (chosen_rewards > rejected_rewards).float().mean(),
            "logps/chosen": chosen_logps.detach().mean(),
            "logps/rejected": rejected_logps.detach().mean(),
        }
    return per_pair.mean(), stats
