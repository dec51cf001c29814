"""Truncated importance weights and the engine/trainer log-prob gap: hand-worked numbers and the
equivalence of weighting the clipped per-token loss with weighting the advantages."""

import math

import pytest
import torch

from quartet.algo import clipped_policy_loss, logprob_gap, truncated_importance_weights

# trainer probabilities, engine probabilities of the same sampled tokens; the last column is padding
OLD = torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.6, 0.7]], dtype=torch.float64).log()
ENGINE = torch.tensor([[0.25, 0.4, 0.1], [0.3, 0.5, 0.01]], dtype=torch.float64).log()
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)


def test_weights_by_hand():
    # ratios 0.5/0.25 = 2 -> capped at 1.5; 0.2/0.4 = 0.5; 0.3/0.3 = 1; 0.6/0.5 = 1.2; padding -> 0
    w, stats = truncated_importance_weights(OLD, ENGINE, MASK, cap=1.5)
    torch.testing.assert_close(w, torch.tensor([[1.5, 0.5, 0.0], [1.0, 1.2, 0.0]], dtype=torch.float64))
    assert stats["policy/tis_weight"].item() == pytest.approx(4.2 / 4)
    assert stats["policy/tis_capped"].item() == pytest.approx(1 / 4)  # the padded ratio 9 (and 70) not counted


def test_gap_by_hand():
    gap = logprob_gap(OLD, ENGINE, MASK)
    assert gap["rollout/logprob_diff_mean"] == pytest.approx((2 * math.log(2) + math.log(1.2)) / 4)
    assert gap["rollout/logprob_diff_max"] == pytest.approx(math.log(2))  # ln 9 and ln 70 are padding


def test_huge_ratio_stays_finite_and_weights_carry_no_gradient():
    old = torch.tensor([[0.0, -1.0]], dtype=torch.float64, requires_grad=True)
    engine = torch.tensor([[-1000.0, -1.0]], dtype=torch.float64)
    w, _ = truncated_importance_weights(old, engine, torch.ones(1, 2, dtype=torch.float64), cap=2.0)
    assert w.tolist() == [[2.0, 1.0]] and not w.requires_grad


def test_cap_must_be_positive():
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_importance_weights(OLD, ENGINE, MASK, cap=0.0)


@pytest.mark.parametrize("seed", range(5))
def test_weighting_the_advantages_equals_weighting_the_clipped_token_loss(seed):
    g = torch.Generator().manual_seed(seed)
    B, R, clip, cap = 4, 6, 0.2, 2.0
    mask = (torch.arange(R) < torch.randint(1, R + 1, (B, 1), generator=g)).double()
    old = -torch.rand(B, R, generator=g, dtype=torch.float64) * 3
    engine = old + torch.randn(B, R, generator=g, dtype=torch.float64)
    adv = torch.randn(B, R, generator=g, dtype=torch.float64)
    logprobs = (old + 0.3 * torch.randn(B, R, generator=g, dtype=torch.float64)).requires_grad_()

    w, _ = truncated_importance_weights(old, engine, mask, cap)
    fast, _ = clipped_policy_loss(logprobs, old, adv * w, mask, clip)

    # slow: the per-token PPO loss, each token times min(pi_old / pi_engine, cap), token-mean over real tokens
    total, count = 0.0, 0
    for b in range(B):
        for t in range(R):
            if mask[b, t] == 0:
                continue
            rho = torch.exp(logprobs[b, t] - old[b, t])
            per_token = torch.maximum(-adv[b, t] * rho, -adv[b, t] * rho.clamp(1 - clip, 1 + clip))
            weight = min(math.exp(old[b, t] - engine[b, t]), cap)
            total = total + weight * per_token
            count += 1
    slow = total / count
    assert fast.item() == pytest.approx(slow.item(), rel=1e-12)
    (g_fast,) = torch.autograd.grad(fast, logprobs)
    (g_slow,) = torch.autograd.grad(slow, logprobs)
    torch.testing.assert_close(g_fast, g_slow)
