"""The four PPO roles (Actor, Critic, Reference, Reward) and the forwards that read them.

- Actor: a causal LM in fp32 master weights, optionally LoRA (peft).
- Critic: a value head on the Actor's last hidden state ("shared": one forward gives logits and
  values) or a separate backbone + value head ("separate"), initialised from the reward model when it
  shares the Actor's vocabulary, else from the policy.
- Reference: the Actor with its adapter disabled when LoRA is on (no second copy in memory), else a
  frozen copy.
- Reward: a `Scorer` (reward model with any tokenizer, or a reward callable).

Tensor legend (rollout/record.py): B batch, P prompt (left-padded), R response, T = P + R, V vocab.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from quartet.algo import entropy_from_logits, gather_logprobs
from quartet.config import PPOConfig
from quartet.errors import ConfigError
from quartet.rollout.record import Rollout, position_ids_from_mask
from quartet.rollout.scoring import Scorer, is_reward_model_spec


@dataclass
class Roles:
    actor: torch.nn.Module
    tokenizer: object
    reference: torch.nn.Module | None  # None: the adapter-disabled actor is the reference
    value_head: torch.nn.Module | None  # shared critic
    critic: torch.nn.Module | None  # separate critic: forward(ids, mask, position_ids) -> (B, T)
    scorer: Scorer
    gold: Scorer | None

    @property
    def critic_module(self) -> torch.nn.Module | None:
        return self.value_head if self.value_head is not None else self.critic


def build_roles(cfg: PPOConfig) -> Roles:
    from quartet.models import apply_lora, disable_dropout, load_causal_lm

    actor, tok = load_causal_lm(cfg.policy, dtype=torch.float32)
    disable_dropout(actor)
    if cfg.lora.enabled:
        actor = apply_lora(actor, cfg.lora)
    reference = None
    if not cfg.lora.enabled or (cfg.reference not in (None, cfg.policy)):
        reference, ref_tok = load_causal_lm(cfg.reference or cfg.policy, dtype=torch.float32)
        if ref_tok.get_vocab() != tok.get_vocab():
            raise ConfigError(f"ppo.reference: '{cfg.reference}' has a different vocabulary from policy '{cfg.policy}'")
        reference.eval().requires_grad_(False)
        disable_dropout(reference)
    scorer = Scorer(cfg.reward)
    gold = Scorer(cfg.gold) if cfg.gold else None
    value_head = critic = None
    if cfg.policy_loss == "ppo":
        if cfg.critic == "shared":
            from quartet.models import value_head_for

            value_head = value_head_for(actor)
        else:
            critic = _build_critic(cfg, tok)
    return Roles(actor, tok, reference, value_head, critic, scorer, gold)


def _build_critic(cfg: PPOConfig, actor_tok) -> torch.nn.Module:
    from quartet.models import disable_dropout, load_tokenizer, make_critic

    init = cfg.critic_init
    if init is None:
        init = cfg.policy
        if is_reward_model_spec(cfg.reward) and load_tokenizer(cfg.reward).get_vocab() == actor_tok.get_vocab():
            init = cfg.reward
    elif load_tokenizer(init).get_vocab() != actor_tok.get_vocab():
        raise ConfigError(
            f"ppo.critic_init: '{init}' uses a different tokenizer from the policy; a separate critic reads the "
            f"actor's tokens, so initialise it from the policy or a reward model of the same family"
        )
    critic = make_critic(init, dtype=torch.float32)
    disable_dropout(critic)
    return critic


def _mb_inputs(ro: Rollout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, mask = ro.input_ids, ro.attention_mask
    return ids, mask, position_ids_from_mask(mask)


def policy_forward(
    model: torch.nn.Module,
    ro: Rollout,
    temperature: float,
    *,
    value_head: torch.nn.Module | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Teacher-forced log-probs of the sampled responses: (logprobs, entropy, values), each (B, R).

    Logits are divided by the sampling temperature so the log-probs are those of the distribution the
    responses were drawn from. Positions skip left padding exactly as `generate` did.
    """
    ids, mask, pos = _mb_inputs(ro)
    P, R = ro.prompt_ids.shape[1], ro.response_ids.shape[1]
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        logits_to_keep=R + 1,
        output_hidden_states=value_head is not None,
        use_cache=False,
    )
    logits = out.logits[:, :-1] / temperature  # (B, R, V): logits at t predict token t + 1
    logprobs = gather_logprobs(logits, ro.response_ids)
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits)
    else:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())
    values = None
    if value_head is not None:
        values = value_head(out.hidden_states[-1][:, P - 1 : -1]).float()  # (B, R): V(s_t) before token t
    return logprobs.float(), entropy.float(), values


def critic_forward(critic: torch.nn.Module, ro: Rollout) -> torch.Tensor:
    """Separate critic's values for each response token's state, (B, R)."""
    ids, mask, pos = _mb_inputs(ro)
    P = ro.prompt_ids.shape[1]
    values = critic(ids, mask, pos)  # (B, T)
    return values[:, P - 1 : -1].float()


@contextlib.contextmanager
def reference_model(roles: Roles):
    """The model that plays the Reference: a frozen copy, or the actor with its adapter disabled."""
    if roles.reference is not None:
        yield roles.reference
        return
    from quartet.models import adapter_disabled

    with adapter_disabled(roles.actor):
        yield roles.actor
