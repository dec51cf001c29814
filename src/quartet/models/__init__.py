"""Models: loading (HF dir, GGUF, tiny-from-config), LoRA and the Reference, reward model, Critic.

load_causal_lm(name)        -> (model, tokenizer), pad != EOS, left padding, no dropout
save_model(model, tok, dir) -> plain transformers dir (LoRA merged; adapter under adapter/)
apply_lora / adapter_disabled
make_reference(actor, name) -> Reference (shared with a LoRA actor, else a frozen copy)
load_reward_model / save_reward_model -> RewardModel (sequence classifier + normalisation)
make_critic / save_critic / load_critic -> Critic (backbone + ScalarHead, per-token values)
"""

from quartet.models.critic import (
    Critic,
    ValueHeadCritic,
    load_critic,
    make_critic,
    save_critic,
    save_value_head,
)
from quartet.models.gguf import clear_model_cache, strip_quantization
from quartet.models.heads import ScalarHead, value_head_for
from quartet.models.loading import (
    contiguous_head_input,
    count_parameters,
    disable_dropout,
    ensure_pad_token,
    hidden_size,
    load_causal_lm,
    load_tokenizer,
    precast_linears,
    save_model,
)
from quartet.models.lora import adapter_disabled, apply_lora, is_peft_model, merged_copy, precast_lora_base
from quartet.models.names import ModelSource, resolve_model
from quartet.models.reference import Reference, make_reference
from quartet.models.reward import RewardModel, load_reward_model, save_reward_model
from quartet.models.tiny import build_tiny

__all__ = [
    "Critic",
    "ModelSource",
    "Reference",
    "RewardModel",
    "ScalarHead",
    "ValueHeadCritic",
    "adapter_disabled",
    "apply_lora",
    "build_tiny",
    "clear_model_cache",
    "contiguous_head_input",
    "count_parameters",
    "disable_dropout",
    "ensure_pad_token",
    "hidden_size",
    "is_peft_model",
    "load_causal_lm",
    "load_critic",
    "load_reward_model",
    "load_tokenizer",
    "precast_linears",
    "make_critic",
    "make_reference",
    "merged_copy",
    "precast_lora_base",
    "resolve_model",
    "save_critic",
    "save_model",
    "save_reward_model",
    "save_value_head",
    "strip_quantization",
    "value_head_for",
]
