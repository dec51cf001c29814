"""LoRA adapters (peft): wrap a model, switch the adapter off, merge a copy for saving.

With LoRA on, the Reference is the same network with the adapter disabled, so PPO keeps one copy
of the base weights instead of two (see benchmarks/lora_memory.py).
"""

from __future__ import annotations

import contextlib
import copy

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
    peft_cfg = PeftLoraConfig(
        task_type=task_type,
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=target,
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
    """A plain transformers model with the LoRA deltas folded in; ``model`` is left untouched."""
    if not is_peft_model(model):
        return model
    return copy.deepcopy(model).merge_and_unload()
