"""Configs: one dataclass per concern, YAML in, validated, one-line errors out.

Every stage reads ``<stage>.yaml`` into its dataclass with :func:`load_config`; any field can be
overridden from the command line as ``key.sub=value`` (the value is parsed as YAML). Unknown keys
are rejected with a suggestion. A component receives its own sub-config, never the root.

The package, by concern (every name below is importable from ``quartet.config`` itself):

- ``validators``: the one-line checks each ``validate`` is built from (``positive``, ``in_range``, ``seed``, ...);
- ``shared``: the sub-configs several stages share (LoRA, data, optimizer, generation, tracking) and their defaults;
- ``stages``: one config per stage (sft, label, rm, dpo, ppo) and the PPO presets (grpo, rloo);
- ``evaluation``: the evaluation's settings (`quartet eval`, and `quartet run`'s eval section);
- ``io``: YAML in and out (``load_yaml`` with aliases bounded, overrides, ``from_dict``, ``validate``, ``save_config``).
"""

from quartet.config.evaluation import EvalConfig
from quartet.config.io import (
    MAX_ALIAS_NODES,
    AliasBombError,
    BoundedLoader,
    apply_overrides,
    config_text,
    from_dict,
    load_config,
    load_yaml,
    merge,
    read_yaml,
    save_config,
    to_dict,
    validate,
)
from quartet.config.shared import (
    JUDGE_TIMEOUT,
    LR_DEFAULTS,
    REPORT_TO,
    DataConfig,
    GenerationConfig,
    LLMJudgeConfig,
    LoraConfig,
    OptimConfig,
    Precision,
    TrackingConfig,
    largest_divisor_upto,
    resolve_lr,
)
from quartet.config.stages import (
    PPO_METRICS,
    PPO_PRESETS,
    DPOConfig,
    GRPOConfig,
    LabelConfig,
    PPOConfig,
    RewardConfig,
    RLOOConfig,
    SFTConfig,
)
from quartet.config.validators import SEED_MAX, in_range, non_negative, number, positive, seed

__all__ = [
    "JUDGE_TIMEOUT", "LR_DEFAULTS", "MAX_ALIAS_NODES", "PPO_METRICS", "PPO_PRESETS", "REPORT_TO", "SEED_MAX",
    "AliasBombError", "BoundedLoader", "DPOConfig", "DataConfig", "EvalConfig", "GRPOConfig", "GenerationConfig",
    "LLMJudgeConfig", "LabelConfig", "LoraConfig", "OptimConfig", "PPOConfig", "Precision", "RLOOConfig",
    "RewardConfig", "SFTConfig", "TrackingConfig", "apply_overrides", "config_text", "from_dict", "in_range",
    "largest_divisor_upto", "load_config", "load_yaml", "merge", "non_negative", "number", "positive", "read_yaml", "resolve_lr",
    "save_config", "seed", "to_dict", "validate",
]
