"""Quartet: RLHF the InstructGPT way (SFT -> preferences -> reward model -> PPO), on a laptop CPU or a cluster."""

__version__ = "0.1.0"

import importlib

from quartet.errors import ConfigError, DataError, ModelError, QuartetError
from quartet.quiet import quiet_by_default

__all__ = ["Callback", "ConfigError", "DPOConfig", "DPOTrainer", "DataError", "GRPOConfig", "GRPOTrainer",
           "LabelConfig", "ModelError", "PPOConfig", "PPOTrainer", "QuartetError", "RLOOConfig", "RLOOTrainer",
           "RewardConfig", "RewardTrainer", "SFTConfig", "SFTTrainer", "TrainerControl", "TrainerState",
           "__version__", "evaluate", "label", "quiet_third_party", "run_pipeline", "train_dpo"]

# the trainers are the Python API's (quartet.api): they take objects and dicts, then run the CLI's path
_LAZY = {
    **dict.fromkeys(["SFTTrainer", "RewardTrainer", "DPOTrainer", "PPOTrainer", "GRPOTrainer", "RLOOTrainer",
                     "label", "evaluate", "run_pipeline"], "quartet.api"),
    **dict.fromkeys(["SFTConfig", "LabelConfig", "RewardConfig", "DPOConfig", "PPOConfig", "GRPOConfig",
                     "RLOOConfig"], "quartet.config"),
    **dict.fromkeys(["Callback", "TrainerControl", "TrainerState"], "quartet.trainers.callbacks"),
    "train_dpo": "quartet.trainers.dpo",
    "quiet_third_party": "quartet.quiet",
}


def __getattr__(name: str):
    """`quartet.PPOTrainer`, `quartet.train_dpo` and the rest without importing torch at `import quartet`."""
    if name in _LAZY:
        if name != "quiet_third_party":
            quiet_by_default()  # the API is as quiet as the CLI without -v, unless the user chose first
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'quartet' has no attribute {name!r}")
