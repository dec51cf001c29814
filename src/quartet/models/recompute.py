"""Activation checkpointing for the trained roles, through transformers and torch.utils.checkpoint.

"full" is transformers' own: each decoder layer keeps only its input and runs again in the backward. "selective"
is torch's selective activation checkpointing inside the same per-layer regions: the outputs of the matrix
products (and of fused attention) are kept, everything element-wise (norms, rotary, softmax, SiLU, the gating
product, casts) is recomputed. Element-wise work is memory-bound and cheap to redo; its fp32 copies are most of
a layer's saved bytes under bf16 autocast. Measured on SmolLM2-135M PPO, separate critic, full fine-tune, 16 x 96
tokens, bf16 autocast, AVX-512 BF16 CPU, 2 threads (`benchmarks/vs_trl.py` workload): saved activations per role
2.0 GB; peak RSS 8.4 -> 7.3 GB (selective, update +3 s of 32) or 6.5 GB (full, +7 s).

Only the training forwards recompute: transformers checkpoints a layer only in train mode, and the
experience, reference and evaluation forwards run in eval mode under no_grad.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

MODES = ("none", "selective", "full")


@functools.cache
def _kept_ops() -> frozenset:
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention"]
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def _keep_products(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _kept_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_keep_products)


def enable_activation_checkpointing(model: nn.Module, mode: str) -> bool:
    """Turn checkpointing `mode` on in the transformers model inside `model` (a PeftModel's base, a critic's
    backbone, or the model itself). False for "none"; a model transformers cannot checkpoint raises ValueError."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing: mode must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return False
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    target = getattr(target, "backbone", target)  # quartet.models.Critic
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = _selective_context
    if hasattr(target, "activation_checkpointing_enable"):  # transformers >= 5.x; the older name warns there
        target.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return True
