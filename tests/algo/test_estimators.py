"""Advantage estimators of the policy-gradient family against independent slow loops (float64, ragged
batches, many seeds), their edge cases, and the registry the trainer picks from."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from quartet.algo import (
    ESTIMATORS,
    gae,
    get_estimator,
    group_advantages,
    reinforce_pp_advantages,
    remax_advantages,
    returns_to_go,
)


def ragged(seed: int, groups: int = 3, group_size: int = 4, R: int = 7):
    g = torch.Generator().manual_seed(seed)
    B = groups * group_size
    lengths = torch.randint(1, R + 1, (B,), generator=g)
    mask = (torch.arange(R)[None, :] < lengths[:, None]).double()
    rewards = torch.randn(B, R, generator=g, dtype=torch.float64) * mask
    return rewards, mask, lengths.tolist()


def slow_group(scores: list[float], G: int, kind: str, eps: float = 1e-6) -> list[float]:
    out = []
    for start in range(0, len(scores), G):
        grp = scores[start : start + G]
        mean = sum(grp) / G
        for r in grp:
            if all(x == grp[0] for x in grp):
                out.append(0.0)
            elif kind == "grpo":
                out.append((r - mean) / (statistics.stdev(grp) + eps))
            elif kind == "dr_grpo":
                out.append(r - mean)
            else:
                out.append(r - (sum(grp) - r) / (G - 1))
    return out


def slow_rtg(row: list[float], n: int, gamma: float) -> list[float]:
    out = [0.0] * len(row)
    running = 0.0
    for t in reversed(range(n)):
        running = row[t] + gamma * running
        out[t] = running
    return out


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
def test_group_advantages_equal_the_slow_loop(seed, kind):
    g = torch.Generator().manual_seed(seed)
    G = 2 + seed % 4
    scores = torch.randn(5 * G, generator=g, dtype=torch.float64)
    scores[:G] = 0.7  # one group of equal scores
    got = group_advantages(scores, G, kind)
    want = slow_group(scores.tolist(), G, kind)
    assert got.tolist() == pytest.approx(want, abs=1e-12)


def test_group_edge_cases():
    same = torch.full((8,), 3.0)
    for kind in ("grpo", "dr_grpo", "rloo"):
        adv = group_advantages(same, 4, kind)
        assert torch.equal(adv, torch.zeros(8)), kind
    # RLOO's leave-one-out baseline = G / (G - 1) times the mean-baseline advantage
    s = torch.tensor([1.0, 2.0, 4.0, 9.0], dtype=torch.float64)
    assert group_advantages(s, 4, "rloo").tolist() == pytest.approx((4 / 3 * (s - s.mean())).tolist())
    # GRPO uses the unbiased std: a group of two [0, 1] has std 1/sqrt(2)
    assert group_advantages(torch.tensor([0.0, 1.0]), 2, "grpo", eps=0.0).tolist() == pytest.approx(
        [-math.sqrt(0.5), math.sqrt(0.5)])
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(8), 3, "grpo")
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(torch.zeros(4), 1, "rloo")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_returns_to_go_equal_the_slow_loop(seed, gamma):
    rewards, mask, lengths = ragged(seed)
    got = returns_to_go(rewards, mask, gamma)
    for b, n in enumerate(lengths):
        assert got[b].tolist() == pytest.approx(slow_rtg(rewards[b].tolist(), n, gamma) , abs=1e-12)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_equals_the_slow_loop(seed, baseline):
    G = 4
    rewards, mask, lengths = ragged(seed, group_size=G)
    gamma = 0.95
    rows = [slow_rtg(rewards[b].tolist(), n, gamma) for b, n in enumerate(lengths)]
    if baseline:
        seq = [sum(rewards[b, :n].tolist()) for b, n in enumerate(lengths)]
        for b, n in enumerate(lengths):
            grp = seq[(b // G) * G : (b // G + 1) * G]
            rows[b] = [x - sum(grp) / G for x in rows[b][:n]] + [0.0] * (len(rows[b]) - n)
    real = [rows[b][t] for b, n in enumerate(lengths) for t in range(n)]
    mean, var = statistics.fmean(real), statistics.variance(real)
    want = [[(rows[b][t] - mean) / math.sqrt(var + 1e-8) if t < n else 0.0 for t in range(len(rows[b]))]
            for b, n in enumerate(lengths)]
    got = reinforce_pp_advantages(rewards, mask, gamma, G if baseline else None)
    assert got.tolist() == [pytest.approx(w, abs=1e-9) for w in want]


@pytest.mark.parametrize("seed", range(4))
def test_remax_equals_the_slow_loop(seed):
    rewards, mask, lengths = ragged(seed)
    greedy = torch.randn(len(lengths), generator=torch.Generator().manual_seed(100 + seed), dtype=torch.float64)
    got = remax_advantages(rewards, mask, greedy)
    for b, n in enumerate(lengths):
        rtg = slow_rtg(rewards[b].tolist(), n, 1.0)
        want = [rtg[t] - greedy[b].item() if t < n else 0.0 for t in range(rewards.shape[1])]
        assert got[b].tolist() == pytest.approx(want, abs=1e-12)


def test_registry_routes_each_name_to_its_estimator():
    rewards, mask, lengths = ragged(3, group_size=4)
    values = torch.randn_like(rewards) * mask
    assert set(ESTIMATORS) == {"gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax"}
    adv, ret = get_estimator("gae")(rewards, mask, values=values, gamma=1.0, lam=0.95)
    want_adv, want_ret = gae(rewards, values, mask, 1.0, 0.95)
    assert torch.equal(adv, want_adv) and torch.equal(ret, want_ret)
    seq = (rewards * mask).sum(1)
    for kind in ("grpo", "dr_grpo", "rloo"):
        adv, ret = get_estimator(kind)(rewards, mask, group_size=4)
        # one advantage per sequence, on each of its real tokens
        assert torch.allclose(adv, group_advantages(seq, 4, kind)[:, None] * mask)
        assert torch.allclose(ret, seq[:, None] * mask)
    with pytest.raises(ValueError, match="critic"):
        get_estimator("gae")(rewards, mask)
    with pytest.raises(ValueError, match="greedy"):
        get_estimator("remax")(rewards, mask)
    with pytest.raises(ValueError, match="unknown advantage"):
        get_estimator("ppo2")
    needs = {name for name, e in ESTIMATORS.items() if e.needs_critic}
    assert needs == {"gae"}
