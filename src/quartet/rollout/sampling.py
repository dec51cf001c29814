"""What every generation engine shares: each sample's seed, and the Rollout its response ids become.

A sample's seed is a hash of the run's seed and the sample's indices (`sample_seed`), so a sample depends on
those alone: not on which other prompts share its batch or its process, nor on which engine draws it.
"""

from __future__ import annotations

import hashlib

import torch

from quartet.rollout.record import Rollout, response_mask_from_ids

SAMPLE_STREAM = "sample"
"""the engines' samples: `sample_seed(seed, index)`, index the global sample number of a generate call"""
EVAL_STREAM = "eval"
"""`quartet eval`'s samples: `sample_seed(seed, prompt_index, sample_index, stream=EVAL_STREAM)`"""


def sample_seed(seed: int, *indices: int, stream: str = SAMPLE_STREAM) -> int:
    """The seed of one sample: a hash of `stream`, `seed` and the sample's `indices`, so nearby seeds and
    indices give unrelated random streams, and two streams never share a seed by construction."""
    key = "/".join(str(i) for i in (seed, *indices))
    digest = hashlib.blake2b(f"quartet-{stream}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def row_seeds(seed: int | None, sample_offset: int, rows: int, seeds: list[int] | None) -> list[int]:
    """Each output row's seed: `seeds` when given (one per row), else `sample_seed(seed, sample_offset + j)`."""
    if seeds is not None:
        if len(seeds) != rows:
            raise ValueError(f"generate: {len(seeds)} seeds for {rows} output rows")
        return list(seeds)
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    return [sample_seed(seed, sample_offset + j) for j in range(rows)]


def make_rollout(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor, tokenizer,
                 num_samples: int, lengths: torch.Tensor | None = None) -> Rollout:
    """The Rollout of an engine's right-padded (B, R) `response_ids` for `num_samples` per prompt row: real
    tokens up to and including the first EOS (and within `lengths`, when the engine reports them), padding
    set to pad, responses decoded without special tokens. Every engine ends its `generate` here."""
    pad = tokenizer.pad_token_id
    response_mask, eos = response_mask_from_ids(response_ids, tokenizer.eos_token_id)
    if lengths is not None:
        response_mask = response_mask * (torch.arange(response_ids.shape[1]) < lengths[:, None])
    response_ids = response_ids.masked_fill(response_mask == 0, pad)
    responses = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    return Rollout(
        prompt_ids=prompt_ids.repeat_interleave(num_samples, 0),
        prompt_mask=prompt_mask.repeat_interleave(num_samples, 0),
        response_ids=response_ids,
        response_mask=response_mask,
        eos=eos,
        responses=[r.strip() for r in responses],
    )
