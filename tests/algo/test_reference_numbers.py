"""Hand-worked numbers from the PPO-RLHF reference text (shared/reference/002)."""

import math

import pytest
import torch

from quartet.algo import clipped_policy_loss, full_kl, kl_estimate, token_rewards


@pytest.mark.parametrize(
    ("logp", "ref", "beta", "penalty"),
    [(-1.2, -1.6, 0.05, -0.02), (-2.0, -2.4, 0.1, -0.04)],  # worked example and its exercise
)
def test_kl_penalty_worked_example(logp, ref, beta, penalty):
    # a two-token response: the first token carries only the KL penalty
    mask = torch.ones(1, 2)
    logprobs = torch.tensor([[logp, -0.5]])
    ref_logprobs = torch.tensor([[ref, -0.5]])
    rewards, kl = token_rewards(torch.tensor([0.0]), logprobs, ref_logprobs, mask, beta, "k1")
    assert rewards[0, 0].item() == pytest.approx(penalty, abs=1e-6)
    assert kl[0, 0].item() == pytest.approx(0.4, abs=1e-6)


def test_score_lands_on_last_real_token_only():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    lp = torch.zeros(2, 4)
    rewards, kl = token_rewards(torch.tensor([2.0, -1.0]), lp, lp, mask, 0.1)
    assert rewards.tolist() == [[0.0, 0.0, 2.0, 0.0], [-1.0, 0.0, 0.0, 0.0]]
    assert kl.abs().sum() == 0


def test_clipped_objective_worked_example():
    # ratio 1.3, A = 2, eps = 0.2: min(2.6, 1.2 * 2) = 2.4, so the loss is -2.4
    old = torch.tensor([[0.0]])
    new = torch.tensor([[math.log(1.3)]])
    loss, stats = clipped_policy_loss(new, old, torch.tensor([[2.0]]), torch.ones(1, 1), clip=0.2)
    assert loss.item() == pytest.approx(-2.4, abs=1e-6)
    assert stats["policy/clipfrac"].item() == 1.0


def test_clipping_negative_advantage_keeps_pessimistic_term():
    # A < 0 and ratio 0.5: min(-1 * 0.5, -1 * 0.8) = -0.8 (the clip stops pushing probability further down)
    old = torch.zeros(1, 1)
    new = torch.tensor([[math.log(0.5)]])
    loss, _ = clipped_policy_loss(new, old, torch.tensor([[-1.0]]), torch.ones(1, 1), clip=0.2)
    assert loss.item() == pytest.approx(0.8, abs=1e-6)


def test_kl_estimators_closed_forms():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    d = logp - ref
    assert torch.allclose(kl_estimate(logp, ref, "k1"), d)
    assert torch.allclose(kl_estimate(logp, ref, "k2"), 0.5 * d**2)
    assert torch.allclose(kl_estimate(logp, ref, "k3"), torch.exp(ref - logp) - 1 - (ref - logp))
    assert (kl_estimate(logp, ref, "k3") >= 0).all()
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(logp, ref, "k4")


def test_full_kl_hand_worked():
    # p = (0.5, 0.5), q = (0.25, 0.75): KL(p || q) = 0.5 ln 2 + 0.5 ln(2/3) = 0.5 ln(4/3) = 0.143841...; a
    # distribution against itself is 0; batch dimensions are kept, the vocabulary summed over
    p = torch.tensor([0.5, 0.5]).log()
    q = torch.tensor([0.25, 0.75]).log()
    assert full_kl(p, q).item() == pytest.approx(0.5 * math.log(4 / 3), abs=1e-7)
    assert full_kl(q, q).item() == pytest.approx(0.0, abs=1e-7)
    batch = full_kl(torch.stack([p, q])[None], torch.stack([q, q])[None])
    assert batch.shape == (1, 2) and batch[0, 1].item() == pytest.approx(0.0, abs=1e-7)


def test_kl_estimators_are_unbiased_or_not_as_documented():
    # sample from p, estimate KL(p||q) for two categoricals; k1 and k3 are unbiased, k2 is not exactly
    torch.manual_seed(0)
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.3, 0.4, 0.3])
    true_kl = (p * (p / q).log()).sum()
    x = torch.multinomial(p, 400_000, replacement=True)
    logp, logq = p.log()[x].unsqueeze(0), q.log()[x].unsqueeze(0)
    for kind in ("k1", "k3"):
        assert kl_estimate(logp, logq, kind).mean().item() == pytest.approx(true_kl.item(), abs=3e-3)
