"""LoRA adapters (peft): wrap a model, switch the adapter off, merge a copy for saving.

With LoRA on, the Reference is the same network with the adapter disabled, so PPO keeps one copy
of the base weights instead of two (see benchmarks/lora_memory.py).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from quartet.config import LoraConfig
from quartet.errors import ModelError


def is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def apply_lora(model: nn.Module, lora_cfg: LoraConfig, task_type: str = "CAUSAL_LM"):
    """Wrap ``model`` in a peft LoRA adapter; only the adapter (and, for SEQ_CLS, the head) trains.

    ``target_modules`` may be "all-linear" (every linear layer but the output head) or a list of
    module names. The adapter's B matrix starts at zero, so the wrapped model computes exactly what
    ``model`` did until the first update.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    target = lora_cfg.target_modules
    if isinstance(target, (list, tuple)):
        target = list(target)
    elif not isinstance(target, str):
        raise ModelError(f'lora.target_modules: expected "all-linear" or a list of names, got {target!r}')
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if lora_cfg.layers_to_transform is not None and layers is not None and max(lora_cfg.layers_to_transform) >= layers:
        raise ModelError(f"lora.layers_to_transform: layer {max(lora_cfg.layers_to_transform)} does not exist (the "
                         f"model has {layers} decoder layers, 0-{layers - 1})")
    if target == "all-linear" and lora_cfg.layers_to_transform is not None:  # peft takes names with layer indices
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        target = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                         if isinstance(m, nn.Linear) and m is not head})
    peft_cfg = PeftLoraConfig(
        task_type=task_type,
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=target,
        layers_to_transform=lora_cfg.layers_to_transform,
    )
    try:
        return get_peft_model(model, peft_cfg)
    except ValueError as e:
        lines = str(e).strip().splitlines() or [""]
        raise ModelError(f"lora.target_modules {target!r}: {lines[0][:200]}") from None


def adapter_disabled(model):
    """Context in which a peft model runs as its base model; a no-op for any other model."""
    if is_peft_model(model):
        return model.disable_adapter()
    return contextlib.nullcontext()


def merged_copy(model) -> nn.Module:
    """A plain transformers model with the LoRA deltas folded in; ``model`` is left untouched. Base weights held
    in a compute dtype (`precast_lora_base`) are merged from their full-precision originals."""
    if not is_peft_model(model):
        return model
    model = copy.deepcopy(model)
    for module in model.modules():
        for name in ("weight", "bias"):
            full = getattr(module, f"_quartet_full_{name}", None)
            if full is not None:  # a plain attribute: it stayed where the model was precast
                getattr(module, name).data = full.to(getattr(module, name).device)
                delattr(module, f"_quartet_full_{name}")
    return model.merge_and_unload()


def precast_lora_base(model, dtype: torch.dtype) -> None:
    """Hold the frozen base weights of `model`'s LoRA layers in `dtype`, the dtype autocast casts them to at every
    forward: under autocast in `dtype` the forwards are the same, bit for bit, without casting 135M weights per
    forward (SmolLM2 LoRA PPO step: ~15% faster on a 2-core EPYC with AVX-512 BF16). The full-precision
    originals are kept beside them (`full_weight`), so a merge or a save is made from them, as without this.
    The LoRA layers also take their input as it comes (peft's `cast_input_dtype_enabled` off): peft would cast
    the bf16 input to the adapter's fp32 and autocast cast it straight back, the same values through two copies
    per layer and forward (SmolLM2 LoRA step at 8 x 130 tokens: ~2.5 -> 2.3 s).
    For models run under autocast only; a no-op for fp32 or a model without LoRA."""
    if dtype == torch.float32 or not is_peft_model(model):
        return
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        module.cast_input_dtype_enabled = False
        base = module.get_base_layer()
        if not isinstance(base, nn.Linear):
            continue
        for name in ("weight", "bias"):
            param = getattr(base, name)
            if param is None or param.requires_grad or param.dtype == dtype:
                continue
            setattr(base, f"_quartet_full_{name}", param.data)
            param.data = param.data.to(dtype)


def full_weight(layer: nn.Module):
    """A linear layer's weight in full precision: the original `precast_lora_base` kept (on the device the layer
    computes on: a plain attribute stays where the model was precast), or the weight itself."""
    full = getattr(layer, "_quartet_full_weight", None)
    return layer.weight if full is None else full.to(layer.weight.device)
