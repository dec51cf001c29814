"""Scalar heads: one number per position, for values (Critic) and rewards."""

from __future__ import annotations

import math

import torch
from torch import nn

from quartet.models.loading import hidden_size


class ScalarHead(nn.Module):
    """Linear H -> 1, squeezed: (..., H) -> (...).

    Init "normal": weight ~ N(0, 1/sqrt(H+1)), bias 0 (as TRL's value head): outputs differ between
    inputs from the start, which a reward head trained by a pairwise loss needs.
    Init "zero": every output starts at 0. A value head learned from scratch uses it: LM hidden states
    have norms of ~40 (SmolLM2), so a random head's first values have a spread of ~2 that is pure
    noise, and Adam, moving each weight by at most lr per step, needs hundreds of steps to unlearn it
    (explained variance stays negative for a whole short run). From zero, values are the mean (explained
    variance 0) and only improve; the weight still gets gradients, hidden * error.
    """

    def __init__(self, hidden_size: int, init: str = "normal"):
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1)
        if init == "zero":
            nn.init.zeros_(self.summary.weight)
        elif init == "normal":
            nn.init.normal_(self.summary.weight, std=1.0 / math.sqrt(hidden_size + 1))
        else:
            raise ValueError(f"ScalarHead init must be 'normal' or 'zero', got {init!r}")
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # the head keeps its own dtype (fp32 by default) even under a bf16 backbone
        return self.summary(hidden.to(self.summary.weight.dtype)).squeeze(-1)


def value_head_for(actor: nn.Module) -> ScalarHead:
    """A fresh value head sized for ``actor`` (the shared-critic case: values from the actor's hidden
    states), starting at zero (see ScalarHead)."""
    return ScalarHead(hidden_size(actor), init="zero")
