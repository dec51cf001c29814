"""The forward paths of a PPO run, decided once at start-up: one frozen `ForwardPlan`.

Each speed lever of the trainer changes how a forward runs, never what it computes, and each holds only on some
launches and models. `plan_forward_paths(cfg, facts)` decides them all in one place, a pure function of the config
and of `Facts`: the launch (processes, sharded weights, the compute dtype) and what the probes found on the loaded
models. The trainer logs the plan (`ForwardPlan.describe`) and hands each decision to the object that acts on it
when that object is made: the policy module, the generation engine, the experience maker.

- sharded weights (FSDP, ZeRO-3): one verdict, the accelerator's (`sharding.accelerator_shards`), known before
  `prepare`; accelerate shards a model in `prepare` exactly when its distributed type is FSDP, or DeepSpeed with
  ZeRO stage 3, which is what that function reads. What they do not handle yet is refused (`check_launch`).
- frozen trunk (models/trunk.py): LoRA on the top layers only; one process, full weights, and the probe's verdict.
- shared prompt prefix (models/prefix.py): per model, the probe's verdict (`auto`: on the CPU only); under
  activation checkpointing the trained roles also need their layers to keep the read-only cache and a probe in
  training mode. Not on sharded weights: FSDP2 on gloo aborted on the actor's two calls in one forward
  (tests/distributed/test_sharded.py), and sharded runs are GPU runs this was not measured on.
- old log-probs from the sampling pass (`PPOConfig.reuse_sampling_logprobs`): where that pass computes the
  actor's forward up to float rounding: the HF engine sampling the fp32-trained actor's weights in fp32, no
  shared value head (the actor's forward runs for the values anyway), no frozen trunk, full weights (a LoRA
  actor's reference, the adapter-disabled actor called past the FSDP root, reads the weights the actor's scoring
  forward left gathered).
- one backward per role (`PPOTrainer._update`): a separate critic on one process (DDP reduces one backward per
  forward).
- the HF engine samples the actor's own weights (no packed private copy): a full fine-tune on full weights.
- lean ops and activation checkpointing: the config's own, for the trained roles (the actor and a separate critic),
  applied before the probes, which must see them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from quartet.config import PPOConfig
from quartet.models import prefix
from quartet.models.trunk import Trunk
from quartet.trainers import sharding
from quartet.trainers.ppo_roles import Roles


@dataclass(frozen=True)
class PrefixProbes:
    """What `models.prefix.probe` found on each model: its forward on the shared prefix's cache gives its full
    forward (False where it was not probed)."""

    actor: bool = False  # in eval mode, on its trunk's states where it has one
    actor_training: bool = False  # also in training mode, its layers told to keep the cache (asked under recompute)
    critic: bool = False  # a separate critic's backbone, on its last hidden state
    critic_training: bool = False
    reference: bool | None = None  # None: the reference is the adapter-disabled actor, whose probe is the actor's


@dataclass(frozen=True)
class Facts:
    """What the plan depends on besides the config."""

    num_processes: int
    sharded: str | None  # "fsdp", "zero3" or None: sharding.accelerator_shards, the one verdict
    compute_dtype: torch.dtype  # the autocast and sampling dtype (loop.generation_dtype: "auto" follows the hardware)
    resume: bool = False  # this start continues a run from its checkpoint
    trunk: bool = False  # Trunk.attach found a frozen trunk that gives the full forward
    prefix: PrefixProbes = PrefixProbes()
    gpu: bool = False  # the models compute on a GPU (share_prompt_prefix: auto shares on the CPU only)

    @property
    def autocast(self) -> torch.dtype | None:
        """The autocast dtype the probes run under (None: fp32, no autocast)."""
        return None if self.compute_dtype == torch.float32 else self.compute_dtype


@dataclass(frozen=True)
class ForwardPlan:
    """Every forward-path decision of a PPO run (see the module doc for why each holds where it does)."""

    sharded: str | None  # "fsdp", "zero3" or None (full weights on every process)
    critic: str  # "shared" (a value head on the actor), "separate" (its own model) or "none"
    trunk: bool  # the actor's frozen bottom layers run once per rollout
    actor_shares_prefix: bool  # the rows' shared prompt prefix runs once in the actor's forwards
    critic_shares_prefix: bool  # ... in a separate critic's
    reference_shares_prefix: bool  # ... in the reference's
    reuse_sampling_logprobs: bool  # the engine records each token's log-prob; the old log-probs are those
    split_backward: bool  # one backward and one step per role
    engine_shares_weights: bool  # the HF engine samples the actor's own weights, no private copy
    lean_ops: bool  # the trained roles' norms and SwiGLU keep less for the backward
    activation_checkpointing: str  # the trained roles': none, selective or full

    @property
    def separate_critic(self) -> bool:
        return self.critic == "separate"

    def describe(self) -> str:
        """One line for the log: every decision by name."""
        return "ppo forward plan: " + ", ".join(
            f"{f.name}={_word(getattr(self, f.name))}" for f in fields(self))


def _word(value: bool | str | None) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return "none" if value is None else str(value)


def check_launch(cfg: PPOConfig, facts: Facts) -> None:
    """Refuse what PPO does not make right yet on sharded weights: one ConfigError naming all of it."""
    sharding.refuse(facts.sharded, "ppo", {
        "a critic (use critic: none, e.g. advantage: grpo)": cfg.critic_kind != "none",
        "checkpoints (set save_every: 0)": bool(cfg.save_every), "--resume": facts.resume})


def may_attach_trunk(facts: Facts) -> bool:
    """A frozen trunk is tried on one process with full weights only (where it was built and tested)."""
    return facts.num_processes == 1 and facts.sharded is None


def may_share_prefix(cfg: PPOConfig, facts: Facts) -> bool:
    """The shared prompt prefix is probed for where the config asks for it (`auto`: on the CPU), on full weights
    only. Not by default on a GPU: there a small model's forward is bound by kernel launches, not arithmetic, and
    the prefix's own pass through every layer adds as many launches as it saves work (SmolLM2-135M-shaped, 16 x
    (64 + 32) tokens, separate critic, fp32, one H200: 2.45 s per PPO iteration shared, 1.78 s not, the update
    1.39 -> 0.72 s; on a 2-core CPU the same lever saves 16%, docs/speed.md)."""
    wanted = (not facts.gpu) if cfg.share_prompt_prefix == "auto" else cfg.share_prompt_prefix
    return wanted and facts.sharded is None


def plan_forward_paths(cfg: PPOConfig, facts: Facts) -> ForwardPlan:
    """The plan of a run of `cfg` on `facts`: a pure function, the one place each decision is made. Raises the
    ConfigError of `check_launch` for a combination that cannot run (the trainer asks that first, before any
    model loads)."""
    check_launch(cfg, facts)
    critic, full_weights = cfg.critic_kind, facts.sharded is None
    trunk = facts.trunk and may_attach_trunk(facts)
    probes = facts.prefix if may_share_prefix(cfg, facts) else PrefixProbes()
    recompute = cfg.activation_checkpointing != "none"
    return ForwardPlan(
        sharded=facts.sharded,
        critic=critic,
        trunk=trunk,
        actor_shares_prefix=probes.actor and (not recompute or probes.actor_training),
        critic_shares_prefix=critic == "separate" and probes.critic and (not recompute or probes.critic_training),
        reference_shares_prefix=probes.actor if probes.reference is None else probes.reference,
        reuse_sampling_logprobs=(cfg.reuse_sampling_logprobs and cfg.generation.engine == "hf"
                                 and facts.compute_dtype == torch.float32 and critic != "shared" and not trunk
                                 and full_weights),
        split_backward=critic == "separate" and facts.num_processes == 1,
        engine_shares_weights=cfg.generation.engine == "hf" and not cfg.lora.enabled and full_weights,
        lean_ops=cfg.lean_ops,
        activation_checkpointing=cfg.activation_checkpointing,
    )


def probe_models(cfg: PPOConfig, roles: Roles, facts: Facts) -> tuple[Facts, Trunk | None]:
    """`facts` completed with what the probes find on the loaded roles (their trained ones already set up for
    training: lean ops, activation checkpointing), and the frozen trunk where one attached. Only the probes whose
    outcome the plan can use run: each costs a few small forwards."""
    trunk = Trunk.attach(roles.actor, facts.autocast) if may_attach_trunk(facts) else None
    probes = _probe_prefixes(cfg, roles, trunk, facts.autocast) if may_share_prefix(cfg, facts) else PrefixProbes()
    return replace(facts, trunk=trunk is not None, prefix=probes), trunk


def _probe_prefixes(cfg: PPOConfig, roles: Roles, trunk: Trunk | None, autocast: torch.dtype | None) -> PrefixProbes:
    """Each model's probe; under activation checkpointing, for the trained roles that passed, whether their layers
    may keep the read-only prefix cache and a forward in training mode still gives the full one."""
    recompute = cfg.activation_checkpointing != "none"

    def training(model, probed: bool, **kw) -> bool:  # the update's forwards also run in training mode
        return probed and recompute and prefix.keep_cache_under_checkpointing(model) and \
            prefix.probe(model, autocast_dtype=autocast, training=True, **kw)

    actor = prefix.probe(roles.actor, trunk=trunk, autocast_dtype=autocast)
    found = {"actor": actor, "actor_training": training(roles.actor, actor, trunk=trunk)}
    if cfg.critic_kind == "separate":
        read = {"read": lambda out: out.last_hidden_state}
        backbone = roles.critic.backbone
        critic = prefix.probe(backbone, autocast_dtype=autocast, **read)
        found.update(critic=critic, critic_training=training(backbone, critic, **read))
    if roles.reference is not None:
        found["reference"] = prefix.probe(roles.reference, autocast_dtype=autocast)
    return PrefixProbes(**found)
