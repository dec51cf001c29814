"""Inverse transform sampling in two levels (blocks, then tokens) against the one-level reference."""

from __future__ import annotations

import torch

from quartet.algo import inverse_cdf


def _reference(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The slow definition: the first index whose cumulative weight exceeds u * total."""
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)


def test_two_level_inverse_cdf_picks_the_reference_index():
    g = torch.Generator().manual_seed(0)
    for V in (3, 256, 700, 1025):  # within one block, exactly one, several with a partial last one
        probs = torch.rand(400, V, generator=g) ** 4  # skewed weights
        probs[:, ::5] = 0.0  # and zero-weight entries in every block
        u = torch.rand(400, generator=g, dtype=torch.float64)
        assert torch.equal(inverse_cdf(probs, u), _reference(probs, u))


def test_zero_weight_entries_are_never_drawn_even_at_the_edges():
    probs = torch.zeros(4, 600)
    probs[:, 300] = 1.0  # all the mass in one entry of the second block; the last block is empty
    probs[1, 10] = 1e-30  # and a tiny one in the first
    u = torch.tensor([0.0, 0.5, 1.0 - 2**-53, 0.999999], dtype=torch.float64)
    picked = inverse_cdf(probs, u)
    assert picked.tolist()[0] == 300 and picked[2] == 300 and picked[3] == 300
    assert picked[1] in (10, 300)
    assert bool((probs[torch.arange(4), picked] > 0).all())
