"""Which attention kernel a forward runs on CPU: chosen per call from the batch's shape.

On CPU, torch's fused SDPA kernel (flash attention for CPU) is slow at the short sequences RLHF trains on:
measured on a 2-core AMD EPYC with AVX-512 BF16 under bf16 autocast, its backward took 13 ms per layer for
SmolLM2 at 8 x 112 tokens (a fifth of a LoRA PPO step) and 51 ms per layer for MiniLM at 32 x 98 tokens (a
third of a reward-model step), and each decoding step of `generate` spent ~25 ms in it. The plain "eager"
attention (two batched matmuls and a softmax) does the same work in a fraction of that: LoRA step 2.5 -> 2.1 s,
reward-model step 1.03 -> 0.78 s, decoding 101 -> 87 ms per step at batch 16.

Its cost is memory: eager materialises the (B, heads, T, T) attention probabilities, and in a training forward
keeps them for the backward in every layer. So eager is chosen only while those probabilities stay within
`EAGER_BUDGET_BYTES` (all layers' when gradients are on, one layer's otherwise), and the model's own kernel
(sdpa, or whatever it was loaded with) runs the long sequences. On a GPU nothing changes.

The choice is a forward pre-hook on the transformers backbone (`fit_attention_to_shape`), so every forward
of that model (training, scoring, each decoding step) takes it, whoever calls it. Both kernels compute the
same attention; their outputs differ by rounding only.

Grouped-query attention (SmolLM2: 9 query heads share 3 key/value heads) goes through `grouped_eager_attention`
instead of transformers' eager function where the model's own eager is the plain Llama form: the same products
and softmax, but each key/value head is read by its group of query heads in one batched product instead of
being copied once per query head (`repeat_kv`). While decoding those copies were the whole KV cache, three
times, for every layer and every new token.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

GROUPED = "quartet_grouped_eager"
"""the name `grouped_eager_attention` is registered under in transformers' attention and mask interfaces"""

EAGER_BUDGET_BYTES = 256 * 2**20
"""largest size of the attention probabilities (float32) for which eager attention is chosen on CPU"""


def attention_probs_bytes(batch: int, heads: int, length: int, layers: int, grad: bool) -> int:
    """Bytes of float32 attention probabilities eager attention holds: every layer's for a backward, one
    layer's without gradients."""
    return batch * heads * length * length * 4 * (layers if grad else 1)


def grouped_eager_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs):
    """transformers' eager attention (Llama form) for query (B, H, q, D) and key/value (B, Hkv, k, D), with
    Hkv dividing H, computed per key/value head: the H / Hkv query heads that read one key/value head are
    consecutive, so their queries are stacked into one (B, Hkv, H / Hkv * q, D) product with that head's keys.
    Returns what eager returns: the output (B, q, H, D) and the attention probabilities (B, H, q, k)."""
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    rows = heads // kv_heads * q_len
    scores = torch.matmul(query.reshape(batch, kv_heads, rows, dim), key.transpose(2, 3))
    weights = scores.view(batch, heads, q_len, kv_len) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights.view(batch, kv_heads, rows, kv_len), value)
    return out.view(batch, heads, q_len, dim).transpose(1, 2).contiguous(), weights


def _register_grouped() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(GROUPED, grouped_eager_attention)
    AttentionMaskInterface.register(GROUPED, eager_mask)  # the additive float mask eager attention reads


def llama_form(backbone: nn.Module) -> bool:
    """Whether `backbone`'s attention layers call transformers' eager function in the Llama form (the same
    bytecode as Llama's: modular transformers copies it into Mistral, Qwen2, ...), so that any eager function of
    the same products and softmax computes what the model's own would."""
    from transformers.models.llama.modeling_llama import eager_attention_forward as llama

    attn = next((m for m in backbone.modules() if hasattr(m, "num_key_value_groups")), None)
    if attn is None:
        return False
    own = getattr(sys.modules.get(type(attn).__module__), "eager_attention_forward", None)
    code, ref = getattr(own, "__code__", None), llama.__code__
    return code is not None and (code.co_code, code.co_names, code.co_consts) == (ref.co_code, ref.co_names, ref.co_consts)


def _eager_name(backbone: nn.Module) -> str:
    """The eager kernel for `backbone`: `GROUPED` where its attention layers are in the Llama form (`llama_form`)
    with grouped key/value heads, else "eager". Any other eager form (soft-capping, attention sinks, a model of
    its own) keeps its own function."""
    attn = next((m for m in backbone.modules() if hasattr(m, "num_key_value_groups")), None)
    if attn is None or attn.num_key_value_groups <= 1 or not llama_form(backbone):
        return "eager"
    _register_grouped()
    return GROUPED


def fit_attention_to_shape(model: nn.Module) -> None:
    """Make `model` (a transformers model, or its backbone) pick eager or its own attention kernel per
    forward, by the rule above. A model on a GPU, or one loaded with eager already, is left as it is."""
    if hasattr(model, "get_base_model"):  # peft: the transformers model under the adapter
        model = model.get_base_model()
    backbone = getattr(model, "base_model", model)  # the module whose forward receives the ids and the mask
    config = getattr(backbone, "config", None)
    if config is None or getattr(backbone, "_quartet_fitted_attention", False):
        return
    own = getattr(config, "_attn_implementation", None)
    if own in (None, "eager"):
        return
    backbone._quartet_own_attention = own
    backbone._quartet_eager_attention = _eager_name(backbone)
    backbone.register_forward_pre_hook(_choose_attention, with_kwargs=True)
    backbone._quartet_fitted_attention = True


def _choose_attention(module: nn.Module, args: tuple, kwargs: dict):
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    if not isinstance(ids, torch.Tensor) or ids.device.type != "cpu":
        return None
    # a cache that needs its own attention function names it (K samples on one copy of their prompt's keys:
    # models/sample_prefix.py)
    needs = getattr(kwargs.get("cache", kwargs.get("past_key_values")), "quartet_attention", None)
    if needs is not None:
        module.config._attn_implementation = needs
        return None
    mask = kwargs.get("attention_mask")
    # while decoding, the ids are the new token only and the 2-d mask spans the cached keys too
    length = mask.shape[-1] if isinstance(mask, torch.Tensor) and mask.dim() == 2 else ids.shape[1]
    config = module.config
    heads, layers = getattr(config, "num_attention_heads", None), getattr(config, "num_hidden_layers", None)
    if not heads or not layers:
        return None
    size = attention_probs_bytes(ids.shape[0], heads, length, layers, torch.is_grad_enabled())
    config._attn_implementation = module._quartet_eager_attention if size <= EAGER_BUDGET_BYTES else module._quartet_own_attention
    return None
