"""Quartet: RLHF the InstructGPT way (SFT -> preferences -> reward model -> PPO), on a laptop CPU or a cluster."""

__version__ = "0.1.0"

from quartet.errors import ConfigError, DataError, ModelError, QuartetError

__all__ = ["ConfigError", "DataError", "ModelError", "QuartetError", "__version__"]
