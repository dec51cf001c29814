"""K samples of one prompt decode on one copy of the prompt's keys and values.

Sampling K answers per prompt (AI-feedback labelling, GRPO/RLOO groups, a K-answer eval) prefills each prompt once
(`HFEngine._shared_prefill`). Given to transformers' KV cache, that prefill has to be repeated K times, and every
decoding step then copies the whole cache (`torch.cat` of the old keys and the new one, per layer) and reads the
prompt's keys once per sample, in batched products of 1 query row per key/value head. Measured on a 2-core AMD EPYC
with AVX-512 BF16, SmolLM2-135M in bf16, 2 threads: one layer's attention step at 48 prompts x 8 samples and ~80
prompt tokens took 2-14 ms, against 0.7-1.6 ms with the prompt's keys held once and read by its K samples' queries
together; the demo's label batches (48 x 8 answers, `benchmarks/k_samples.py`) 11.0 -> 9.1 s each.

`share_prompts` makes the prefill's cache (a transformers `DynamicCache`) one whose layers (`SharedPromptLayer`)
hold the prompt's keys and values once, (P, Hkv, Lp, D), and each row's own keys and values (those of the tokens
decoded after the prefill), (B, Hkv, Ls, D). `shared_prompt_attention` computes a row's attention over both: the
scores of a prompt's K rows against its keys in one product per prompt, then the row's scores against its own keys,
one softmax over the two (with the mask transformers builds for the whole row, prompt padding included), and the
weighted sum of each part's values. It is eager attention over the same keys; the output differs by rounding only
(the two parts' weighted sums round before they are added, where one product over all keys rounds once). In
float32 that moves a log-prob by ~1e-5 at most (the next-token distributions ~3e-6 apart in total variation), and
the same seeds draw the same tokens except where a uniform falls among tokens narrower than that (the vocabulary's
long tail: algo/sampling.py): 17 of SmolLM2's 384 label answers took another token from some step on. In bf16 a
logit moves by about one of its 8-bit roundings (~0.1 at SmolLM2's logits), and most answers at temperature 1
differ from some token on; each cache's distributions are as close to float32's as the other's
(`benchmarks/k_samples.py`): other draws of the same sampler.

Rows leave the batch as they finish (`batch_select_indices`): each row keeps its slot (prompt x K + sample), a
prompt all of whose rows have left is dropped, and the queries of the rows still decoding are placed in their
slots for the prompt products.

Used only where `shares_prompts(model)`: a transformers model on CPU with Quartet's per-shape attention choice
(`models.attention.fit_attention_to_shape`, which switches to this function when the forward is handed such a
cache) and attention layers in the Llama form (every model whose eager attention is Llama's function); and
the engine checks once per model that decoding steps give the repeated cache's next-token distributions
(`quartet.rollout.engine.HFEngine`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer

from quartet.models.attention import llama_form
from quartet.models.loading import base_model_of

NAME = "quartet_shared_prompt"
"""the name `shared_prompt_attention` is registered under in transformers' attention and mask interfaces"""


def shared_prompt_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs):
    """Eager attention (Llama form) for query (B, H, q, D) over a row's prompt keys (held once per prompt by the
    `SharedPromptLayer` that returned `key`) and its own keys `key`/`value` (B, Hkv, Ls, D). `attention_mask`:
    the additive mask over all Lp + Ls keys. Returns (B, q, H, D) and the probabilities (B, H, q, Lp + Ls)."""
    layer = key.quartet_shared_layer  # the SharedPromptLayer that returned `key`
    pk, pv = layer.prompt_keys, layer.prompt_values  # (P, Hkv, Lp, D)
    batch, heads, q_len, dim = query.shape
    kv_heads, prompts, prompt_len, k = key.shape[1], pk.shape[0], pk.shape[2], layer.samples
    rows = heads // kv_heads * q_len  # query rows that read one key/value head, per batch row
    q = query.reshape(batch, kv_heads, rows, dim)
    by_slot = _to_slots(q, layer.slots, prompts * k)  # (P * K, Hkv, rows, D)
    grouped = by_slot.reshape(prompts, k, kv_heads, rows, dim).transpose(1, 2).reshape(prompts, kv_heads, k * rows, dim)
    prompt_scores = _from_groups(torch.matmul(grouped, pk.transpose(2, 3)), k, layer.slots)  # (B, Hkv, rows, Lp)
    own_scores = torch.matmul(q, key.transpose(2, 3))  # (B, Hkv, rows, Ls)
    weights = torch.cat([prompt_scores, own_scores], -1).view(batch, heads, q_len, -1) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    w = weights.view(batch, kv_heads, rows, -1)
    w_prompt = _to_slots(w[..., :prompt_len], layer.slots, prompts * k)
    w_prompt = w_prompt.reshape(prompts, k, kv_heads, rows, prompt_len).transpose(1, 2)
    w_prompt = w_prompt.reshape(prompts, kv_heads, k * rows, prompt_len)
    out = _from_groups(torch.matmul(w_prompt, pv), k, layer.slots) + torch.matmul(w[..., prompt_len:], value)
    return out.view(batch, heads, q_len, dim).transpose(1, 2).contiguous(), weights


def _to_slots(x: torch.Tensor, slots: torch.Tensor | None, n: int) -> torch.Tensor:
    """Rows of `x` (B, ...) placed at their slots of an (n, ...) tensor, zeros elsewhere; `slots` None: x is it."""
    if slots is None:
        return x
    out = x.new_zeros(n, *x.shape[1:])
    out[slots] = x
    return out


def _from_groups(x: torch.Tensor, k: int, slots: torch.Tensor | None) -> torch.Tensor:
    """(P, Hkv, K * rows, n) per-prompt products -> (B, Hkv, rows, n) for the batch's rows."""
    prompts, kv_heads, krows, n = x.shape
    x = x.view(prompts, kv_heads, k, krows // k, n).transpose(1, 2).reshape(prompts * k, kv_heads, krows // k, n)
    return x if slots is None else x[slots]


class SharedPromptLayer(DynamicLayer):
    """One layer's cache: the prompts' keys and values once, (P, Hkv, Lp, D), and the rows' own, (B, Hkv, Ls, D).
    Built by `share_prompts` from a prefill's layer; transformers calls `update` with each step's new keys."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, samples: int):
        self.prompt_keys, self.prompt_values = keys, values
        self.samples = samples
        self.slots: torch.Tensor | None = None  # each row's slot (prompt x K + sample); None: row i is slot i
        shape = (keys.shape[0] * samples, keys.shape[1], 0, keys.shape[3])
        self.keys = keys.new_zeros(shape)
        self.values = values.new_zeros(shape)
        self.device = keys.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.keys.quartet_shared_layer = self  # read by `shared_prompt_attention`
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.prompt_keys.shape[-2] + self.keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a cache of K samples per prompt is not repeated again")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a cache of K samples per prompt is not cropped")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Only rows `indices` stay; a prompt with no row left is dropped and the slots renumbered."""
        slots = indices if self.slots is None else self.slots[indices]
        prompt = slots // self.samples
        live = torch.unique(prompt)  # sorted
        if live.numel() < self.prompt_keys.shape[0]:
            self.prompt_keys, self.prompt_values = self.prompt_keys[live], self.prompt_values[live]
            slots = torch.searchsorted(live, prompt) * self.samples + slots % self.samples
        self.slots = slots
        self.keys, self.values = self.keys[indices], self.values[indices]


def share_prompts(cache, samples: int):
    """The prefill's cache `cache` (a transformers DynamicCache of P prompts) made a cache of its P x `samples`
    rows that holds each prompt's keys once (`SharedPromptLayer`), or None where its layers are not plain
    dynamic layers (sliding windows, quantised, linear attention)."""
    if not isinstance(cache, DynamicCache) or not cache.layers:
        return None
    if any(type(layer) is not DynamicLayer or not layer.is_initialized for layer in cache.layers):
        return None
    cache.layers = [SharedPromptLayer(layer.keys, layer.values, samples) for layer in cache.layers]
    _register()
    cache.quartet_attention = NAME  # the attention function `fit_attention_to_shape`'s hook picks for it
    return cache


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, shared_prompt_attention)
    AttentionMaskInterface.register(NAME, eager_mask)  # the additive float mask over all the row's keys


def shares_prompts(model: nn.Module) -> bool:
    """Whether `model`'s decoding can run on a cache from `share_prompts`: on CPU, with `fit_attention_to_shape`'s hook
    (it picks `shared_prompt_attention` for such a cache) over attention layers in the Llama form."""
    base = base_model_of(model)
    backbone = getattr(base, "base_model", base)
    weight = next(model.parameters(), None)
    if weight is None or weight.device.type != "cpu":
        return False
    return bool(getattr(backbone, "_quartet_fitted_attention", False)) and llama_form(backbone)


__all__ = ["NAME", "SharedPromptLayer", "share_prompts", "shared_prompt_attention", "shares_prompts"]
