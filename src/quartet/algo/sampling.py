"""Drawing tokens from categorical distributions by inverse transform sampling.

A token is the first index whose cumulative probability exceeds u * total, u uniform in [0, 1): one random
number per draw, so each row can take it from its own generator. The cumulative sum is taken in two levels,
over blocks of `BLOCK` tokens and then within the chosen block, because a cumulative sum over a whole
vocabulary (49k for SmolLM2) is a serial scan on CPU: 44 ms for 64 rows in float64, most of a decoding step.
"""

from __future__ import annotations

import torch

BLOCK = 256


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(b, V) non-negative weights (need not sum to 1), (b,) uniforms in [0, 1) -> (b,) int64 indices.

    Index i is drawn with probability probs[i] / sum(probs); an index of weight 0 is never drawn, whatever the
    rounding."""
    b, V = probs.shape
    blocks = torch.nn.functional.pad(probs, (0, -V % BLOCK)).view(b, -1, BLOCK)  # (b, n, BLOCK)
    block_cdf = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # (b, n)
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
