"""Score shaping by answer length: DAPO's soft overlong punishment.

An answer cut at the generation limit is usually unfinished, and a plain judge scores its fragment as if it
were an answer; a hard penalty at the limit punishes a good long answer as much as a rambling one. DAPO (Yu
et al. 2025, eq. 13) ramps the penalty up over a buffer before the limit instead.
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, coef: float = 1.0) -> torch.Tensor:
    """(B,) response lengths -> (B,) penalties <= 0 to add to the scores (DAPO's R_length times `coef`):

        0                                         length <= max_len - buffer
        -coef * (length - (max_len - buffer)) / buffer   max_len - buffer < length <= max_len

    so an answer that reaches the limit loses `coef`, one a token inside the buffer coef / buffer. Lengths count
    the EOS token, as the generation limit does."""
    if buffer < 1 or buffer > max_len:
        raise ValueError(f"overlong buffer must be in [1, max_len={max_len}], got {buffer}")
    over = (lengths.to(torch.float32) - (max_len - buffer)).clamp(min=0.0)
    return -coef * over / buffer
