"""A prompt prefix every row shares (a chat template's system prompt), computed once per forward.

Chat prompts start with the same tokens: SmolLM2's template puts its 24-token system prompt before every user
turn, a quarter of the 96 tokens of issue 14's workload. A causal model's states at those positions do not
depend on the rest of the row, so `forward_shared_prefix` runs them for one row, keeps their keys and values
(transformers' KV cache, with their autograd graph), and runs every row's other tokens on top of that cache.
The gradient is the same: the prefix's keys and values are used by every row, so their gradient is the sum
over the rows, which autograd forms through the broadcast. SmolLM2, fp32, 16 x 96 tokens: the actor's forward
and backward 8.1-10.5 -> 5.7-6.3 s, log-probs equal bit for bit, gradients within 2e-6 (relative).

Layout. Rollouts are left-padded: row i holds `L_i` pads, then the prefix's `n` tokens, then the rest. The
suffix forward gets each row without its prefix columns, so its `L_i` pads now sit after the cached prefix (masked
out, as before) and every later column keeps its position id. Output column j of the suffix forward is input
column j + n of a row: callers that slice states by column subtract `n`; logits kept from the end are unchanged.

Under activation checkpointing the update's layers run again in the backward: the cache the suffix pass reads is
read-only (each layer joins the prefix's keys and values to its own and stores nothing), so the recompute reads
what the forward read, and the trained roles' layers are told they may keep it (`keep_cache_under_checkpointing`;
transformers otherwise drops the cache inside a checkpointed layer).

Where it is not used (`n` = 0): fewer than `MIN_SHARED_TOKENS` shared tokens or fewer than two rows; and wherever
`probe` finds that the model's forward on the cache does not give its full forward's outputs (an architecture or
transformers version whose cache, mask or checkpointing handling differs): the caller then runs whole rows.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from quartet.algo.positions import position_ids_from_mask
from quartet.models.loading import cache_kwarg, output_cache

log = logging.getLogger(__name__)

MIN_SHARED_TOKENS = 8
"""Below this, the second forward call costs more than the rows' shared tokens save."""


def shared_prefix_length(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> int:
    """Tokens every row's real prompt starts with (`prompt_ids` left-padded, (B, P)), leaving each row at least
    one prompt token of its own (the logits of the first answer token are taken at the prompt's last token);
    0 when that is fewer than `MIN_SHARED_TOKENS` or there is one row."""
    B, P = prompt_ids.shape
    if B < 2:
        return 0
    pads = (prompt_mask == 0).sum(1)
    shortest = int(P - pads.max())
    limit = shortest - 1
    if limit < MIN_SHARED_TOKENS:
        return 0
    # each row's first `limit` real tokens, aligned at its first real column
    cols = pads[:, None] + torch.arange(limit, device=pads.device)[None, :]
    real = prompt_ids.gather(1, cols)
    same = (real == real[:1]).all(0)
    n = int(limit if bool(same.all()) else same.long().argmin())
    return n if n >= MIN_SHARED_TOKENS else 0


def _broadcast(cache, rows: int):
    """`cache` (one row) as a read-only cache of `rows` rows: each layer's keys and values broadcast with their
    graph, and its `update` giving them joined with the new tokens' without storing anything, so a layer run
    again (activation checkpointing's recompute) reads the same prefix. Layers the prefix pass did not run (those
    under a frozen trunk, models/trunk.py) get zeros of the prefix's length, which the suffix pass does not read
    either, so every layer reports the prefix's length to the mask builder."""
    done = [layer for layer in cache.layers if getattr(layer, "is_initialized", False)]
    if not done:
        raise RuntimeError("the prefix pass filled no cache layer")
    like_k, like_v = done[0].keys, done[0].values
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            k, v = layer.keys, layer.values
        else:
            k, v = torch.zeros_like(like_k), torch.zeros_like(like_v)
            layer.lazy_initialization(k, v)
        layer.keys, layer.values = k.expand(rows, *k.shape[1:]), v.expand(rows, *v.shape[1:])
        layer.update = _joined(layer.keys, layer.values)
    return cache


def _joined(keys: torch.Tensor, values: torch.Tensor):
    def update(key_states, value_states, *args, **kwargs):
        return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)

    return update


@contextlib.contextmanager
def _not_checkpointed(model: nn.Module):
    """Activation checkpointing off in `model` for a moment (transformers' per-module `gradient_checkpointing`)."""
    on = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in on:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in on:
            m.gradient_checkpointing = True


def keep_cache_under_checkpointing(model: nn.Module) -> bool:
    """Let `model`'s checkpointed decoder layers keep the cache they are given (transformers drops it unless a
    layer says it only reads it, `_can_checkpoint_with_cache`): true of the read-only prefix cache above, and no
    other cache reaches them with gradients on (generation runs without). False where transformers has no such
    switch, and then the caller runs whole rows."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers 4.x
        return False
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers or not all(hasattr(m, "_can_checkpoint_with_cache") for m in layers):
        return False
    for m in layers:
        m._can_checkpoint_with_cache = True
    return True


def forward_shared_prefix(
    model: nn.Module, n: int, pads: torch.Tensor, *, attention_mask: torch.Tensor, position_ids: torch.Tensor,
    input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None, **kwargs,
):
    """`model`'s output for the rows' columns other than their shared `n`-token prefix (see the module doc):
    (B, T - n, ...) where the full forward gives (B, T, ...). `pads`: (B,) each row's left pads before the prefix.
    `kwargs` go to the suffix pass (logits_to_keep, output_hidden_states, ...)."""
    x, key = (input_ids, "input_ids") if input_ids is not None else (inputs_embeds, "inputs_embeds")
    B, T = attention_mask.shape
    first = int(pads[0])
    with _not_checkpointed(model):  # one row of n tokens: nothing worth recomputing, and a recompute would write
        prefix = model(**{key: x[:1, first : first + n]}, attention_mask=attention_mask[:1, first : first + n],
                       position_ids=position_ids[:1, first : first + n], use_cache=True)
    cache = output_cache(prefix)
    keep = kept_columns(pads.to(attention_mask.device), n, T)
    rest = x[keep].view(B, T - n, *x.shape[2:])
    mask = torch.cat([attention_mask.new_ones(B, n), attention_mask[keep].view(B, T - n)], 1)
    # the cache is given, and read only: nothing to keep from this pass
    return model(**{key: rest}, attention_mask=mask, position_ids=position_ids[keep].view(B, T - n),
                 use_cache=False, **{cache_kwarg(model): _broadcast(cache, B)}, **kwargs)


def kept_columns(pads: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """(B, width) bool: the columns of each row that `forward_shared_prefix` returns, all but the row's `n` prefix
    columns after its `pads` left pads."""
    cols = torch.arange(width, device=pads.device)[None, :]
    return (cols < pads[:, None]) | (cols >= pads[:, None] + n)


def probe(model: nn.Module, read=None, trunk=None, autocast_dtype: torch.dtype | None = None,
          training: bool = False) -> bool:
    """Whether `forward_shared_prefix` gives `model`'s full forward on a small left-padded batch whose rows share
    `MIN_SHARED_TOKENS` tokens after pads of three lengths (within 1e-4 of the outputs' largest magnitude; 1e-2
    under a bf16 autocast, which rounds each product: a wrong mask or position moves them by more). `read(output) -> (B, T, ...)`
    takes the states to compare (default: the logits); `trunk`: a frozen trunk (models/trunk.py) of `model`, whose
    top is what then runs on its states; `autocast_dtype`: the autocast its forwards run under (weights held in
    that dtype need it); `training`: in training mode with gradients on, as the update runs (where activation
    checkpointing's wrapper decides what a layer is given)."""
    read = read or (lambda out: out.logits)
    weight = next(model.parameters())
    g = torch.Generator().manual_seed(0)
    n, B, T = MIN_SHARED_TOKENS, 3, MIN_SHARED_TOKENS + 6
    ids = torch.randint(0, model.get_input_embeddings().num_embeddings, (B, T), generator=g).to(weight.device)
    pads = torch.tensor([2, 1, 0])
    for i in range(B):
        ids[i, int(pads[i]) : int(pads[i]) + n] = ids[0, 2 : 2 + n]
    mask = (torch.arange(T)[None, :] >= pads[:, None]).long().to(weight.device)
    pos = position_ids_from_mask(mask)
    was_training = model.training
    model.train(training)
    try:
        autocast = torch.autocast(weight.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
        with torch.set_grad_enabled(training), autocast:
            inputs = {"input_ids": ids} if trunk is None else {"inputs_embeds": trunk.states(ids, mask, pos)}
            with trunk.top() if trunk is not None else contextlib.nullcontext():
                full = read(model(**inputs, attention_mask=mask, position_ids=pos, use_cache=False))
                shared = read(forward_shared_prefix(model, n, pads, attention_mask=mask, position_ids=pos, **inputs))
    except (TypeError, ValueError, RuntimeError, AttributeError, IndexError) as e:
        log.info("shared prompt prefix: probe failed (%s: %s); not used", type(e).__name__, e)
        return False
    finally:
        model.train(was_training)
    full, shared = full.detach(), shared.detach()
    keep = kept_columns(pads, n, T).to(mask.device)
    real = mask.bool()[keep].view(B, T - n)
    want = full[keep].view(B, T - n, *full.shape[2:])
    tol = 1e-4 if autocast_dtype in (None, torch.float32) else 1e-2
    ok = want.shape == shared.shape
    if ok:  # relative to the outputs' scale: a random model's are small, and so are its errors
        want, shared = want[real].float(), shared[real].float()
        ok = bool((want - shared).abs().max() <= tol * want.abs().max())
    if not ok:
        log.info("shared prompt prefix: %s's forward on a cache does not give its full forward; not used",
                 type(model).__name__)
    return bool(ok)
