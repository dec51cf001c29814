"""The Rollout record: what one PPO iteration sampled and everything computed from it.

Tensor legend used throughout Quartet:
    B = batch (sequences), P = prompt length (left-padded), R = response length (right-padded),
    T = P + R, V = vocabulary, H = hidden size.
response_mask is 1.0 on real response tokens, the EOS token included, and 0.0 on the padding after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

import torch

from quartet.algo.positions import position_ids_from_mask  # re-exported: the forwards' positions live in algo


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P)
    response_ids: torch.Tensor  # (B, R) right-padded with pad
    response_mask: torch.Tensor  # (B, R) float
    eos: torch.Tensor  # (B,) bool: the response ended with EOS (not cut at max_new_tokens)
    prompts: list[str] = field(default_factory=list)  # the user's prompt text (what judges read)
    responses: list[str] = field(default_factory=list)  # decoded responses, special tokens stripped
    old_logprobs: torch.Tensor | None = None  # (B, R) actor at sampling time
    ref_logprobs: torch.Tensor | None = None  # (B, R) reference
    values: torch.Tensor | None = None  # (B, R) critic at sampling time
    scores: torch.Tensor | None = None  # (B,) reward model / judge, after normalisation and penalties
    rewards: torch.Tensor | None = None  # (B, R) per-token reward
    kl: torch.Tensor | None = None  # (B, R) per-token KL estimate
    advantages: torch.Tensor | None = None  # (B, R)
    returns: torch.Tensor | None = None  # (B, R)
    engine_logprobs: torch.Tensor | None = None  # (B, R) the sampling engine's own log-prob of each token, 0 on padding
    engine_entropy: torch.Tensor | None = None  # (B, R) the entropy of the engine's distribution at each token
    trunk: torch.Tensor | None = None  # (B, T, H) the actor's frozen bottom layers' output (models/trunk.py)
    # the rows' shared prompt prefix (models/prefix.shared_prefix_length), noted where the ids were on the host
    # before these rows went to a GPU, where reading it from the ids would wait for the queued kernels; None: read
    # from the ids when a forward needs it. Kept by `trimmed` and `to`; `select` and `concat` drop it (other rows).
    prefix_tokens: int | None = None

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:
        """(B, T) prompt and response side by side."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """(B, T) 1 on real prompt and response tokens."""
        return torch.cat([self.prompt_mask, self.response_mask.to(self.prompt_mask.dtype)], dim=1)

    @property
    def lengths(self) -> torch.Tensor:
        """(B,) number of real response tokens."""
        return self.response_mask.sum(dim=1)

    def select(self, index: torch.Tensor | list[int]) -> Rollout:
        """A minibatch: the rows in `index` of every tensor and list."""
        index = torch.as_tensor(index, dtype=torch.long)
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out[f.name] = value[index]
            elif isinstance(value, list) and value:  # an empty list (no texts kept) stays empty
                out[f.name] = [value[i] for i in index.tolist()]
            elif f.name == "prefix_tokens":  # other rows may share more
                out[f.name] = None
            else:
                out[f.name] = value
        return Rollout(**out)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Rollout:
        """The same rollout with every tensor on `device` (itself where they all are already). `non_blocking`: a
        copy from the host to a GPU does not wait for the kernels queued before it (the host's tensors must stay
        unchanged until the copies have run, as these records' do)."""
        device = torch.device(device)
        tensors = {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        if all(t.device == device for t in tensors.values()):
            return self
        return dataclasses.replace(self, **{k: t.to(device, non_blocking=non_blocking) for k, t in tensors.items()})

    def real_span(self) -> tuple[int, int]:
        """(first prompt column that is not padding in every row, number of response columns that are not padding
        in every row): the columns `trimmed` keeps."""
        real = self.prompt_mask.bool().any(0)
        first = int(real.nonzero()[0]) if bool(real.any()) else self.prompt_ids.shape[1] - 1
        last = max(1, int(self.response_mask.sum(1).max())) if len(self) else self.response_ids.shape[1]
        return first, last

    def trimmed(self, span: tuple[int, int] | None = None) -> Rollout:
        """The same rows without the prompt columns that are padding in every row (left) and the response
        columns that are padding in every row (right), so a micro-batch of short answers costs its own length,
        not that of the longest answer in the whole rollout. Positions count real tokens (`position_ids_from_mask`),
        so every real token sees the same context and position as before. (B, R) fields are cut like the
        responses. `span`: the columns to keep, `real_span()` of a larger set of rows that holds these."""
        P, R = self.prompt_ids.shape[1], self.response_ids.shape[1]
        first, last = span if span is not None else self.real_span()
        if first == 0 and last == R:
            return self
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "trunk" and value is not None:  # (B, T, H): the kept prompt and response columns
                value = value[:, first : P + last]
            elif isinstance(value, torch.Tensor) and value.dim() == 2:
                value = value[:, first:] if f.name in ("prompt_ids", "prompt_mask") else value[:, :last]
            out[f.name] = value
        return Rollout(**out)

    def by_length(self, size: int) -> Iterator[tuple[list[int], Rollout]]:
        """Chunks of at most `size` rows in order of length (real prompt and response tokens), each cut to its
        longest row (`trimmed`), with the indices of the rows they hold: forwards over them cost the tokens
        sampled, not the whole rollout's longest prompt and answer in every row."""
        order = torch.argsort(self.prompt_mask.sum(1) + self.response_mask.sum(1), stable=True).tolist()
        for start in range(0, len(self), size):
            rows = order[start : start + size]
            yield rows, self.select(rows).trimmed()


def concat(parts: list[Rollout], pad_id: int) -> Rollout:
    """The rows of several rollouts as one, in order: prompts left-padded and responses right-padded to the widest
    (token ids with `pad_id`, masks and per-token floats with 0), so every real token keeps its position. For
    rollouts before any forward (no `trunk`); a field None in the first part is None in the result."""
    out = {}
    for f in fields(Rollout):
        values = [getattr(p, f.name) for p in parts]
        if values[0] is None or f.name == "prefix_tokens":
            out[f.name] = None
        elif isinstance(values[0], list):
            out[f.name] = [x for v in values for x in v]
        elif values[0].dim() == 1:
            out[f.name] = torch.cat(values)
        elif values[0].dim() == 2:
            width, left = max(v.shape[1] for v in values), f.name.startswith("prompt_")
            fill = pad_id if f.name.endswith("_ids") else 0
            out[f.name] = torch.cat([torch.nn.functional.pad(v, (width - v.shape[1], 0) if left else
                                                             (0, width - v.shape[1]), value=fill) for v in values])
        else:
            raise ValueError(f"concat: field {f.name} of {values[0].dim()} dimensions cannot be joined")
    return Rollout(**out)


def response_mask_from_ids(response_ids: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of real tokens up to and including the first EOS, and whether each row has one.

    response_ids: (B, R) -> (mask (B, R) float, eos (B,) bool).
    """
    is_eos = response_ids == eos_id
    # tokens strictly after the first EOS are padding
    after_eos = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
    return (~after_eos).float(), is_eos.any(dim=1)


__all__ = ["Rollout", "concat", "position_ids_from_mask", "response_mask_from_ids"]
