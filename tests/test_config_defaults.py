"""Defaults that follow other settings (issue 35): filled in once, at validation, when the user left them null;
a value the user set always wins, and the config a run writes holds the value used."""

from __future__ import annotations

import pytest
import yaml

from quartet.config import (
    LR_DEFAULTS,
    DPOConfig,
    PPOConfig,
    RewardConfig,
    SFTConfig,
    config_text,
    largest_divisor_upto,
    load_config,
)
from quartet.config_doc import starter_yaml
from quartet.pipeline import load_pipeline

STAGES = {"sft": SFTConfig, "rm": RewardConfig, "dpo": DPOConfig, "ppo": PPOConfig}


@pytest.mark.parametrize("stage", STAGES)
def test_lr_follows_lora_unless_set(stage):
    cls = STAGES[stage]
    full, lora = LR_DEFAULTS[stage]
    assert lora >= 4 * full  # an adapter trained at the full fine-tune's rate barely moves
    assert load_config(cls).optim.lr == full
    cfg = load_config(cls, overrides=["lora.enabled=true"])
    assert cfg.optim.lr == lora
    assert yaml.safe_load(config_text(cfg))["optim"]["lr"] == lora  # what config.yaml records
    assert load_config(cls, overrides=["lora.enabled=true", "optim.lr=3e-6"]).optim.lr == 3e-6
    # a partly given optim section keeps the auto lr too
    assert load_config(cls, overrides=["lora.enabled=true", "optim.warmup_steps=1"]).optim.lr == lora


def test_lora_gets_a_shared_critic_unless_told_otherwise():
    def critic(*overrides: str, preset: dict | None = None) -> str:
        return load_config(PPOConfig, overrides=list(overrides), defaults=preset).critic

    assert critic() == "separate"
    assert critic("lora.enabled=true") == "shared"
    assert critic("lora.enabled=true", "critic_init=some/critic") == "separate"  # a separate critic's weights
    assert critic("lora.enabled=true", "critic=separate") == "separate"
    assert critic("lora.enabled=true", "advantage=grpo", "samples_per_prompt=2") == "none"
    cfg = load_config(PPOConfig, overrides=["lora.enabled=true"])
    assert cfg.critic_kind == "shared" and yaml.safe_load(config_text(cfg))["critic"] == "shared"


@pytest.mark.parametrize("overrides, sizes", [
    ([], (8, 8)),                                                        # 16 sequences: as before
    (["rollout_batch_size=4"], (4, 4)),                                  # was an error: 8 does not divide 4
    (["rollout_batch_size=12"], (6, 6)),
    (["rollout_batch_size=3", "samples_per_prompt=4"], (6, 6)),          # the sequences, not the prompts
    (["rollout_batch_size=32", "minibatch_size=16"], (16, 8)),
    (["rollout_batch_size=4", "micro_batch_size=2"], (4, 2)),
    (["rollout_batch_size=7"], (7, 7)),
])
def test_minibatch_sizes_follow_the_rollout(overrides, sizes):
    cfg = load_config(PPOConfig, overrides=overrides)
    assert (cfg.minibatch_size, cfg.micro_batch_size) == sizes
    assert cfg.sequences_per_iteration % cfg.minibatch_size == 0 and cfg.minibatch_size % cfg.micro_batch_size == 0


def test_an_explicit_minibatch_that_does_not_divide_is_still_refused():
    from quartet.errors import ConfigError

    with pytest.raises(ConfigError, match="ppo.minibatch_size: 8 does not divide the 4 sequences"):
        load_config(PPOConfig, overrides=["rollout_batch_size=4", "minibatch_size=8"])


def test_largest_divisor_upto():
    assert [largest_divisor_upto(n, 8) for n in (1, 4, 8, 9, 10, 12, 13, 16, 24)] == [1, 4, 8, 3, 5, 6, 1, 8, 8]


def test_best_tracking_follows_save_every_unless_set():
    assert load_config(PPOConfig).best_metric == "none"
    assert load_config(PPOConfig, overrides=["save_every=5"]).best_metric == "objective/score"
    assert load_config(PPOConfig, overrides=["best_metric=policy/entropy"]).best_metric == "policy/entropy"
    assert load_config(PPOConfig, overrides=["save_every=5", "best_metric=none"]).best_metric == "none"


def test_the_starter_file_leaves_them_unset_so_they_still_follow(tmp_path):
    """`quartet config ppo --write` writes null for these, so turning LoRA on in the file gets LoRA's defaults
    (a starter holding lr 1e-5 and critic separate would keep them)."""
    data = yaml.safe_load(starter_yaml("ppo"))
    assert (data["optim"]["lr"], data["critic"], data["minibatch_size"], data["best_metric"]) == (None,) * 4
    data["lora"]["enabled"] = True
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(PPOConfig, path)
    assert (cfg.optim.lr, cfg.critic) == (LR_DEFAULTS["ppo"][1], "shared")


def test_the_demo_sets_what_it_was_measured_with():
    """configs/demo.yaml gives every setting these defaults could change, so its numbers stay those measured."""
    cfg = load_pipeline("configs/demo.yaml")
    ppo = cfg.ppo
    assert (ppo.optim.lr, ppo.optim.adam_eps, ppo.critic, ppo.minibatch_size, ppo.micro_batch_size) == (
        5e-4, 1e-8, "shared", 8, 8)
    assert (ppo.save_every, ppo.best_metric) == (8, "objective/score")
    assert (cfg.sft.optim.lr, cfg.rm.optim.lr, cfg.dpo.optim.lr) == (2e-4, 5e-5, 2e-4)
