"""Preference losses (DPO / cDPO / IPO / SLiC hinge / SimPO): hand-worked numbers, a per-pair formula on
random batches, the analytic gradient, and the fixed points on one-token bandits with Bradley-Terry labels."""

from __future__ import annotations

import math

import pytest
import torch

from quartet.algo import PREFERENCE_LOSSES, preference_loss

# two pairs: (policy chosen, policy rejected, ref chosen, ref rejected) log-probs
PC, PR = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0])
RC, RR = torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0])
# log-ratio differences h: pair 1: (-1 + 2) - (-3 + 2) = 2; pair 2: (-2 + 2) - (-1 + 2) = -1


def log1pexp(x: float) -> float:
    return math.log1p(math.exp(x))


@pytest.mark.parametrize(("kind", "smoothing", "expected"), [
    # beta = 0.5: beta h = 1 and -0.5; -log sigmoid(z) = log(1 + e^-z)
    ("sigmoid", 0.0, (log1pexp(-1.0) + log1pexp(0.5)) / 2),
    # cDPO: 0.9 log(1 + e^-z) + 0.1 log(1 + e^z)
    ("sigmoid", 0.1, (0.9 * log1pexp(-1.0) + 0.1 * log1pexp(1.0) + 0.9 * log1pexp(0.5) + 0.1 * log1pexp(-0.5)) / 2),
    # IPO: (h - 1 / (2 * 0.5))^2 = (2 - 1)^2 and (-1 - 1)^2
    ("ipo", 0.0, (1.0 + 4.0) / 2),
    # hinge: max(0, 1 - 0.5 h) = 0 and 1.5
    ("hinge", 0.0, (0.0 + 1.5) / 2),
])
def test_hand_worked_numbers(kind, smoothing, expected):
    loss, _ = preference_loss(PC, PR, RC, RR, beta=0.5, kind=kind, label_smoothing=smoothing)
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_reference_free_with_margin_is_simpo():
    # no reference: h = pc - pr = 2 and -1; z = 0.5 h - 0.5 = 0.5 and -1
    loss, stats = preference_loss(PC, PR, None, None, beta=0.5, gamma=0.5)
    assert loss.item() == pytest.approx((log1pexp(-0.5) + log1pexp(1.0)) / 2, rel=1e-6)
    assert stats["rewards/chosen"].item() == pytest.approx(0.5 * (-1.0 - 2.0) / 2)  # beta * log pi, no reference


def test_stats_by_hand():
    _, stats = preference_loss(PC, PR, RC, RR, beta=0.5)
    # implicit rewards beta (log pi - log pi_ref): chosen [0.5, 0], rejected [-0.5, 0.5]
    expected = {"rewards/chosen": 0.25, "rewards/rejected": 0.0, "rewards/margins": 0.25, "rewards/accuracy": 0.5,
                "logps/chosen": -1.5, "logps/rejected": -2.0}
    assert {k: round(v.item(), 6) for k, v in stats.items()} == expected
    assert not any(v.requires_grad for v in stats.values())


def softplus(x: float) -> float:
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


def per_pair_reference(pc, pr, rc, rr, beta, kind, eps, gamma):
    """The losses written out for one pair with the math module, as in the papers."""
    h = (pc - (rc or 0.0)) - (pr - (rr or 0.0))
    if kind == "sigmoid":
        z = beta * h - gamma
        # -log sigmoid(z) = log(1 + e^-z), -log(1 - sigmoid(z)) = log(1 + e^z), each in a form exact in floats
        return (1 - eps) * softplus(-z) + eps * softplus(z)
    if kind == "ipo":
        return (h - 1.0 / (2.0 * beta)) ** 2
    return max(0.0, 1.0 - beta * h)


@pytest.mark.parametrize("kind", PREFERENCE_LOSSES)
@pytest.mark.parametrize("seed", range(3))
def test_random_batches_match_the_per_pair_formula(kind, seed):
    g = torch.Generator().manual_seed(seed)
    B = 17
    pc, pr, rc, rr = (-20 * torch.rand(B, generator=g, dtype=torch.float64) for _ in range(4))
    beta = float(torch.empty(1).uniform_(0.05, 2.0, generator=g))
    options = [(0.0, 0.0)] + ([(0.2, 0.0), (0.0, 0.7), (0.1, 0.3)] if kind == "sigmoid" else [])
    for eps, gamma in options:
        for ref in (True, False):
            loss, _ = preference_loss(pc, pr, rc if ref else None, rr if ref else None, beta, kind, eps, gamma)
            expected = sum(
                per_pair_reference(a, b, c if ref else None, d if ref else None, beta, kind, eps, gamma)
                for a, b, c, d in zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist())
            ) / B
            assert loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_gradient_matches_the_analytic_one():
    """d/d log pi(y_c) of -(1-eps) log sig(z) - eps log sig(-z), z = beta h: beta ((1-eps) - sig(z)) * -1 / B."""
    pc, pr = PC.clone().requires_grad_(), PR.clone().requires_grad_()
    beta, eps = 0.5, 0.1
    loss, _ = preference_loss(pc, pr, RC, RR, beta, label_smoothing=eps)
    loss.backward()
    z = beta * torch.tensor([2.0, -1.0])
    expected = -beta * ((1 - eps) - torch.sigmoid(z)) / 2
    torch.testing.assert_close(pc.grad, expected)
    torch.testing.assert_close(pr.grad, -expected)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="unknown preference loss 'kto'"):
        preference_loss(PC, PR, RC, RR, 0.1, kind="kto")
    with pytest.raises(ValueError, match="beta must be > 0"):
        preference_loss(PC, PR, RC, RR, 0.0)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        preference_loss(PC, PR, RC, RR, 0.1, label_smoothing=0.5)
    with pytest.raises(ValueError, match="sigmoid loss only"):
        preference_loss(PC, PR, RC, RR, 0.1, kind="ipo", label_smoothing=0.1)


# --------------------------------------------------------------------------- fixed points on bandits
def bradley_terry_pairs(r: torch.Tensor, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n (winner, loser) pairs: two distinct actions uniformly at random, the first wins with
    probability sigmoid(r_a - r_b)."""
    g = torch.Generator().manual_seed(seed)
    K = r.numel()
    a = torch.randint(K, (n,), generator=g)
    b = (a + torch.randint(1, K, (n,), generator=g)) % K  # uniform over the other actions
    a_wins = torch.rand(n, generator=g) < torch.sigmoid(r[a] - r[b])
    return torch.where(a_wins, a, b), torch.where(a_wins, b, a)


def fit(ref_logits, winners, losers, beta, kind="sigmoid", eps=0.0, steps=200) -> torch.Tensor:
    """Minimise the mean loss over all pairs in the logits theta of a one-token policy softmax(theta),
    starting at the reference (convex for sigmoid and ipo: log pi(a) - log pi(b) = theta_a - theta_b)."""
    ref_logp = ref_logits.log_softmax(-1)
    theta = ref_logits.clone().requires_grad_()
    opt = torch.optim.LBFGS([theta], lr=1.0, max_iter=steps, tolerance_grad=1e-12, tolerance_change=1e-14,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        logp = theta.log_softmax(-1)
        loss, _ = preference_loss(logp[winners], logp[losers], ref_logp[winners], ref_logp[losers], beta, kind, eps)
        loss.backward()
        return loss

    opt.step(closure)
    return theta.detach().double().log_softmax(-1)


def test_dpo_reaches_pi_ref_exp_r_over_beta():
    """DPO's optimum under Bradley-Terry labels of reward r is pi* ~ pi_ref exp(r / beta) (Rafailov et al. 2023,
    eq. 4): reached from 200k sampled pairs on a 4-action bandit."""
    r = torch.tensor([1.0, 0.0, -0.5, 2.0], dtype=torch.float64)
    ref_logits = torch.tensor([0.3, -0.2, 0.9, 0.0], dtype=torch.float64)
    beta = 1.0
    winners, losers = bradley_terry_pairs(r, 200_000, seed=0)
    logp = fit(ref_logits, winners, losers, beta)
    target = (ref_logits + r / beta).log_softmax(-1)
    # sampling noise: ~33k pairs per action pair, so the fitted log-ratios are within ~0.03 of r / beta
    torch.testing.assert_close(logp.exp(), target.exp(), atol=0.01, rtol=0)
    assert (logp - target).abs().max() < 0.05
    # the target is far from where the fit started and from softmax(r): reaching it is not an accident
    assert (ref_logits.log_softmax(-1) - target).abs().max() > 1.0
    assert (r.log_softmax(-1) - target).abs().max() > 0.3


def test_larger_beta_stays_closer_to_the_reference():
    r = torch.tensor([1.0, 0.0, -0.5, 2.0], dtype=torch.float64)
    ref_logits = torch.zeros(4, dtype=torch.float64)
    winners, losers = bradley_terry_pairs(r, 100_000, seed=1)
    for beta in (0.5, 2.0):
        logp = fit(ref_logits, winners, losers, beta)
        target = (ref_logits + r / beta).log_softmax(-1)
        assert (logp - target).abs().max() < 0.08, beta


def empirical_two_action(p: float, n: int, seed: int):
    """Two actions; action 1 beats action 0 with probability p. Returns (winners, losers, empirical rate)."""
    winners, losers = bradley_terry_pairs(torch.tensor([0.0, math.log(p / (1 - p))], dtype=torch.float64), n, seed)
    return winners, losers, (winners == 1).double().mean().item()


@pytest.mark.parametrize(("kind", "eps"), [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0)])
def test_two_action_fixed_points_in_closed_form(kind, eps):
    """With one pair of actions the optimum of the mean loss over the sample is exact, in terms of the
    empirical rate q at which action 1 wins; h = log-ratio of action 1 minus that of action 0:
        DPO   beta h = logit(q)                        (maximum likelihood Bradley-Terry)
        cDPO  beta h = logit((1 - eps) q + eps (1 - q)) (labels flipped with probability eps)
        IPO   h = (2 q - 1) / (2 beta)                  (least squares onto targets +-1 / (2 beta))"""
    ref_logits = torch.tensor([0.4, -0.3], dtype=torch.float64)
    beta = 0.3
    winners, losers, q = empirical_two_action(0.8, 5000, seed=2)
    logp = fit(ref_logits, winners, losers, beta, kind, eps)
    ref_logp = ref_logits.log_softmax(-1)
    h = ((logp[1] - ref_logp[1]) - (logp[0] - ref_logp[0])).item()
    if kind == "ipo":
        expected = (2 * q - 1) / (2 * beta)
    else:
        q_eff = (1 - eps) * q + eps * (1 - q)
        expected = math.log(q_eff / (1 - q_eff)) / beta
    assert h == pytest.approx(expected, rel=1e-5)
    assert abs(h) > 0.5  # the policy moved


def test_hinge_settles_at_margin_one_over_beta():
    """SLiC's hinge on one pair of actions that action 1 usually wins: q max(0, 1 - beta h) +
    (1 - q) max(0, 1 + beta h) is smallest at beta h = 1 (a calibrated margin, not an infinite one)."""
    ref_logits = torch.zeros(2, dtype=torch.float64)
    beta = 0.5
    winners, losers, _ = empirical_two_action(0.8, 2000, seed=3)
    theta = ref_logits.clone().requires_grad_()
    opt = torch.optim.SGD([theta], lr=0.05)
    for step in range(3000):
        for group in opt.param_groups:  # decaying steps, so the subgradient iterates settle on the kink
            group["lr"] = 0.5 / (1 + step)
        opt.zero_grad()
        logp = theta.log_softmax(-1)
        loss, _ = preference_loss(logp[winners], logp[losers], torch.zeros(len(winners), dtype=torch.float64),
                                  torch.zeros(len(winners), dtype=torch.float64), beta, "hinge")
        loss.backward()
        opt.step()
    h = (theta[1] - theta[0]).item()
    assert beta * h == pytest.approx(1.0, abs=0.02)
