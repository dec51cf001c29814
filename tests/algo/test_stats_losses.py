"""Masked statistics, loss aggregation invariances, value loss, log-probs, KL controllers."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quartet.algo import (
    AdaptiveKL,
    FixedKL,
    aggregate,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    gather_logprobs,
    logprobs_and_entropy,
    masked_mean,
    masked_var,
    masked_whiten,
)


def ragged(seed, B=6, R=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, R + 1, (B,), generator=g)
    mask = (torch.arange(R).unsqueeze(0) < lengths.unsqueeze(1)).double()
    return g, mask


@pytest.mark.parametrize("seed", range(10))
def test_masked_mean_var_match_selected_elements(seed):
    g, mask = ragged(seed)
    x = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    sel = x[mask.bool()]
    assert masked_mean(x, mask).item() == pytest.approx(sel.mean().item())
    assert masked_var(x, mask).item() == pytest.approx(sel.var().item())
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(sel.var(unbiased=False).item())
    row_means = masked_mean(x, mask, dim=1)
    for b in range(x.shape[0]):
        assert row_means[b].item() == pytest.approx(x[b][mask[b].bool()].mean().item())


@pytest.mark.parametrize("seed", range(10))
def test_whitening_mean_zero_std_one_padding_untouched(seed):
    g, mask = ragged(seed)
    x = torch.randn(mask.shape, generator=g, dtype=torch.float64) * 5 + 3
    w = masked_whiten(x, mask)
    assert masked_mean(w, mask).item() == pytest.approx(0.0, abs=1e-9)
    assert masked_var(w, mask).sqrt().item() == pytest.approx(1.0, abs=1e-6)
    assert torch.equal(w[mask == 0], x[mask == 0])
    w2 = masked_whiten(x, mask, shift_mean=False)
    assert masked_mean(w2, mask).item() == pytest.approx(masked_mean(x, mask).item(), abs=1e-9)


def test_masked_mean_of_empty_mask_is_an_error():
    with pytest.raises(ValueError, match="selects no element"):
        masked_mean(torch.ones(2, 2), torch.zeros(2, 2))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), split=st.integers(1, 5))
def test_token_mean_over_two_shards_equals_global(seed, split):
    g, mask = ragged(seed, B=6)
    lp = torch.randn(mask.shape, generator=g, dtype=torch.float64) * 0.1
    old = lp + torch.randn(mask.shape, generator=g, dtype=torch.float64) * 0.1
    adv = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    whole, _ = clipped_policy_loss(lp, old, adv, mask, 0.2)
    parts = []
    for sl in (slice(0, split), slice(split, None)):
        loss, _ = clipped_policy_loss(lp[sl], old[sl], adv[sl], mask[sl], 0.2)
        parts.append((loss, mask[sl].sum()))
    recombined = sum(loss * n for loss, n in parts) / mask.sum()
    assert recombined.item() == pytest.approx(whole.item(), abs=1e-12)


def test_seq_mean_token_mean_weights_sequences_equally():
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    zeros = torch.zeros(2, 4)
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-3.0, 0.0, 0.0, 0.0]])
    tok, _ = clipped_policy_loss(zeros, zeros, adv, mask, 0.2, "token-mean")
    seq, _ = clipped_policy_loss(zeros, zeros, adv, mask, 0.2, "seq-mean-token-mean")
    assert tok.item() == pytest.approx(-(4 - 3) / 5)
    assert seq.item() == pytest.approx(-(1 + -3) / 2)


def test_value_loss_clipped_and_plain():
    mask = torch.ones(1, 2)
    values = torch.tensor([[1.0, 0.0]])
    old = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[1.0, 2.0]])
    plain, _ = clipped_value_loss(values, old, returns, mask, None)
    assert plain.item() == pytest.approx(0.5 * (0 + 4) / 2)
    # token 0: v moved 1.0 but clip 0.2 -> clipped value 0.2, (0.2 - 1)^2 = 0.64 > 0 -> 0.64 is used
    clipped, stats = clipped_value_loss(values, old, returns, mask, 0.2)
    assert clipped.item() == pytest.approx(0.5 * (0.64 + 4) / 2)
    assert stats["value/clipfrac"].item() == pytest.approx(0.5)


def test_explained_variance_perfect_and_mean_predictor():
    mask = torch.ones(1, 4)
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    _, perfect = clipped_value_loss(returns, returns, returns, mask, None)
    _, mean_pred = clipped_value_loss(torch.full((1, 4), 2.5), returns, returns, mask, None)
    assert perfect["value/explained_variance"].item() == pytest.approx(1.0)
    assert mean_pred["value/explained_variance"].item() == pytest.approx(0.0, abs=1e-6)
    # returns that do not vary explain nothing: 0, not a division by zero; the padding is not counted
    flat = torch.tensor([[2.0, 2.0, 2.0, 9.0]])
    _, const = clipped_value_loss(torch.tensor([[1.0, 3.0, 2.0, 0.0]]), flat, flat, torch.tensor([[1.0, 1, 1, 0]]), None)
    assert const["value/explained_variance"].item() == 0.0
    # hand-worked: Var[R] = 1.25, R - V = (0.5, -0.5, 0.5, -0.5) has Var 0.25 -> 1 - 0.25 / 1.25 = 0.8
    _, some = clipped_value_loss(returns - torch.tensor([[0.5, -0.5, 0.5, -0.5]]), returns, returns, mask, None)
    assert some["value/explained_variance"].item() == pytest.approx(0.8)


def test_the_unbiased_variance_of_one_element_is_left_uncorrected():
    """n / (n - 1) only where n > 1 (chosen on the tensor's device, no value read back): one element's variance is 0."""
    x = torch.tensor([[3.0, 5.0, 7.0]])
    assert masked_var(x, torch.tensor([[1.0, 0.0, 0.0]])).item() == 0.0
    assert masked_var(x, torch.tensor([[1.0, 1.0, 0.0]])).item() == pytest.approx(2.0)  # (1 + 1) / (2 - 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_logprobs_and_entropy_match_full_log_softmax(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 3, 50, generator=g) * 3).to(dtype)
    tokens = torch.randint(0, 50, (5, 3), generator=g)
    full = torch.log_softmax(logits.float(), dim=-1)
    want = full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(gather_logprobs(logits, tokens, chunk_rows=2), want, atol=1e-5)
    ent = -(full.exp() * full).sum(-1)
    assert torch.allclose(entropy_from_logits(logits, chunk_rows=2), ent, atol=1e-4)
    assert gather_logprobs(logits, tokens).dtype == torch.float32


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_logprobs_and_entropy_in_one_pass_match_log_softmax_and_its_gradients(temperature, entropy_grad):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(5, 3, 50, generator=g) * 3).bfloat16()
    tokens = torch.randint(0, 50, (5, 3), generator=g)
    weights = torch.randn(5, 3, generator=g)

    def naive(x):
        full = torch.log_softmax(x.float() / temperature, dim=-1)
        return full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), -(full.exp() * full).sum(-1)

    x = logits.clone().requires_grad_()
    want_lp, want_ent = naive(x)
    ((want_lp + (want_ent if entropy_grad else 0)) * weights).sum().backward()
    y = logits.clone().requires_grad_()
    lp, ent = logprobs_and_entropy(y, tokens, temperature, entropy_grad=entropy_grad, chunk_rows=2)
    assert lp.dtype == ent.dtype == torch.float32
    assert ent.requires_grad == entropy_grad
    torch.testing.assert_close(lp, want_lp.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, want_ent.detach(), atol=1e-4, rtol=0)
    ((lp + (ent if entropy_grad else 0)) * weights).sum().backward()
    torch.testing.assert_close(y.grad.float(), x.grad.float(), atol=1e-2, rtol=1e-2)
    lp0, ent0 = logprobs_and_entropy(logits[:0], tokens[:0])
    assert lp0.shape == ent0.shape == (0, 3)


def test_adaptive_kl_direction_and_sign():
    ctl = AdaptiveKL(0.1, target=6.0, horizon=10_000)
    ctl.update(12.0, n_steps=256)  # KL above target -> beta grows (error clipped at +0.2)
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10_000))
    before = ctl.value
    ctl.update(3.0, n_steps=256)  # below target -> shrinks
    assert ctl.value < before
    on_target = ctl.value
    ctl.update(6.0, n_steps=256)  # on target -> unchanged
    assert ctl.value == on_target
    for _ in range(500):
        ctl.update(0.0, n_steps=50_000)  # an extreme step cannot push beta below zero
        assert ctl.value > 0
    fixed = FixedKL(0.05)
    assert fixed.update(100.0, 10) == 0.05
    state = ctl.state_dict()
    other = AdaptiveKL(1.0, 6.0, 10_000)
    other.load_state_dict(state)
    assert other.value == ctl.value


# ---------------------------------------------------------------------------- Dr.GRPO aggregation, GSPO ratio
def test_seq_mean_token_sum_norm_divides_by_a_constant():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # (6 / 10 + 4 / 10) / 2: each sequence's sum over the fixed budget, not over its own length
    assert aggregate(per_token, mask, "seq-mean-token-sum-norm", norm_len=10).item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(per_token, mask, "seq-mean-token-sum-norm")


def test_sequence_ratio_is_the_length_normalised_gspo_ratio():
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.3, -0.1, 0.4], [0.5, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]])
    loss, stats = clipped_policy_loss(new, old, adv, mask, clip=1.0, ratio_level="sequence")
    s = [math.exp((0.3 - 0.1 + 0.4) / 3), math.exp(0.5)]  # padding does not enter the sequence ratio
    want = (-(s[0] * 1.0) * 3 + s[1] * 1.0) / 4
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert stats["policy/ratio"].item() == pytest.approx((3 * s[0] + s[1]) / 4, rel=1e-6)
    # every token of a sequence gets the gradient of the shared ratio
    new.requires_grad_(True)
    loss, _ = clipped_policy_loss(new, old, adv, mask, clip=1.0, ratio_level="sequence")
    loss.backward()
    assert new.grad[0].tolist() == pytest.approx([-s[0] * 3 / 3 / 4] * 3, rel=1e-5)
    assert new.grad[1, 1:].tolist() == [0.0, 0.0]
