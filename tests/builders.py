"""The tiny PPO config the tests run: a random 1-layer Llama learning tiny-target in seconds. Importable as
`builders` from every test (pytest puts tests/ on sys.path for its conftest) and from the drivers that the
distributed tests launch (they put tests/ there themselves)."""

from __future__ import annotations

import json
from pathlib import Path

from quartet.config import PPOConfig, apply_overrides, from_dict

TINY = "tiny:llama?hidden=32&layers=1&heads=4&vocab=260&seed=1"
"""the policy: a seeded random 1-layer Llama over the byte-level tokenizer (quartet.models.tiny)"""


def tiny_ppo(tmp_path: Path, *overrides: str, **fields) -> PPOConfig:
    """Three PPO iterations of TINY on tiny-target, run in `tmp_path`/ppo, with a test's changes applied as a
    user's are, by `quartet.config.apply_overrides`: first `overrides` in the CLI's form ("generation.engine=vllm",
    the value read as YAML), then `fields` as Python values (`critic=None`, `**{"lora.r": 4}`), each handed over
    as JSON, which reads back as the same value.

    Not validated, as `from_dict` leaves it: a test of a refusal calls `validate` itself, and the trainer
    validates the rest (filling in the defaults that follow other fields)."""
    base = {
        "policy": TINY,
        "reward": "task:tiny-target",
        "prompts": {"path": "task:tiny-target/train", "max_prompt_tokens": 32},
        "output_dir": str(tmp_path / "ppo"),
        "iterations": 3,
        "rollout_batch_size": 16,
        "minibatch_size": 8,
        "micro_batch_size": 4,
        "ppo_epochs": 2,
        "generation": {"max_new_tokens": 8, "batch_size": 16},
        "optim": {"lr": 1e-2, "adam_eps": 1e-8},  # the eps these tests' runs were tuned with (PPO's default: 1e-5)
        "precision": "fp32",
        "critic": "shared",
    }
    given = [*overrides, *(f"{key}={json.dumps(value)}" for key, value in fields.items())]
    return from_dict(PPOConfig, apply_overrides(base, given))
