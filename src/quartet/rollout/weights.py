"""The actor's weights as an engine loads them: LoRA folded in, the plain model's config.

Every engine holds its own copy of the actor (HFEngine's private copy, vLLM's model) and refreshes it from the
training weights before each rollout (`sync`); the trainer saves the merged model the same way
(quartet.trainers.sharding).
"""

from __future__ import annotations

import torch

from quartet.models.lora import full_weight


def merged_state_dict(actor: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The actor's weights as a plain (non-peft) state dict, LoRA deltas folded into their base layers.

    `state`: the actor's full weights keyed as `actor.state_dict()`, gathered from a sharded model (whose own
    tensors are shards); the merge then reads the adapter matrices from it (plain LoRA on linear layers)."""
    try:
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft is a dependency, but keep plain models working without it
        PeftModel = LoraLayer = ()  # noqa: N806
    if not isinstance(actor, PeftModel):
        return {k: v.detach() for k, v in (actor.state_dict() if state is None else state).items()}
    base = actor.get_base_model()
    prefix = "base_model.model."  # a PeftModel's keys are its base model's under this prefix
    base_state = base.state_dict() if state is None else {k.removeprefix(prefix): v for k, v in state.items()}
    merged: dict[str, torch.Tensor] = {}
    lora_layers = {_unwrapped_name(name): m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    for key, value in base_state.items():
        if "lora_" in key:
            continue
        clean = key.replace(".base_layer.", ".")
        merged[clean] = value.detach()
    with torch.no_grad():
        for name, layer in lora_layers.items():
            if state is None:
                weight = full_weight(layer.get_base_layer())  # a base held in bf16 merges from its original
                delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A)
            else:
                weight = base_state[f"{name}.base_layer.weight"]
                delta = _lora_delta(layer, name, base_state)
            merged[f"{name}.weight"] = weight + delta if isinstance(delta, torch.Tensor) else weight
    return merged


def _unwrapped_name(name: str) -> str:
    """A module's name without the segments FSDP1 and activation checkpointing insert (state-dict keys have none)."""
    for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def _lora_delta(layer, name: str, state: dict[str, torch.Tensor]):
    """What peft's `Linear.get_delta_weight` computes, from the gathered adapter matrices in `state`:
    (B @ A), transposed for fan-in-fan-out layers, times the adapter's scale (in fp32 for 16-bit weights)."""
    from peft.tuners.lora import Linear
    from peft.utils.other import transpose

    delta = 0
    for a in layer.active_adapters:
        if a not in layer.lora_A:
            continue
        if not isinstance(layer, Linear) or layer.use_dora.get(a, False):
            raise RuntimeError(f"LoRA layer {name}: only plain LoRA on linear layers can be merged from gathered "
                               f"weights (got {type(layer).__name__}{', DoRA' if layer.use_dora.get(a) else ''})")
        w_a, w_b = state[f"{name}.lora_A.{a}.weight"], state[f"{name}.lora_B.{a}.weight"]
        dtype = w_b.dtype
        d = transpose(w_b.float() @ w_a.float(), layer.fan_in_fan_out) * layer.scaling[a]
        delta = delta + d.to(dtype)
    return delta


def base_config(actor: torch.nn.Module):
    """The config of the plain model under a peft wrapper, without a quantization config (engines load bf16/fp32)."""
    model = actor.get_base_model() if hasattr(actor, "get_base_model") else actor
    config = model.config
    if getattr(config, "quantization_config", None) is not None:
        config = type(config).from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    return config
