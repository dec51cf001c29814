"""Masked statistics over response tokens, and Wilson's interval for a share.

Shapes follow the tensor legend: x and mask are (B, R); mask is 1.0 on real tokens and 0.0 on padding.
"""

from __future__ import annotations

import math

import torch


def wilson_interval(successes: float, n: float, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson's score interval for a binomial share (default 95%): unlike p +- z sqrt(p(1-p)/n) it stays inside
    [0, 1] and is not empty at 0 or n successes. `n` may be an effective sample size (not a whole number), with
    `successes` the share times it. (nan, nan) for n = 0."""
    if n <= 0:
        return math.nan, math.nan
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(max(p * (1 - p), 0.0) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def check_mask(mask: torch.Tensor) -> None:
    """Reject rows with no real token: every statistic over them is undefined."""
    if mask.dim() != 2:
        raise ValueError(f"response mask must be (B, R), got shape {tuple(mask.shape)}")
    empty = (mask.sum(dim=1) <= 0).nonzero().flatten()
    if empty.numel():
        raise ValueError(f"response mask row {empty[0].item()} has no real tokens (all padding)")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over positions where mask is 1: sum(x * mask) / sum(mask) (over `dim` or everything)."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    if dim is None:
        if count.device.type == "cpu":
            if count.item() <= 0:
                raise ValueError("masked_mean: the mask selects no element")
        else:  # checked on the device: reading the count here would wait for every kernel queued before it
            torch._assert_async(count > 0, "masked_mean: the mask selects no element")
    return masked_sum(x, mask, dim) / count.clamp(min=1e-8)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over masked positions; Bessel-corrected n/(n-1) when `unbiased` and n > 1."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:  # chosen on the device (a branch on n would read it back and wait for the queue)
        n = mask.sum()
        var = torch.where(n > 1, var * n / (n - 1).clamp(min=1), var)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over masked positions; padding positions are returned unchanged.

    With shift_mean=False the mean is added back (only the scale is normalised), as TRL does for rewards.
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, x)


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of the last real token of each row of a right-padded (B, R) mask."""
    check_mask(mask)
    R = mask.shape[1]
    return R - 1 - mask.flip(dims=[1]).to(torch.int64).argmax(dim=1)
