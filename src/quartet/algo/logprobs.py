"""Token log-probabilities and entropy from logits without a full float32 log-softmax copy.

The vocabulary is large (49k for SmolLM2), so (B, R, V) float32 tensors dominate memory. Both functions
work row-chunk by row-chunk and use logsumexp, so at most `chunk_rows` rows are upcast at a time.
"""

from __future__ import annotations

import torch


def gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor, chunk_rows: int = 4) -> torch.Tensor:
    """log pi(token) = logit[token] - logsumexp(logits).

    logits: (B, R, V) (any float dtype; computed in float32), tokens: (B, R) int64 -> (B, R) float32.
    """
    out = []
    for lg, tk in zip(logits.split(chunk_rows), tokens.split(chunk_rows)):
        lg = lg.float()
        picked = lg.gather(-1, tk.unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(lg, dim=-1))
    return torch.cat(out) if out else logits.new_zeros(tokens.shape, dtype=torch.float32)


def entropy_from_logits(logits: torch.Tensor, chunk_rows: int = 4) -> torch.Tensor:
    """Entropy H = logsumexp(l) - sum softmax(l) * l of each categorical; (B, R, V) -> (B, R) float32."""
    out = []
    for lg in logits.split(chunk_rows):
        lg = lg.float()
        out.append(torch.logsumexp(lg, dim=-1) - (torch.softmax(lg, dim=-1) * lg).sum(dim=-1))
    return torch.cat(out) if out else logits.new_zeros(logits.shape[:-1], dtype=torch.float32)


def logprobs_and_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, *, entropy_grad: bool = False,
    chunk_rows: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gather_logprobs` and `entropy_from_logits` of `logits / temperature` in one pass: each chunk is upcast,
    scaled and reduced by logsumexp once for both. The entropy keeps its graph only with `entropy_grad` (an
    entropy bonus); otherwise it is a statistic computed without one, in place.

    logits: (B, R, V) any float dtype, tokens: (B, R) int64 -> two (B, R) float32 tensors.
    """
    logps, ents = [], []
    for lg, tk in zip(logits.split(chunk_rows), tokens.split(chunk_rows)):
        lg = lg.float()
        if temperature != 1.0:
            lg = lg / temperature
        lse = torch.logsumexp(lg, dim=-1)
        logps.append(lg.gather(-1, tk.unsqueeze(-1)).squeeze(-1) - lse)
        if entropy_grad:
            ents.append(lse - (torch.softmax(lg, dim=-1) * lg).sum(dim=-1))
        else:
            with torch.no_grad():
                lg, lse = lg.detach(), lse.detach()
                ents.append(lse - (lg - lse.unsqueeze(-1)).exp_().mul_(lg).sum(dim=-1))
    if not logps:
        empty = logits.new_zeros(tokens.shape, dtype=torch.float32)
        return empty, empty.clone()
    return torch.cat(logps), torch.cat(ents)
