"""Scalar heads: one number per position, for values (Critic) and rewards."""

from __future__ import annotations

import math

import torch
from torch import nn


class ScalarHead(nn.Module):
    """Linear H -> 1, squeezed: (..., H) -> (...).

    Init: weight ~ N(0, 1/sqrt(H+1)), bias 0 (as TRL's value head), so the first values are
    O(1) whatever the hidden size and carry no bias toward positive or negative returns.
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.summary.weight, std=1.0 / math.sqrt(hidden_size + 1))
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # the head keeps its own dtype (fp32 by default) even under a bf16 backbone
        return self.summary(hidden.to(self.summary.weight.dtype)).squeeze(-1)


def value_head_for(actor: nn.Module) -> ScalarHead:
    """A fresh value head sized for ``actor`` (the shared-critic case: values from the actor's hidden states)."""
    from quartet.models.loading import hidden_size

    return ScalarHead(hidden_size(actor))
