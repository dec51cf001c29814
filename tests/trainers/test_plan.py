"""The PPO trainer's forward plan (trainers/plan.py): one pure function of the config and the launch's facts.

Two tables. The first names the cases a reader looks for, each decision written out. The second runs every
combination of the config's levers and the facts (processes 1/2; full weights, FSDP, ZeRO-3; LoRA; shared,
separate or no critic; hf fp32 / bf16 and vllm engines; log-prob reuse; prefix sharing; each probe's outcome;
activation checkpointing; checkpoints; --resume) against `_setup_before_the_plan`: the trainer's start-up as it
decided these before the plan existed (8492d46, `PPOTrainer._setup` and `_share_prefixes`), transcribed
condition for condition, so that the plan is held to the decisions the trainer made then in every case.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest
import torch

from builders import tiny_ppo
from quartet.config import validate
from quartet.errors import ConfigError
from quartet.trainers.plan import (
    Facts,
    ForwardPlan,
    PrefixProbes,
    check_launch,
    plan_forward_paths,
    probe_models,
)

CRITICS = {  # critic -> the settings that give it
    "shared": {"critic": "shared"},
    "separate": {"critic": "separate"},
    "none": {"critic": "none", "advantage": "grpo", "samples_per_prompt": 2},
}
ALL_PROBES = PrefixProbes(actor=True, actor_training=True, critic=True, critic_training=True, reference=True)


def _cfg(tmp_path, critic="separate", **fields):
    cfg = tiny_ppo(tmp_path, **CRITICS[critic], **fields)
    validate(cfg)
    return cfg


def _facts(processes=1, sharded=None, dtype=torch.float32, resume=False, trunk=False, probes=ALL_PROBES, gpu=False):
    return Facts(processes, sharded, dtype, resume, trunk, probes, gpu)


# ------------------------------------------------------------------------------------------- the named cases
# (config fields, facts, the decisions that differ from BASE)
BASE = dict(sharded=None, critic="separate", trunk=False, actor_shares_prefix=True, critic_shares_prefix=True,
            reference_shares_prefix=True, reuse_sampling_logprobs=True, split_backward=True,
            engine_shares_weights=True, lean_ops=True, activation_checkpointing="none")
CASES = {
    "full fine-tune, separate critic, hf fp32, one process": ({}, _facts(), {}),
    "bf16 sampling rounds apart from the forward: no reuse": ({}, _facts(dtype=torch.bfloat16),
                                                              {"reuse_sampling_logprobs": False}),
    "reuse off in the config": ({"reuse_sampling_logprobs": False}, _facts(), {"reuse_sampling_logprobs": False}),
    "vllm: its own copy and its own log-probs": (
        {"generation.engine": "vllm"}, _facts(), {"reuse_sampling_logprobs": False, "engine_shares_weights": False}),
    "shared critic: the actor's forward runs for the values anyway, one backward": (
        {}, _facts(), {"critic": "shared", "critic_shares_prefix": False, "reuse_sampling_logprobs": False,
                       "split_backward": False}),
    "no critic (grpo)": ({}, _facts(), {"critic": "none", "critic_shares_prefix": False, "split_backward": False}),
    "LoRA: the engine samples a merged copy": ({"lora.enabled": True}, _facts(), {"engine_shares_weights": False}),
    "LoRA on the top layers: the trunk attached, no reuse": (
        {"lora.enabled": True}, _facts(trunk=True),
        {"trunk": True, "reuse_sampling_logprobs": False, "engine_shares_weights": False}),
    "two processes: no trunk, one backward for both roles (DDP)": (
        {"lora.enabled": True}, _facts(processes=2, trunk=True),
        {"split_backward": False, "engine_shares_weights": False}),
    "FSDP, grpo: full-weight levers off": (
        {}, _facts(processes=2, sharded="fsdp", trunk=True),
        {"sharded": "fsdp", "critic": "none", "actor_shares_prefix": False, "critic_shares_prefix": False,
         "reference_shares_prefix": False, "reuse_sampling_logprobs": False, "split_backward": False,
         "engine_shares_weights": False}),
    "ZeRO-3 with LoRA, grpo": (
        {"lora.enabled": True}, _facts(processes=2, sharded="zero3"),
        {"sharded": "zero3", "critic": "none", "actor_shares_prefix": False, "critic_shares_prefix": False,
         "reference_shares_prefix": False, "reuse_sampling_logprobs": False, "split_backward": False,
         "engine_shares_weights": False}),
    "prefix sharing off in the config": (
        {"share_prompt_prefix": False}, _facts(),
        {"actor_shares_prefix": False, "critic_shares_prefix": False, "reference_shares_prefix": False}),
    "on a GPU, auto shares no prefix (launch-bound: its own pass costs more than it saves)": (
        {}, _facts(gpu=True),
        {"actor_shares_prefix": False, "critic_shares_prefix": False, "reference_shares_prefix": False}),
    "on a GPU, asked for": ({"share_prompt_prefix": True}, _facts(gpu=True), {}),
    "the probes failed": (
        {}, _facts(probes=PrefixProbes(reference=False)),
        {"actor_shares_prefix": False, "critic_shares_prefix": False, "reference_shares_prefix": False}),
    "checkpointing, no cache kept in a checkpointed layer: the reference still shares": (
        {"activation_checkpointing": "selective", "lean_ops": False},
        _facts(probes=PrefixProbes(actor=True, critic=True, reference=True)),
        {"actor_shares_prefix": False, "critic_shares_prefix": False, "lean_ops": False,
         "activation_checkpointing": "selective"}),
    "checkpointing, the training probes pass": (
        {"activation_checkpointing": "full"}, _facts(), {"activation_checkpointing": "full"}),
    "the adapter-disabled reference follows the actor's probe": (
        {"lora.enabled": True}, _facts(probes=PrefixProbes(actor=True, critic=False, reference=None)),
        {"critic_shares_prefix": False, "engine_shares_weights": False}),
}
CRITIC_OF = {"shared critic: the actor's forward runs for the values anyway, one backward": "shared",
             "no critic (grpo)": "none", "FSDP, grpo: full-weight levers off": "none", "ZeRO-3 with LoRA, grpo": "none"}


@pytest.mark.parametrize("name", list(CASES))
def test_each_named_case_gets_its_decisions(tmp_path, name):
    fields, facts, changed = CASES[name]
    plan = plan_forward_paths(_cfg(tmp_path, CRITIC_OF.get(name, "separate"), **fields), facts)
    assert plan == ForwardPlan(**{**BASE, **changed})


@pytest.mark.parametrize("sharded, name", [("fsdp", "FSDP"), ("zero3", "DeepSpeed ZeRO-3")])
def test_what_sharded_weights_cannot_do_is_refused_with_one_error(tmp_path, sharded, name):
    refused = _facts(processes=2, sharded=sharded, resume=True)
    with pytest.raises(ConfigError, match=re.escape(
            f"ppo under {name}: a critic (use critic: none, e.g. advantage: grpo); checkpoints (set save_every: 0); "
            f"--resume: not supported with sharded weights yet")):
        plan_forward_paths(_cfg(tmp_path, "shared", save_every=1), refused)
    for critic, fields, resume in (("separate", {}, False), ("none", {"save_every": 1}, False), ("none", {}, True)):
        with pytest.raises(ConfigError, match=f"ppo under {name}: "):
            check_launch(_cfg(tmp_path, critic, **fields), dataclasses.replace(refused, resume=resume))
    check_launch(_cfg(tmp_path, "none"), dataclasses.replace(refused, resume=False))  # grpo: allowed
    # on full weights nothing is refused
    check_launch(_cfg(tmp_path, "shared", save_every=1), _facts(processes=2, resume=True))


# ------------------------------------------------------------------------------------------- every combination
def _setup_before_the_plan(cfg, facts: Facts) -> ForwardPlan:
    """The decisions `PPOTrainer._setup` made before the plan (8492d46), condition for condition. `facts.prefix`
    and `facts.trunk` stand for what its probes returned had it run them; the sharded verdict after `prepare` was
    the accelerator's or the model's, which `prepare` makes the same (trainers/plan.py)."""
    sharded = facts.sharded  # sharding.refuse_unsupported
    if sharded and (cfg.critic_kind != "none" or cfg.save_every or facts.resume):
        raise ConfigError("refused")
    shared_critic = cfg.critic_kind == "shared"
    separate_critic = cfg.critic_kind == "separate"
    trunk = None
    if facts.num_processes == 1 and not sharded:
        trunk = object() if facts.trunk else None  # Trunk.attach
    share_prefix = critic_shares_prefix = reference_shares_prefix = False
    if cfg.share_prompt_prefix and not sharded:  # _share_prefixes
        p, recompute = facts.prefix, cfg.activation_checkpointing != "none"
        share_prefix = p.actor and (not recompute or p.actor_training)
        if separate_critic:
            critic_shares_prefix = p.critic and (not recompute or p.critic_training)
        reference_shares_prefix = p.actor if p.reference is None else p.reference
    record = (cfg.reuse_sampling_logprobs and cfg.generation.engine == "hf" and facts.compute_dtype == torch.float32
              and not shared_critic and trunk is None and not sharded)
    return ForwardPlan(
        sharded=sharded, critic=cfg.critic_kind, trunk=trunk is not None, actor_shares_prefix=share_prefix,
        critic_shares_prefix=critic_shares_prefix, reference_shares_prefix=reference_shares_prefix,
        reuse_sampling_logprobs=record, split_backward=separate_critic and facts.num_processes == 1,
        # make_engine(share_weights=not lora and not sharded): only the HF engine takes it (vLLM holds its own copy)
        engine_shares_weights=cfg.generation.engine == "hf" and not cfg.lora.enabled and not sharded,
        lean_ops=cfg.lean_ops, activation_checkpointing=cfg.activation_checkpointing)


def _probe_outcomes():
    for actor, actor_training, critic, critic_training in itertools.product((False, True), repeat=4):
        for reference in (None, False, True):
            yield PrefixProbes(actor, actor_training, critic, critic_training, reference)


def test_every_combination_decides_as_the_trainer_did(tmp_path):
    # on sharded weights no probe runs (test_only_the_probes_the_plan_can_use_run): two outcomes stand for all
    launches = [Facts(n, sharded, dtype, resume, trunk, probes) for n, sharded, dtype, resume, trunk, probes in
                [*itertools.product((1, 2), (None,), (torch.float32, torch.bfloat16), (False, True), (False, True),
                                    list(_probe_outcomes())),
                 *itertools.product((1, 2), ("fsdp", "zero3"), (torch.float32, torch.bfloat16), (False, True),
                                    (False, True), (PrefixProbes(), ALL_PROBES))]]
    counts = {"allowed": 0, "refused": 0}
    for critic, lora, engine, reuse, share, recompute, save_every in itertools.product(
            CRITICS, (False, True), ("hf", "vllm"), (False, True), (False, True), ("none", "selective", "full"),
            (0, 1)):
        cfg = _cfg(tmp_path, critic, **{"lora.enabled": lora, "generation.engine": engine}, reuse_sampling_logprobs=reuse,
                   share_prompt_prefix=share, activation_checkpointing=recompute, save_every=save_every)
        for facts in launches:
            try:
                want = _setup_before_the_plan(cfg, facts)
            except ConfigError:
                want = "refused"
            try:
                got = plan_forward_paths(cfg, facts)
            except ConfigError as e:
                assert "not supported with sharded weights" in str(e)
                got = "refused"
            assert got == want, (critic, lora, engine, reuse, share, recompute, save_every, facts)
            counts[want if want == "refused" else "allowed"] += 1
    assert counts["allowed"] > 0 and counts["refused"] > 0


# ------------------------------------------------------------------------------------------- the plan itself
def test_the_plan_and_its_facts_are_frozen(tmp_path):
    plan = plan_forward_paths(_cfg(tmp_path), _facts())
    for obj, name in ((plan, "trunk"), (_facts(), "sharded"), (ALL_PROBES, "actor")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, True)


def test_the_plan_is_described_in_one_line_naming_every_decision(tmp_path):
    line = plan_forward_paths(_cfg(tmp_path), _facts(dtype=torch.bfloat16)).describe()
    assert "\n" not in line
    assert line.startswith("ppo forward plan: sharded=none, critic=separate, trunk=no, actor_shares_prefix=yes")
    assert "reuse_sampling_logprobs=no" in line and line.endswith("activation_checkpointing=none")
    assert all(f"{f.name}=" in line for f in dataclasses.fields(ForwardPlan))


def test_only_the_probes_the_plan_can_use_run(tmp_path, monkeypatch):
    """Sharded weights or prefix sharing off: no prefix probe; more than one process or sharded: no trunk. Such
    launches never touch the models (None stands in for them here)."""
    import quartet.trainers.plan as plan_module

    def refuse(*args, **kwargs):
        raise AssertionError("probed")

    monkeypatch.setattr(plan_module.prefix, "probe", refuse)
    monkeypatch.setattr(plan_module.Trunk, "attach", refuse)
    for cfg, launch in ((_cfg(tmp_path, "none"), Facts(2, "fsdp", torch.float32)),
                        (_cfg(tmp_path, share_prompt_prefix=False), Facts(2, None, torch.float32))):
        facts, trunk = probe_models(cfg, None, launch)
        assert trunk is None and facts == launch
