"""Inverse transform sampling in two levels (blocks, then tokens) against the one-level reference."""

from __future__ import annotations

import torch

from quartet.algo import inverse_cdf


def _reference(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The slow definition: the first index whose cumulative weight exceeds u * total."""
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)


def test_two_level_inverse_cdf_picks_the_reference_index():
    """The reference's index, except where rounding moves the target across a token's edge: the block sums are
    float32 (256 terms, each partial sum rounded by <= 2^-24 of it, so a block sum is off by < 256 * 2^-24 of the
    row's total, ~1.5e-5: a generous bound, typical errors are ~1e-8), and a draw then takes another token only if
    the mass between the two is within that rounding. The count of such draws is checked too (a few in 10^3 at
    most: u must land where tokens are narrower than the rounding)."""
    g = torch.Generator().manual_seed(0)
    edge = 256 * 2.0**-24
    moved = 0
    for V in (3, 256, 700, 1025, 49152):  # within one block, one, several with a partial last one, SmolLM2's
        rows = 400 if V < 49152 else 64
        probs = torch.rand(rows, V, generator=g) ** 4  # skewed weights, some of them tiny
        probs[:, ::5] = 0.0  # and zero-weight entries in every block
        u = torch.rand(rows, generator=g, dtype=torch.float64)
        got, want = inverse_cdf(probs, u), _reference(probs, u)
        assert bool((probs[torch.arange(rows), got] > 0).all())
        cdf = probs.double().cumsum(-1)
        for i in (got != want).nonzero().squeeze(1).tolist():  # the mass between them is within the rounding
            lo, hi = sorted((int(got[i]), int(want[i])))
            assert float(cdf[i, hi - 1] - cdf[i, lo]) <= 2 * edge * float(cdf[i, -1]), (V, i)
        moved += int((got != want).sum())
    assert moved <= 5


def test_zero_weight_entries_are_never_drawn_even_at_the_edges():
    probs = torch.zeros(4, 600)
    probs[:, 300] = 1.0  # all the mass in one entry of the second block; the last block is empty
    probs[1, 10] = 1e-30  # and a tiny one in the first
    u = torch.tensor([0.0, 0.5, 1.0 - 2**-53, 0.999999], dtype=torch.float64)
    picked = inverse_cdf(probs, u)
    assert picked.tolist()[0] == 300 and picked[2] == 300 and picked[3] == 300
    assert picked[1] in (10, 300)
    assert bool((probs[torch.arange(4), picked] > 0).all())


def test_the_nucleus_keeps_the_most_likely_tokens_whose_mass_reaches_top_p():
    from quartet.algo import nucleus

    probs = torch.tensor([[0.1, 0.6, 0.3]])
    assert (nucleus(probs, 0.5) > 0).tolist() == [[False, True, False]]  # the most likely is always kept
    # inverse CDF: [0, .1) -> 0, [.1, .7) -> 1, [.7, 1) -> 2; top_p .8 keeps tokens 1 and 2 (mass .9), not renormalised
    u = torch.tensor([0.05, 0.5, 0.8], dtype=torch.float64)
    assert inverse_cdf(probs.expand(3, 3), u).tolist() == [0, 1, 2]
    assert inverse_cdf(nucleus(probs.expand(3, 3), 0.8), u).tolist() == [1, 1, 2]
    assert nucleus(probs, 0.8).dtype == torch.float64
