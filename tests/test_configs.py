"""The configs that ship in configs/ load and validate as their commands read them, every configs/ file the README
names ships, and each stage's standalone config keeps the demo's settings for that stage (one recipe, not two)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from quartet.config import DPOConfig, LabelConfig, PPOConfig, RewardConfig, SFTConfig, load_config, validate

ROOT = Path(__file__).resolve().parents[1]
STAGES = {"sft": SFTConfig, "label": LabelConfig, "rm": RewardConfig, "ppo": PPOConfig, "dpo": DPOConfig}


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_each_stage_config_loads_and_validates(stage):
    cfg = load_config(STAGES[stage], str(ROOT / "configs" / f"{stage}.yaml"))
    validate(cfg)


def test_every_config_the_readme_names_ships():
    named = set(re.findall(r"configs/[\w/.-]+\.yaml", (ROOT / "README.md").read_text(encoding="utf-8")))
    assert named and all((ROOT / n).is_file() for n in named), sorted(n for n in named if not (ROOT / n).is_file())


@pytest.mark.parametrize("stage", ["sft", "label", "rm", "ppo"])
def test_a_standalone_stage_config_keeps_the_demos_settings(stage):
    """What the demo's section sets, the standalone config sets the same (beside the paths `quartet run` wires)."""
    demo = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())[stage]
    alone = yaml.safe_load((ROOT / "configs" / f"{stage}.yaml").read_text())
    for key, value in demo.items():
        got = alone.get(key)
        if isinstance(value, dict):
            assert {k: got.get(k) for k in value} == value, key
        else:
            assert got == value, key
