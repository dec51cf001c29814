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
"""

from __future__ import annotations

import torch
from torch import nn

EAGER_BUDGET_BYTES = 256 * 2**20
"""largest size of the attention probabilities (float32) for which eager attention is chosen on CPU"""


def attention_probs_bytes(batch: int, heads: int, length: int, layers: int, grad: bool) -> int:
    """Bytes of float32 attention probabilities eager attention holds: every layer's for a backward, one
    layer's without gradients."""
    return batch * heads * length * length * 4 * (layers if grad else 1)


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
    backbone.register_forward_pre_hook(_choose_attention, with_kwargs=True)
    backbone._quartet_fitted_attention = True


def _choose_attention(module: nn.Module, args: tuple, kwargs: dict):
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    if not isinstance(ids, torch.Tensor) or ids.device.type != "cpu":
        return None
    mask = kwargs.get("attention_mask")
    # while decoding, the ids are the new token only and the 2-d mask spans the cached keys too
    length = mask.shape[-1] if isinstance(mask, torch.Tensor) and mask.dim() == 2 else ids.shape[1]
    config = module.config
    heads, layers = getattr(config, "num_attention_heads", None), getattr(config, "num_hidden_layers", None)
    if not heads or not layers:
        return None
    size = attention_probs_bytes(ids.shape[0], heads, length, layers, torch.is_grad_enabled())
    config._attn_implementation = "eager" if size <= EAGER_BUDGET_BYTES else module._quartet_own_attention
    return None
