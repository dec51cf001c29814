"""The teacher-forced forward over a rollout: what a model says about the responses it (or another) sampled.

One forward for every reader of sampled tokens: PPO's actor and reference log-probs (trainers/ppo_roles.py,
trainers/experience.py) and `quartet eval`'s KL, so a log-prob means the same thing wherever it is reported.
Positions skip left padding exactly as the engines' decoding did (`position_ids_from_mask`).

Tensor legend (rollout/record.py): B batch, P prompt (left-padded), R response, T = P + R, V vocab, H hidden.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from quartet.algo import logprobs_and_entropy
from quartet.models.prefix import forward_shared_prefix, shared_prefix_length
from quartet.models.trunk import Trunk
from quartet.rollout.record import Rollout, position_ids_from_mask


def shared_prefix(ro: Rollout) -> tuple[int, torch.Tensor] | None:
    """(tokens every row's prompt starts with, each row's left pads) where there are enough to share, else None.
    The length is the one noted on the rollout (`Rollout.prefix_tokens`, counted on the host) where there is one."""
    n = ro.prefix_tokens if ro.prefix_tokens is not None else shared_prefix_length(ro.prompt_ids, ro.prompt_mask)
    return (n, (ro.prompt_mask == 0).sum(1)) if n else None


def noted_prefix(ro: Rollout) -> Rollout:
    """`ro`, its `prefix_tokens` counted from its prompt ids where not noted yet: on the host, before the rows go to a
    GPU (there, reading the count would wait for every kernel queued before it)."""
    if ro.prefix_tokens is None:
        ro.prefix_tokens = shared_prefix_length(ro.prompt_ids, ro.prompt_mask)
    return ro


def response_logits(
    model: nn.Module, ro: Rollout, *, trunk: Trunk | None = None, share_prefix: bool = False, hidden: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`model`'s logits that predict each response token (B, R, V), in the dtype the forward gives them (the
    caller scales and upcasts), and with `hidden` the last hidden states before each response token (B, R, H).

    `trunk`: the frozen bottom layers of `model` (models/trunk.py); where the rollout holds their output
    (`ro.trunk`), only the layers above run. `share_prefix`: the prompt tokens every row starts with run once
    (models/prefix.py; the caller has probed `model` with `prefix.probe`)."""
    ids, mask = ro.input_ids, ro.attention_mask
    P, R = ro.prompt_ids.shape[1], ro.response_ids.shape[1]
    common = dict(attention_mask=mask, position_ids=position_ids_from_mask(mask), logits_to_keep=R + 1,
                  output_hidden_states=hidden)
    inputs = {"input_ids": ids}
    top = contextlib.nullcontext()
    if trunk is not None and ro.trunk is not None:
        inputs, top = {"inputs_embeds": ro.trunk}, trunk.top()
    shared = shared_prefix(ro) if share_prefix else None
    with top:
        out = forward_shared_prefix(model, *shared, **inputs, **common) if shared else \
            model(**inputs, **common, use_cache=False)
    n = shared[0] if shared else 0  # the output's columns start after the shared prefix
    states = out.hidden_states[-1][:, P - 1 - n : -1] if hidden else None
    return out.logits[:, :-1], states  # logits at t predict token t + 1


def response_logprobs(
    model: nn.Module, ro: Rollout, temperature: float, *, with_entropy_grad: bool = False, hidden: bool = False,
    trunk: Trunk | None = None, share_prefix: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Teacher-forced log-probs of the sampled responses under `model` at `temperature`:
    (logprobs (B, R), entropy (B, R), hidden states before each response token (B, R, H) or None).

    The entropy keeps its graph only when asked (an entropy bonus); otherwise it is a detached statistic.
    `trunk`, `share_prefix`: see `response_logits`."""
    logits, states = response_logits(model, ro, trunk=trunk, share_prefix=share_prefix, hidden=hidden)
    logprobs, entropy = logprobs_and_entropy(logits, ro.response_ids, temperature, entropy_grad=with_entropy_grad)
    return logprobs, entropy, states
