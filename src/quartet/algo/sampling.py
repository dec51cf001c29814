"""Drawing tokens from categorical distributions by inverse transform sampling.

A token is the first index whose cumulative probability exceeds u * total, u uniform in [0, 1): one random
number per draw, so each row can take it from its own generator. The cumulative sum is taken in two levels,
over blocks of `BLOCK` tokens and then within the chosen block, because a cumulative sum over a whole
vocabulary (49k for SmolLM2) is a serial scan on CPU: 44 ms for 64 rows in float64, most of a decoding step.

A block's sum is taken in the weights' dtype (float32 for the sampler's softmax) and the sums are accumulated in
float64: a float64 sum of float32 values runs unvectorised on CPU (49 ms for 384 rows of SmolLM2's vocabulary,
against 1.4 ms in float32). Summing 256 float32 values moves the cumulative sum by ~1e-8 of the total, so a draw
differs from the one-level float64 definition only where tokens narrower than that lie at u (the test bounds
the mass between the two); within the chosen block the cumulative sum is float64, and a target past the block's
float64 total takes its last token of weight > 0, so a weight 0 is still never drawn.

Inverse transform sampling is exact but not smooth in the weights: any change to the cumulative sum, however
small, moves the draws of the u that fall among tokens narrower than the change. A vocabulary's long tail is such
a place (thousands of tokens under 1e-6 each at temperature 1), so weights that differ by rounding (another
attention kernel, another batch shape) draw another token there now and then: SmolLM2 in float32 at T 1, logits
within ~1e-5 of each other, took another token in ~1 of 600 draws, each time from the tail.
"""

from __future__ import annotations

import torch

BLOCK = 256


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(b, V) non-negative weights (need not sum to 1), (b,) uniforms in [0, 1) -> (b,) int64 indices.

    Index i is drawn with probability probs[i] / sum(probs); an index of weight 0 is never drawn, whatever the
    rounding."""
    b, V = probs.shape
    padded = torch.nn.functional.pad(probs, (0, -V % BLOCK)) if V % BLOCK else probs
    blocks = padded.view(b, -1, BLOCK)  # (b, n, BLOCK)
    block_cdf = blocks.sum(-1).double().cumsum(-1)  # (b, n): each block's sum in the weights' own dtype
    target = u.double() * block_cdf[:, -1]
    block = _first_above(block_cdf, target)
    rows = torch.arange(b)
    target = target - torch.where(block > 0, block_cdf[rows, (block - 1).clamp(min=0)], 0.0)
    return block * BLOCK + _first_above(blocks[rows, block].cumsum(-1, dtype=torch.float64), target)


def _first_above(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(b,) the first index of each non-decreasing row of `cdf` (b, n) whose value exceeds `target` (b,), never
    past the row's last increase (rounding may put the target at or above the total)."""
    index = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    last = (cdf < cdf[:, -1:]).sum(-1)  # the entry where the row reaches its total
    return torch.minimum(index, last)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """(b, V) probabilities -> float64 weights for `inverse_cdf`: only the smallest set of most likely tokens whose
    mass reaches `top_p` keeps its probability (Holtzman et al. 2020), every other token 0; not renormalised
    (`inverse_cdf` draws in proportion). Taken on the probabilities in float64, where transformers' TopPLogitsWarper
    cuts the logits by a float32 cumulative sum: a token at the edge of the nucleus can fall on either side of
    the two cuts, so the two draw the same tokens except there."""
    probs = probs.double()
    sorted_p, order = probs.sort(dim=-1, descending=True)
    # keep a token if the mass before it is still short of top_p (the most likely is always kept)
    drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p
    return probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
