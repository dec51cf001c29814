"""The reasoning-RL knobs' math (issue 39), each against a slow loop or numbers worked by hand: clip-higher and
dual-clip, CISPO, the kept-rows scale of overlong filtering, grpo's reward scaling, flat groups and dynamic
sampling's choice, DAPO's soft overlong penalty, the per-token length penalty."""

import math

import pytest
import torch

from quartet.algo import (
    ESTIMATORS,
    aggregate,
    cispo_loss,
    clipped_policy_loss,
    fill_groups,
    flat_groups,
    group_advantages,
    kept_rows_scale,
    overlong_penalty,
    token_rewards,
)


def batch(seed, B=6, R=5, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, R + 1, (B,), generator=g)
    mask = (torch.arange(R).unsqueeze(0) < lengths.unsqueeze(1)).double()
    old = -torch.rand(B, R, generator=g, dtype=torch.float64) * 3
    new = old + torch.randn(B, R, generator=g, dtype=torch.float64) * spread
    adv = torch.randn(B, R, generator=g, dtype=torch.float64)
    return new, old, adv, mask


# ---------------------------------------------------------------------------- clip-higher and dual-clip
def slow_ppo(new, old, adv, mask, low, high, dual=None):
    """Per token, as written in the papers, then the token mean."""
    total, count = 0.0, 0.0
    for b in range(new.shape[0]):
        for t in range(new.shape[1]):
            if not mask[b, t]:
                continue
            r, a = math.exp(new[b, t] - old[b, t]), float(adv[b, t])
            loss = -min(r * a, min(max(r, 1 - low), 1 + high) * a)
            if dual is not None and a < 0:
                loss = min(loss, -dual * a)
            total, count = total + loss, count + 1
    return total / count


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("low, high, dual", [(0.2, 0.28, None), (0.1, 0.5, None), (0.2, 0.2, 3.0), (0.2, 0.28, 1.5)])
def test_asymmetric_and_dual_clip_match_a_slow_loop(seed, low, high, dual):
    new, old, adv, mask = batch(seed)
    loss, stats = clipped_policy_loss(new, old, adv, mask, low, clip_high=high, dual_clip=dual)
    assert loss.item() == pytest.approx(slow_ppo(new, old, adv, mask, low, high, dual), abs=1e-12)
    assert ("policy/dual_clipfrac" in stats) == (dual is not None)


def test_clip_high_equal_to_clip_is_the_symmetric_loss_bit_for_bit():
    new, old, adv, mask = batch(0)
    a, sa = clipped_policy_loss(new, old, adv, mask, 0.2)
    b, sb = clipped_policy_loss(new, old, adv, mask, 0.2, clip_high=0.2)
    assert torch.equal(a, b) and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_clip_higher_lets_an_unlikely_token_gain_more_by_hand():
    # rho = 1.25, A = 1: symmetric clip 0.2 caps the gain at 1.2 (zero gradient); clip_high 0.28 leaves rho as is
    old, new, adv, mask = torch.zeros(1, 1), torch.full((1, 1), math.log(1.25), requires_grad=True), \
        torch.ones(1, 1), torch.ones(1, 1)
    sym, _ = clipped_policy_loss(new, old, adv, mask, 0.2)
    assert sym.item() == pytest.approx(-1.2)
    high, _ = clipped_policy_loss(new, old, adv, mask, 0.2, clip_high=0.28)
    assert high.item() == pytest.approx(-1.25)
    high.backward()
    assert new.grad.item() == pytest.approx(-1.25)  # d(-rho A)/d logp = -rho A


def test_dual_clip_caps_a_bad_tokens_loss_at_c_times_abs_a_by_hand():
    # rho = 3, A = -1: PPO's loss is max(3, 1.2) = 3 with gradient; dual clip c = 2 caps it at 2, no gradient
    new = torch.full((1, 2), math.log(3.0), requires_grad=True)
    old, adv, mask = torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2)
    loss, stats = clipped_policy_loss(new, old, adv, mask, 0.2, dual_clip=2.0)
    assert loss.item() == pytest.approx((2.0 + -1.2) / 2)  # the A > 0 token is PPO's: -min(3, 1.2) = -1.2
    assert stats["policy/dual_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    assert new.grad.tolist() == [[0.0, 0.0]]


# ---------------------------------------------------------------------------- CISPO
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("lo, hi", [(None, 1.3), (0.8, 1.2), (None, 5.0)])
def test_cispo_value_and_gradient_match_a_slow_loop(seed, lo, hi):
    new, old, adv, mask = batch(seed)
    new = new.clone().requires_grad_(True)
    loss, stats = cispo_loss(new, old, adv, mask, hi, lo)
    loss.backward()
    n = mask.sum().item()
    want, grad, clipped = 0.0, torch.zeros_like(new), 0
    for b in range(new.shape[0]):
        for t in range(new.shape[1]):
            if not mask[b, t]:
                continue
            r = math.exp(new[b, t].item() - old[b, t].item())
            w = min(r, hi) if lo is None else min(max(r, lo), hi)
            clipped += w != r
            want += -w * adv[b, t].item() * new[b, t].item() / n
            grad[b, t] = -w * adv[b, t] / n  # the weight is a constant: d/d logp of -w A logp
    assert loss.item() == pytest.approx(want, abs=1e-12)
    assert torch.allclose(new.grad, grad, atol=1e-12)
    assert stats["policy/weight_clipfrac"].item() == pytest.approx(clipped / n)
    assert "policy/clipfrac" not in stats  # PPO's trust-region share: the doctor's clipfrac rules read it


def test_cispo_gradient_is_ppos_unclipped_gradient_inside_the_bounds():
    """d(-rho A)/d logp = -rho A: the same as CISPO's -w A with w = rho where no weight is clipped."""
    new, old, adv, mask = batch(3, spread=0.05)
    a = new.clone().requires_grad_(True)
    b = new.clone().requires_grad_(True)
    cispo_loss(a, old, adv, mask, 5.0)[0].backward()
    clipped_policy_loss(b, old, adv, mask, 0.999999, clip_high=10.0)[0].backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-12)


def test_cispo_keeps_the_gradient_of_a_token_ppo_clips():
    # rho = 1.5, A = 1: PPO (clip 0.2) takes the clipped branch, gradient 0; CISPO keeps -min(1.5, 5) x A
    new = torch.full((1, 1), math.log(1.5), requires_grad=True)
    clipped_policy_loss(new, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2)[0].backward()
    assert new.grad.item() == 0.0
    new.grad = None
    cispo_loss(new, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 5.0)[0].backward()
    assert new.grad.item() == pytest.approx(-1.5)


# ---------------------------------------------------------------------------- overlong filtering
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("seed", range(5))
def test_kept_rows_scale_gives_the_loss_of_the_kept_rows_alone(aggregation, seed):
    new, old, adv, mask = batch(seed, B=8)
    keep = (torch.rand(8, generator=torch.Generator().manual_seed(seed)) < 0.6).double()
    keep[0] = 1.0
    per_token = (new - old) * adv
    scaled = aggregate(per_token * keep.unsqueeze(1), mask, aggregation, norm_len=5) * kept_rows_scale(
        mask, keep, aggregation)
    rows = keep.bool()
    assert scaled.item() == pytest.approx(aggregate(per_token[rows], mask[rows], aggregation, 5).item(), abs=1e-12)


def test_no_kept_row_scales_to_zero_not_nan():
    assert kept_rows_scale(torch.ones(2, 3), torch.zeros(2)).item() == 0.0


# ---------------------------------------------------------------------------- reward scaling (TRL's scale_rewards)
def slow_group(scores, G, scale, eps=1e-6):
    s = scores.tolist()
    batch_std = torch.tensor(s, dtype=torch.float64).std().item()
    out = []
    for i in range(0, len(s), G):
        g = s[i : i + G]
        mean = sum(g) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in g) / (G - 1))
        div = {"group": std + eps, "batch": batch_std + eps, "none": 1.0}[scale]
        out += [0.0 if len(set(g)) == 1 else (x - mean) / div for x in g]
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("seed", range(4))
def test_scale_rewards_match_a_slow_loop(scale, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 3, (16,), generator=g).double()
    for kind in ("grpo", "dr_grpo"):
        got = group_advantages(scores, 4, kind, scale=scale)
        assert got.tolist() == pytest.approx(slow_group(scores, 4, scale), abs=1e-9)


def test_scale_rewards_by_hand_and_the_kinds_own_defaults():
    scores = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    batch_std = math.sqrt((3 * 0.625**2 + 5 * 0.375**2) / 7)  # unbiased, mean 0.375
    got = group_advantages(scores, 4, "grpo", scale="batch")
    assert got.tolist() == pytest.approx([x / (batch_std + 1e-6) for x in (-0.75, 0.25, 0.25, 0.25)] + [0.0] * 4)
    assert torch.equal(group_advantages(scores, 4, "grpo", scale="group"), group_advantages(scores, 4, "grpo"))
    assert torch.equal(group_advantages(scores, 4, "grpo", scale="none"), group_advantages(scores, 4, "dr_grpo"))
    with pytest.raises(ValueError, match="applies to grpo and dr_grpo only"):
        group_advantages(scores, 4, "rloo", scale="batch")


def test_the_estimator_passes_scale_rewards_and_refuses_it_where_it_means_nothing():
    rewards, mask = torch.zeros(4, 3), torch.ones(4, 3)
    rewards[:, -1] = torch.tensor([0.0, 1.0, 3.0, 3.0])
    adv, _ = ESTIMATORS["grpo"](rewards, mask, group_size=2, scale_rewards="none")
    assert adv[:, 0].tolist() == [-0.5, 0.5, 0.0, 0.0]
    with pytest.raises(ValueError, match="not to advantage 'rloo'"):
        ESTIMATORS["rloo"](rewards, mask, group_size=2, scale_rewards="batch")


# ---------------------------------------------------------------------------- dynamic sampling
def test_flat_groups_and_the_fill_by_hand():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 2.0, 2.0])
    assert flat_groups(scores, 2).tolist() == [True, False, True, True]
    flat = torch.tensor([True, False, True, False, False, True])
    assert fill_groups(flat, 3).tolist() == [1, 3, 4]  # the groups with signal, first come first served
    assert fill_groups(flat, 4).tolist() == [0, 1, 3, 4]  # too few: the first flat one fills the batch
    with pytest.raises(ValueError, match="6 groups sampled, 7 needed"):
        fill_groups(flat, 7)


@pytest.mark.parametrize("seed", range(6))
def test_fill_groups_matches_a_slow_loop(seed):
    flat = torch.rand(12, generator=torch.Generator().manual_seed(seed)) < 0.5
    target = 5
    chosen = [i for i in range(12) if not flat[i]][:target]
    chosen += [i for i in range(12) if flat[i]][: target - len(chosen)]
    assert fill_groups(flat, target).tolist() == sorted(chosen)


# ---------------------------------------------------------------------------- soft overlong punishment
def test_overlong_penalty_by_hand():
    # max 10, buffer 4: free up to 6 tokens, then -coef / 4 per token, -coef at the limit (DAPO eq. 13)
    lengths = torch.tensor([1.0, 6.0, 7.0, 8.0, 10.0])
    assert overlong_penalty(lengths, 10, 4).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(lengths, 10, 4, coef=2.0).tolist() == [0.0, 0.0, -0.5, -1.0, -2.0]
    assert overlong_penalty(lengths, 10, 10).tolist() == pytest.approx([-0.1, -0.6, -0.7, -0.8, -1.0])
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, 10, 0)


# ---------------------------------------------------------------------------- length penalty
def test_length_penalty_is_paid_per_token_beside_the_kl():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    lp, ref = torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)
    scores = torch.tensor([2.0, -1.0])
    plain, kl = token_rewards(scores, lp, ref, mask, 0.1)
    rewards, kl2 = token_rewards(scores, lp, ref, mask, 0.1, length_coef=0.01)
    assert torch.equal(kl, kl2) and torch.allclose(rewards, plain - 0.01 * mask)
    returns = (rewards * mask).sum(1)
    assert returns.tolist() == pytest.approx((scores - 0.1 * (kl * mask).sum(1) - 0.01 * mask.sum(1)).tolist())
    assert torch.equal(token_rewards(scores, lp, ref, mask, 0.1, length_coef=0.0)[0], plain)
