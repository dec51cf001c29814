"""Position ids of left-padded rows: the one rule every forward over a prompt and its response follows.

`generate` numbers a left-padded row's tokens from its first real token, so every forward that scores the
sampled tokens (training, the reference, the critic, a shared prefix, the frozen trunk) must number them the same
way, or a padded row would see other positions than it was sampled with.
"""

from __future__ import annotations

import torch


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as `generate` uses them; training forwards must match.

    attention_mask: (B, T) with 1 on real tokens -> (B, T) int64, 0 on the left padding."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


__all__ = ["position_ids_from_mask"]
