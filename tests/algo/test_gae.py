"""GAE and REINFORCE against slow per-row loops and closed forms."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quartet.algo import gae, reinforce_advantages


def slow_gae(rewards, values, length, gamma, lam):
    """One row, one token at a time, straight from the definition."""
    adv = [0.0] * len(rewards)
    running = 0.0
    for t in reversed(range(length)):
        next_v = values[t + 1] if t + 1 < length else 0.0
        delta = rewards[t] + gamma * next_v - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
    ret = [adv[t] + values[t] if t < length else 0.0 for t in range(len(rewards))]
    return adv, ret


def random_batch(seed, B=5, R=9):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, R + 1, (B,), generator=g)
    mask = (torch.arange(R).unsqueeze(0) < lengths.unsqueeze(1)).double()
    rewards = torch.randn(B, R, generator=g, dtype=torch.float64) * mask
    values = torch.randn(B, R, generator=g, dtype=torch.float64)  # garbage on padding on purpose
    return rewards, values, mask, lengths


@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.99, 0.9), (0.5, 0.0), (1.0, 1.0)])
def test_gae_matches_slow_loop(seed, gamma, lam):
    rewards, values, mask, lengths = random_batch(seed)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for b in range(rewards.shape[0]):
        want_adv, want_ret = slow_gae(rewards[b].tolist(), values[b].tolist(), int(lengths[b]), gamma, lam)
        assert adv[b].tolist() == pytest.approx(want_adv, abs=1e-12)
        assert ret[b].tolist() == pytest.approx(want_ret, abs=1e-12)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_lambda_zero_is_one_step_td_error():
    rewards, values, mask, _ = random_batch(1)
    adv, _ = gae(rewards, values, mask, gamma=0.9, lam=0.0)
    v = values * mask
    next_v = torch.cat([v[:, 1:], torch.zeros(v.shape[0], 1, dtype=v.dtype)], dim=1)
    assert torch.allclose(adv, (rewards + 0.9 * next_v - v) * mask)


def test_gamma_lambda_one_is_monte_carlo_return_minus_value():
    rewards, values, mask, _ = random_batch(2)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    reward_to_go = rewards.flip(1).cumsum(1).flip(1) * mask
    assert torch.allclose(adv, (reward_to_go - values) * mask)
    assert torch.allclose(ret, reward_to_go)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=5),
    pad=st.integers(min_value=0, max_value=3),
    gamma=st.floats(min_value=0.0, max_value=1.0),
    lam=st.floats(min_value=0.0, max_value=1.0),
)
def test_gae_property_variable_lengths(lengths, pad, gamma, lam):
    R = max(lengths) + pad  # rows with nothing after EOS, length-1 rows, extra padding
    lengths_t = torch.tensor(lengths)
    mask = (torch.arange(R).unsqueeze(0) < lengths_t.unsqueeze(1)).double()
    g = torch.Generator().manual_seed(len(lengths) * 7 + R)
    rewards = torch.randn(len(lengths), R, generator=g, dtype=torch.float64) * mask
    values = torch.randn(len(lengths), R, generator=g, dtype=torch.float64)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for b, n in enumerate(lengths):
        want, _ = slow_gae(rewards[b].tolist(), values[b].tolist(), n, gamma, lam)
        assert adv[b].tolist() == pytest.approx(want, abs=1e-9)
    assert torch.isfinite(adv).all() and (ret[mask == 0] == 0).all()


def test_all_padding_row_rejected():
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match="row 1 has no real tokens"):
        gae(torch.zeros(2, 2), torch.zeros(2, 2), mask, 1.0, 0.95)
    with pytest.raises(ValueError, match="row 1 has no real tokens"):
        reinforce_advantages(torch.zeros(2, 2), mask)


def test_reinforce_broadcasts_sequence_return():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    rewards = torch.tensor([[-0.1, -0.1, 1.0], [0.5, 0.0, 0.0]])
    adv, ret = reinforce_advantages(rewards, mask)
    assert torch.allclose(adv, torch.tensor([[0.8, 0.8, 0.8], [0.5, 0.0, 0.0]]))
    assert torch.allclose(ret, adv)
    adv_b, _ = reinforce_advantages(rewards, mask, baseline=torch.tensor([0.3, 0.5]))
    assert torch.allclose(adv_b, torch.tensor([[0.5, 0.5, 0.5], [0.0, 0.0, 0.0]]))


def test_token_level_vs_sequence_level_credit():
    # with a perfect critic, GAE(1, 1) gives late tokens the reward-to-go while REINFORCE gives all the total
    mask = torch.ones(1, 3)
    rewards = torch.tensor([[-0.1, -0.1, 1.0]])
    adv_tok, _ = gae(rewards, torch.zeros(1, 3), mask, 1.0, 1.0)
    adv_seq, _ = reinforce_advantages(rewards, mask)
    assert torch.allclose(adv_tok, torch.tensor([[0.8, 0.9, 1.0]]))
    assert torch.allclose(adv_seq, torch.tensor([[0.8, 0.8, 0.8]]))
