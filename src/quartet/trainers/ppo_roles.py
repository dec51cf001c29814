"""The four roles of the policy-gradient trainers (Actor, Critic, Reference, Reward) and their forwards.

- Actor: a causal LM in fp32 master weights, optionally LoRA (peft). It owns its sampling temperature:
  every log-prob of the actor or the reference is taken from logits / temperature, so no forward can
  score tokens under another distribution than the one they were sampled from.
- Critic: only for estimators that need one (GAE). "shared": a value head on the Actor's last hidden
  state (one forward gives log-probs and values); "separate": its own backbone + value head, initialised
  from the reward model when it shares the Actor's vocabulary, else from the policy.
- Reference: the Actor with its adapter disabled when LoRA is on (no second copy in memory; its frozen base
  linears held in the autocast dtype, `models.precast_lora_base`), else a frozen copy whose linear layers are
  stored in the autocast dtype (the same outputs, less memory).
- Reward: a `Scorer` (reward model with any tokenizer, or a reward callable); `gold` is an optional
  second judge that is logged, never optimised.

`PolicyModel` holds the Actor and the Critic as one `nn.Module`, so `accelerator.prepare` wraps both
once and DDP reduces the gradients of both. It is made once the trainer's plan (trainers/plan.py) is known, with
the forward paths the plan chose for it.

Tensor legend (rollout/record.py): B batch, P prompt (left-padded), R response, T = P + R, V vocab.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from quartet.config import PPOConfig
from quartet.errors import ConfigError
from quartet.models import (
    adapter_disabled,
    apply_lora,
    disable_dropout,
    load_causal_lm,
    load_tokenizer,
    make_critic,
    precast_linears,
    precast_lora_base,
    value_head_for,
)
from quartet.models.trunk import Trunk
from quartet.rollout.forward import response_logprobs as actor_logprobs  # the forward quartet eval shares
from quartet.rollout.forward import shared_prefix
from quartet.rollout.record import Rollout, position_ids_from_mask
from quartet.rollout.scoring import RewardSum, Scorer, is_reward_model_spec
from quartet.trainers.loop import compute_device, generation_dtype


class PolicyModel(nn.Module):
    """Actor (+ Critic): `forward(rollout) -> (logprobs, entropy, values)`, each (B, R) (values None
    without a critic). `critic` is a ScalarHead on the actor's hidden states (`shared_critic`) or a
    separate `models.Critic`.

    `trunk`: the actor's frozen bottom layers (models/trunk.py), where the plan uses them; `share_prefix`: the
    actor's forwards run the rows' shared prompt prefix once (models/prefix.py); `critic_shares_prefix`: a
    separate critic's do, as it is its own model."""

    def __init__(self, actor: nn.Module, critic: nn.Module | None, shared_critic: bool, temperature: float, *,
                 trunk: Trunk | None = None, share_prefix: bool = False, critic_shares_prefix: bool = False):
        super().__init__()
        self.actor = actor
        self.critic = critic
        self.shared_critic = shared_critic and critic is not None
        self.temperature = float(temperature)
        self.trunk = trunk
        self.share_prefix = share_prefix
        self.critic_shares_prefix = critic_shares_prefix

    def forward(self, ro: Rollout, with_entropy_grad: bool = False, part: str = "both"):
        """`part`: "both"; or, with a separate critic, "actor" (values None) or "critic" (log-probs and
        entropy None), so each role's activations can be freed by its own backward before the other's forward."""
        if part == "critic":
            return None, None, self._separate_values(ro)
        logprobs, entropy, hidden = actor_logprobs(
            self.actor, ro, self.temperature, with_entropy_grad=with_entropy_grad, hidden=self.shared_critic,
            trunk=self.trunk, share_prefix=self.share_prefix,
        )
        values = None
        if self.shared_critic:
            values = self.critic(hidden).float()  # V(s_t) before token t, from the actor's hidden state
        elif self.critic is not None and part == "both":
            values = self._separate_values(ro)
        return logprobs, entropy, values

    def _separate_values(self, ro: Rollout) -> torch.Tensor:
        ids, mask, pos = _inputs(ro)
        shared = shared_prefix(ro) if self.critic_shares_prefix else None
        n = shared[0] if shared else 0  # the critic's output starts after the shared prefix's columns
        return self.critic(ids, mask, pos, shared_prefix=shared)[:, ro.prompt_ids.shape[1] - 1 - n : -1].float()


@dataclass(frozen=True)
class Roles:
    actor: nn.Module  # fp32 master weights, optionally LoRA
    critic: nn.Module | None  # when the estimator needs one: a value head on the actor (shared) or its own model
    shared_critic: bool  # `critic` is a value head on the actor's hidden states
    temperature: float  # the Actor's sampling temperature: every log-prob of the actor or the reference is taken at it
    tokenizer: object
    reference: nn.Module | None  # None: the adapter-disabled actor is the reference
    scorer: Scorer | RewardSum  # RewardSum: reward_funcs, each term also logged as rollout/reward_<name>
    gold: Scorer | None
    monitors: dict[str, Scorer]  # logged as rollout/<name>, never optimised

    @property
    def trained(self) -> list[nn.Module]:
        """The models the update back-propagates through: the actor, and a separate critic (a shared value head
        trains on the actor's layers)."""
        return [self.actor] if self.critic is None or self.shared_critic else [self.actor, self.critic]

    @contextlib.contextmanager
    def reference_model(self):
        """The model that plays the Reference: a frozen copy, or the actor with its adapter disabled."""
        if self.reference is not None:
            yield self.reference
            return
        with adapter_disabled(self.actor):
            yield self.actor


def build_roles(cfg: PPOConfig, needs_critic: bool, sharded: bool = False) -> Roles:
    """`sharded`: the actor's weights will be sharded (FSDP, ZeRO-3), which takes one dtype per flat parameter,
    so a LoRA base is not held in the compute dtype."""
    compute = generation_dtype(cfg.precision)  # the trainer's autocast dtype
    actor, tok = load_causal_lm(cfg.policy, dtype=torch.float32)
    disable_dropout(actor)
    if cfg.lora.enabled:
        actor = apply_lora(actor, cfg.lora)
        if not sharded:  # the frozen base in the autocast dtype: the same forwards without a cast per forward
            precast_lora_base(actor, compute)
    reference = None
    if not cfg.lora.enabled or (cfg.reference not in (None, cfg.policy)):
        reference, ref_tok = load_causal_lm(cfg.reference or cfg.policy, dtype=torch.float32)
        if ref_tok.get_vocab() != tok.get_vocab():
            raise ConfigError(f"ppo.reference: '{cfg.reference}' has a different vocabulary from policy '{cfg.policy}'")
        reference.eval().requires_grad_(False)
        disable_dropout(reference)
    if reference is not None:  # it only runs under that autocast
        precast_linears(reference, compute)
    scorer = _reward(cfg, compute)
    gold = Scorer(cfg.gold, timeout=cfg.judge_timeout) if cfg.gold else None
    monitors = {}
    for name, spec in cfg.monitor_judges.items():
        try:
            monitors[name] = Scorer(spec, timeout=cfg.judge_timeout)
        except ConfigError as e:
            raise ConfigError(f"ppo.monitor_judges.{name}: {e}") from None
    critic = None
    if needs_critic:
        critic = value_head_for(actor) if cfg.critic == "shared" else _build_critic(cfg, tok)
    for model in (actor, reference, critic):  # the reward models: Scorer places its own
        if model is not None:
            model.to(compute_device())
    return Roles(actor, critic, critic is not None and cfg.critic == "shared", float(cfg.generation.temperature), tok,
                 reference, scorer, gold, monitors)


def _reward(cfg: PPOConfig, compute: torch.dtype) -> Scorer | RewardSum:
    """The Reward role: `reward`, or the weighted sum of `reward_funcs`. A reward model runs its matmuls in the
    trainer's autocast dtype, as the trainer's own forwards."""
    if not cfg.reward_funcs:
        return Scorer(cfg.reward, autocast=compute, timeout=cfg.judge_timeout)
    weights = cfg.reward_weights or [1.0] * len(cfg.reward_funcs)
    terms = [(name, w, spec) for (name, spec), w in zip(cfg.reward_terms.items(), weights)]
    try:
        return RewardSum(terms, cfg.reward_uncertainty_coef, autocast=compute, timeout=cfg.judge_timeout)
    except ConfigError as e:
        raise ConfigError(f"ppo.reward_funcs: {e}") from None


def _reward_model(cfg: PPOConfig) -> str | None:
    """The reward model the reward reads (the first of reward_funcs' that is one), else None."""
    return next((s for s in cfg.reward_funcs or [cfg.reward] if is_reward_model_spec(s)), None)


def _build_critic(cfg: PPOConfig, actor_tok) -> nn.Module:
    init = cfg.critic_init
    if init is None:
        init = cfg.policy
        rm = _reward_model(cfg)
        if rm is not None and load_tokenizer(rm).get_vocab() == actor_tok.get_vocab():
            init = rm
    elif load_tokenizer(init).get_vocab() != actor_tok.get_vocab():
        raise ConfigError(
            f"ppo.critic_init: '{init}' uses a different tokenizer from the policy; a separate critic reads the "
            f"actor's tokens, so initialise it from the policy or a reward model of the same family"
        )
    critic = make_critic(init, dtype=torch.float32)
    disable_dropout(critic)
    return critic


def _inputs(ro: Rollout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, mask = ro.input_ids, ro.attention_mask
    return ids, mask, position_ids_from_mask(mask)
