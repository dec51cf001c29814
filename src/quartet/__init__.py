"""Quartet: RLHF the InstructGPT way (SFT -> preferences -> reward model -> PPO), on a laptop CPU or a cluster."""

__version__ = "0.1.0"

from quartet.errors import ConfigError, DataError, ModelError, QuartetError

__all__ = ["ConfigError", "DPOConfig", "DataError", "ModelError", "PPOConfig", "PPOTrainer", "QuartetError",
           "__version__", "train_dpo"]

_LAZY = {"PPOTrainer": "quartet.trainers.ppo", "PPOConfig": "quartet.config", "DPOConfig": "quartet.config",
         "train_dpo": "quartet.trainers.dpo"}


def __getattr__(name: str):
    """`quartet.PPOTrainer`, `quartet.train_dpo` and their configs without importing torch at `import quartet`."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'quartet' has no attribute {name!r}")
