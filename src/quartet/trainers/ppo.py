"""Stage 4: policy optimisation with the four roles (Actor, Critic, Reference, Reward), InstructGPT style,
and the rest of the policy-gradient family, which differs from PPO only in credit assignment.

One iteration (`PPOTrainer.step`) is the recipe:
    1. experience: sample prompts, `samples_per_prompt` responses each, score them, old and reference
       log-probs, values when the estimator needs a critic (trainers/experience.py);
    2. per-token rewards: the score at the last token, minus beta * KL per token when the KL is in the reward;
    3. advantages from the estimator chosen at start-up (quartet.algo.ESTIMATORS: gae, grpo, dr_grpo, rloo,
       reinforce_pp, reinforce_pp_baseline, remax), whitened over the batch where the method does;
    4. `ppo_epochs` passes over shuffled minibatches, each loss built by `_loss`: clipped policy loss
       (+ vf_coef * clipped value loss, - entropy bonus, + beta * KL when the KL is a loss term);
    5. beta is updated by the KL controller; metrics are logged and the doctor reads them.

Everything random in an iteration is seeded from (seed, iteration), so a resumed run repeats exactly
what an uninterrupted one does. Under N processes (accelerate launch) the experience is gathered onto
every process (trainers/experience.py), so advantages, whitening, KL control, metrics and the doctor's
decisions are those of the whole batch; each global minibatch is split evenly across the processes and
DDP sums their gradients, weighted so that the update equals one process's on the whole minibatch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from quartet.algo import (
    AdaptiveKL,
    FixedKL,
    aggregate,
    cispo_loss,
    clipped_policy_loss,
    clipped_value_loss,
    explained_variance,
    get_estimator,
    kept_rows_scale,
    kl_estimate,
    masked_mean,
    masked_whiten,
    token_rewards,
    truncated_importance_weights,
)
from quartet.atomic import atomic_write_text, remove_stale_temporaries
from quartet.config import PPO_PRESETS as PRESETS
from quartet.config import PPOConfig, load_config, read_yaml, save_config, to_dict, validate
from quartet.data import encode_prompts, load_prompts
from quartet.errors import ConfigError, QuartetError
from quartet.models import save_critic, save_model, save_value_head
from quartet.models.card import stage_card
from quartet.models.lean_ops import apply_lean_ops
from quartet.models.prefix import shared_prefix_length
from quartet.models.recompute import enable_activation_checkpointing
from quartet.models.trunk import Trunk
from quartet.monitor.doctor import LiveDoctor, diagnose_run
from quartet.monitor.metrics import MetricsLogger, peak_rss_mb
from quartet.monitor.rules import check_rule_names
from quartet.monitor.samples import append_samples, truncate_after
from quartet.outputs import check_output_dir, run_lock, write_marker
from quartet.preflight import check_names
from quartet.rollout.engine import make_engine
from quartet.rollout.record import Rollout
from quartet.rollout.scoring import RunningMoments
from quartet.trainers import checkpoint as ckpt
from quartet.trainers import loop, sharding
from quartet.trainers.callbacks import CallbackHandler, check_callbacks
from quartet.trainers.experience import ExperienceMaker, rollout_stats, step_seed
from quartet.trainers.plan import Facts, check_launch, plan_forward_paths, probe_models
from quartet.trainers.ppo_roles import PolicyModel, build_roles

log = logging.getLogger("quartet")
# a resumed run may change these; anything else would make it a different run than the one it continues
# (iterations extends or shortens it, the LR schedule rebuilt over the new length: `_resume`; judge_timeout only bounds how long a reward may think: a run stopped by it resumes with a longer one; the
# prompts' max_line_mb only bounds reading, and a run saved before the field existed has none)
RESUMABLE_CHANGES = ("iterations", "save_every", "keep_checkpoints", "stop_on", "judge_timeout", "prompts.max_line_mb")
# what `save_checkpoint` stores besides the iteration; a resume refuses a state.json without one of them
STATE_FIELDS = ("optimizer", "scheduler", "kl_ctl", "moments", "best")
# settings whose null default is filled in at validation since issue 35; a run written before holds them as null
FILLED_DEFAULTS = ("critic",)


class NonFiniteWeights(QuartetError):
    """An update made a trained weight NaN or infinite; nothing is saved from that point."""


@dataclass
class PPOResult:
    run_dir: Path
    model_dir: Path
    best_dir: Path | None
    iterations: int
    metrics: dict = field(default_factory=dict)
    stopped_by: str | None = None
    extended_from: int | None = None
    """the iterations the run was configured with before this resume changed them (None: not changed)"""


@dataclass(frozen=True)
class StepResult:
    """One iteration's outcome (`PPOTrainer.step`)."""

    metrics: dict[str, float]  # what is logged and what the doctor reads
    samples: list[dict]  # its samples.jsonl records, one per response


class PPOTrainer:
    """`PPOTrainer(cfg).train()`; `step(iteration)` runs one iteration and returns its `StepResult`."""

    def __init__(self, cfg: PPOConfig, resume: bool = False, progress: bool = True, overwrite: bool = False,
                 callbacks=None):
        """`callbacks`: objects with on_step / on_log / on_save ... (quartet.trainers.callbacks), called once per
        iteration."""
        validate(cfg)  # the whole tree (optim, lora, generation, prompts), as SFT and DPO do, not PPOConfig alone
        check_rule_names(cfg.stop_on, "ppo.stop_on")  # the doctor's rules: config knows none of them
        callbacks = check_callbacks(callbacks)
        self.cfg, self.progress, self.start_iteration = cfg, progress, 0
        self.resumed_from: Path | None = None
        """the checkpoint this run resumed from: never pruned while the run goes on (checkpoint.save_checkpoint)"""
        self.run_dir = Path(cfg.output_dir)
        self.accelerator = loop.make_accelerator(cfg.precision, grad_accum=1)  # accumulation is done by hand
        self.main = self.accelerator.is_main_process
        self._lock = contextlib.ExitStack()
        try:
            self._start(resume, overwrite)
        except BaseException:  # a run that cannot start leaves no lock behind
            self._lock.close()
            raise
        self.events = CallbackHandler(callbacks, cfg, "ppo", cfg.iterations, self.accelerator,
                                      model=self.roles.actor, tokenizer=self.roles.tokenizer)

    def _start(self, resume: bool, overwrite: bool) -> None:
        """Start-up, in order: what needs no model is checked before the first one loads (a typo costs a second, not
        a load); the models load; the plan of their forward paths is made from the config, the launch and what the
        probes find on them (trainers/plan.py), logged, and given to each object made after it."""
        cfg = self.cfg
        self._claim_output_dir(resume, overwrite)
        launch = Facts(self.accelerator.num_processes, sharding.accelerator_shards(self.accelerator),
                       loop.generation_dtype(cfg.precision), resume, gpu=self.accelerator.device.type == "cuda")
        check_launch(cfg, launch)
        self.estimator = get_estimator(cfg.advantage)
        self.doctor = LiveDoctor(stop_on=cfg.stop_on, kl_target=cfg.kl_target if cfg.adaptive_kl else None)
        check_names("ppo", cfg)
        examples = load_prompts(cfg.prompts)
        torch.manual_seed(cfg.seed)
        self.roles = build_roles(cfg, needs_critic=cfg.critic_kind != "none", sharded=launch.sharded is not None)
        encoded = self._encode_prompts(examples)
        self._set_up_trained_roles()
        facts, trunk = probe_models(cfg, self.roles, launch)
        self.plan = plan_forward_paths(cfg, facts)
        if self.main:
            log.info("%s", self.plan.describe())
        trunk = trunk if self.plan.trunk else None
        engine = self._prepare(trunk)
        self.kl_ctl = AdaptiveKL(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon) if cfg.adaptive_kl else FixedKL(cfg.kl_coef)
        self.moments = RunningMoments() if cfg.reward_norm else None
        self.best = ckpt.BestTracker(self.run_dir, cfg.best_metric)
        self.experience = ExperienceMaker(cfg, self.roles, engine, self.accelerator,
                                          [examples[i].prompt for i in encoded.kept], encoded.input_ids,
                                          self.moments, self.estimator.needs_greedy, self.plan, trunk)
        self.resumed, self._config_changed, self._output_started = resume, False, False
        self._notes: list[str] = []
        """what resumes changed, kept as comments at the top of config.yaml and listed in summary.md"""
        self.extended_from: int | None = None
        """the iterations the run had before this resume changed them"""
        if resume:
            self._resume()

    def _claim_output_dir(self, resume: bool, overwrite: bool) -> None:
        """The output folder: this stage's to write (main process: locked, a killed run's half-written files
        removed), holding a run to continue exactly when --resume is given."""
        if self.main:
            check_output_dir(self.run_dir, "ppo", overwrite)
            self._lock.enter_context(run_lock(self.run_dir, "ppo.output_dir"))
            for path in remove_stale_temporaries(self.run_dir):  # a killed run's half-written files
                log.info("ppo: removed %s, left by a run that was killed while writing it", path)
        if ckpt.list_checkpoints(self.run_dir) and not resume:
            raise ConfigError(f"ppo.output_dir: {self.run_dir} already holds a PPO run; pass --resume to continue "
                              f"it or choose another output_dir")
        if resume and not ckpt.list_checkpoints(self.run_dir):
            raise ConfigError(_no_checkpoint(self.run_dir))

    def _encode_prompts(self, examples: list):
        """The prompts, encoded once (sampled in a seeded order per pass), each fitting the policy's context with
        its answer."""
        cfg, tok = self.cfg, self.roles.tokenizer
        encoded = encode_prompts(tok, [e.prompt for e in examples], cfg.prompts.max_prompt_tokens,
                                 cfg.prompts.truncation, cfg.prompts.chat_template, where=cfg.prompts.path)
        limit = getattr(self.roles.actor.config, "max_position_embeddings", None)
        longest = max(map(len, encoded.input_ids)) + cfg.generation.max_new_tokens
        if limit is not None and longest > limit:
            raise ConfigError(
                f"ppo.prompts.max_prompt_tokens + generation.max_new_tokens = {longest} exceeds the policy's "
                f"context of {limit} tokens; lower one of them"
            )
        return encoded

    def _set_up_trained_roles(self) -> None:
        """Lean ops and activation checkpointing on the models the update back-propagates through; before the
        probes, which must see the layers the update runs."""
        for role in self.roles.trained:
            if self.cfg.lean_ops:
                apply_lean_ops(role)
            try:
                enable_activation_checkpointing(role, self.cfg.activation_checkpointing)
            except ValueError as e:
                raise ConfigError(f"ppo.activation_checkpointing: {e}") from None

    def _prepare(self, trunk: Trunk | None):
        """The policy module with the plan's forward paths, one AdamW (the actor's and the critic's parameters as
        two groups) and its schedule, through `prepare`; and the generation engine, made before `prepare` may shard
        the actor's weights (each rollout re-syncs it), which samples a plain full-fine-tune actor as it is."""
        cfg, plan, roles = self.cfg, self.plan, self.roles
        policy = PolicyModel(roles.actor, roles.critic, roles.shared_critic, roles.temperature, trunk=trunk,
                             share_prefix=plan.actor_shares_prefix, critic_shares_prefix=plan.critic_shares_prefix)
        groups = [{"params": [p for p in policy.actor.parameters() if p.requires_grad], "lr": cfg.optim.lr}]
        if policy.critic is not None:
            groups.append({"params": list(policy.critic.parameters()), "lr": cfg.critic_lr or cfg.optim.lr})
        optimizer = loop.adamw(groups, weight_decay=cfg.optim.weight_decay, eps=cfg.optim.adam_eps)
        scheduler = loop.make_scheduler(optimizer, cfg.optim, cfg.iterations * cfg.updates_per_iteration,
                                        self.accelerator.num_processes)
        engine = make_engine(roles.actor, roles.tokenizer, cfg.generation, loop.generation_dtype(cfg.precision),
                             share_weights=plan.engine_shares_weights, record_logprobs=plan.reuse_sampling_logprobs)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(policy, optimizer, scheduler)
        groups = [g["params"] for g in self.optimizer.param_groups]
        # a separate critic is its own model: each role's gradient is clipped by its own norm (as OpenRLHF and
        # veRL, which give it its own optimizer); a shared one trains the actor's backbone: one norm for all
        self.clip_groups = groups if plan.separate_critic else [[p for g in groups for p in g]]
        return engine

    # ------------------------------------------------------------------ the recipe
    def step(self, iteration: int) -> StepResult:
        cfg = self.cfg
        t0 = time.perf_counter()
        exp = self.experience.make(self.model, iteration)                       # 1. experience
        ro, mask, beta = exp.rollout, exp.rollout.response_mask, self.kl_ctl.value
        ro.rewards, ro.kl = token_rewards(                                       # 2. per-token rewards
            ro.scores, ro.old_logprobs, ro.ref_logprobs, mask, beta if cfg.kl_in_reward else 0.0, cfg.kl_estimator,
            length_coef=cfg.length_penalty,
        )
        ro.advantages, ro.returns = self.estimator(                              # 3. credit assignment
            ro.rewards, mask, values=ro.values, group_size=cfg.samples_per_prompt, gamma=cfg.gamma, lam=cfg.lam,
            greedy_scores=exp.greedy_scores, scale_rewards=cfg.scale_rewards,
        )
        if cfg.whiten:
            ro.advantages = masked_whiten(ro.advantages, mask) * mask
        t = time.perf_counter()
        update_stats = self._update(ro, iteration, beta)                         # 4. clipped updates
        self._check_weights(iteration)
        update_time = time.perf_counter() - t

        seq_kl = (kl_estimate(ro.old_logprobs, ro.ref_logprobs, "k1") * mask).sum(1)
        self.kl_ctl.update(seq_kl.mean().item(), len(ro))                       # 5. adaptive beta
        metrics = {
            "objective/score": exp.raw_scores.mean().item(),
            "objective/reward": (ro.rewards * mask).sum(1).mean().item(),
            "objective/non_score_reward": (-beta * ro.kl).sum(1).mean().item(),
            "objective/kl": seq_kl.mean().item(),
            "objective/kl_coef": beta,
            "policy/entropy": masked_mean(exp.entropy, mask).item(),
            "policy/advantage_std": ro.advantages[mask.bool()].std().item() if mask.sum() > 1 else 0.0,
            **update_stats,
            **rollout_stats(ro),
            "optim/lr": self.scheduler.get_last_lr()[0],
            **exp.timing,
            "timing/update": update_time,
            "timing/total": time.perf_counter() - t0,
        }
        metrics.update(exp.stats)
        if cfg.length_penalty:
            metrics["objective/length_penalty"] = -cfg.length_penalty * ro.lengths.mean().item()
        if exp.gold is not None:
            metrics["objective/gold"] = exp.gold.mean().item()
        for name, values in exp.monitors.items():
            metrics[f"rollout/{name}"] = values.mean().item()
        if ro.values is not None:
            metrics["value/explained_variance"] = explained_variance(ro.values, ro.returns, mask).item()
        metrics["memory/peak_rss_mb"] = peak_rss_mb()
        return StepResult(metrics, exp.sample_records(iteration))

    def _loss(self, mb: Rollout, beta: float, part: str, kept_scale: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict]:
        """The micro-batch loss of `part`: "both" (clipped policy loss - entropy bonus + KL term + value loss),
        or with a separate critic "actor" or "critic" alone; and its statistics. `kept_scale`: with
        mask_truncated_completions, the minibatch's `kept_rows_scale` (the actor's terms over the rows kept)."""
        cfg, mask = self.cfg, mb.response_mask
        agg, norm = cfg.loss_aggregation, cfg.generation.max_new_tokens
        with self.accelerator.autocast():
            logprobs, entropy, values = self.model(mb, with_entropy_grad=cfg.entropy_coef > 0, part=part)
        loss, stats = 0.0, {}
        if part != "critic":
            loss, stats = self._policy_loss(mb, beta, logprobs, entropy, kept_scale)
        if values is not None:
            vf_loss, vstats = clipped_value_loss(values, mb.values, mb.returns, mask, cfg.value_clip, agg, norm)
            loss = loss + cfg.vf_coef * vf_loss
            stats.update({"value/loss": vf_loss.detach(), "value/clipfrac": vstats["value/clipfrac"]})
        return loss, stats

    def _policy_loss(self, mb: Rollout, beta: float, logprobs, entropy, kept_scale=None) -> tuple[torch.Tensor, dict]:
        cfg, mask = self.cfg, mb.response_mask
        agg, norm = cfg.loss_aggregation, cfg.generation.max_new_tokens
        advantages, tis_stats = mb.advantages, {}
        if cfg.tis_cap is not None and mb.engine_logprobs is not None:  # TIS, see algo/offpolicy.py
            weights, tis_stats = truncated_importance_weights(mb.old_logprobs, mb.engine_logprobs, mask, cfg.tis_cap)
            advantages = advantages * weights
        keep = None
        if kept_scale is not None:  # truncated answers out of the actor's terms: a 0 advantage, entropy and KL there
            keep = mb.eos.to(mask.dtype).unsqueeze(1)
            advantages = advantages * keep
        if cfg.policy_loss == "cispo":
            loss, stats = cispo_loss(logprobs, mb.old_logprobs, advantages, mask, cfg.cispo_max_weight,
                                     cfg.cispo_min_weight, agg, ratio_level=cfg.ratio_level, norm_len=norm)
        else:
            low, high = cfg.ratio_clip
            loss, stats = clipped_policy_loss(logprobs, mb.old_logprobs, advantages, mask, low, agg,
                                              ratio_level=cfg.ratio_level, norm_len=norm, clip_high=high,
                                              dual_clip=cfg.dual_clip)
        stats.update(tis_stats)
        stats["policy/loss"] = (loss if kept_scale is None else loss * kept_scale).detach()
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * aggregate(entropy if keep is None else entropy * keep, mask, agg, norm)
        if not cfg.kl_in_reward:
            kl = kl_estimate(logprobs, mb.ref_logprobs, cfg.kl_estimator)
            kl_loss = aggregate(kl if keep is None else kl * keep, mask, agg, norm)
            loss = loss + beta * kl_loss
            stats["policy/kl_loss"] = (kl_loss if kept_scale is None else kl_loss * kept_scale).detach()
        if kept_scale is not None:  # each term's mean over the kept rows alone (algo.kept_rows_scale)
            loss = loss * kept_scale
        return loss, stats

    def _update(self, ro: Rollout, iteration: int, beta: float) -> dict[str, float]:
        """`ppo_epochs` x shuffled global minibatches x micro-batches.

        A global minibatch is `minibatch_size` rows per process; this process trains on its slice. Each
        micro-batch loss is weighted by its share of the global minibatch (tokens for token-mean, rows
        otherwise) times the process count, so that DDP's average of the processes' gradients is the
        gradient of the whole minibatch's loss; only the last micro-batch of a minibatch all-reduces.

        With a separate critic on one process each role goes through the minibatch on its own: the actor's
        forwards and backwards, the actor's step, then the critic's. The two share no weights, so the updates
        are those of one backward of the summed loss, while only one role's activations and gradients are
        held at a time (SmolLM2 x2, 16 x 96 tokens: 4.2 -> 2.7 GB of activations at the peak, and the
        actor's 0.5 GB of fp32 gradients gone before the critic's backward). Under DDP, which reduces one
        backward per forward, both go in one backward and one step.
        """
        cfg, world, rank = self.cfg, self.accelerator.num_processes, self.accelerator.process_index
        device = self.accelerator.device
        # the rollout's tensors go to the device once per update (the texts stay behind), and each micro-batch is
        # cut from that copy (`cuts` below): a blocking host-to-GPU copy per micro-batch tensor would wait each time
        # for every kernel queued before it
        rows = dataclasses.replace(ro, prompts=[], responses=[]).to(device, non_blocking=True)
        shares_prefix = self.plan.actor_shares_prefix or self.plan.critic_shares_prefix
        gen = torch.Generator().manual_seed(step_seed(cfg.seed, iteration, 2))
        size = cfg.minibatch_size * world
        minibatches = [order[i : i + size]
                       for order in (torch.randperm(len(ro), generator=gen).tolist() for _ in range(cfg.ppo_epochs))
                       for i in range(0, len(ro), size)]
        # each part: what its forward computes, and the clip groups its step clips
        parts = [("actor", [0]), ("critic", [1])] if self.plan.split_backward else \
            [("both", range(len(self.clip_groups)))]
        sums: dict[str, torch.Tensor] = {}
        norms, skipped = torch.zeros(len(self.clip_groups), dtype=torch.float64), 0
        self.model.train()
        for global_mb in minibatches:
            mine = global_mb[rank * cfg.minibatch_size : (rank + 1) * cfg.minibatch_size]
            # every micro-batch cut to the global minibatch's longest prompt and answer: the rollout's padding
            # beyond them is not paid for, and the widths (so the float arithmetic) do not depend on the split
            # of the minibatch over processes and micro-batches
            span = ro.select(global_mb).real_span()
            micro = [mine[i : i + cfg.micro_batch_size] for i in range(0, len(mine), cfg.micro_batch_size)]
            total = ro.response_mask[global_mb].sum() if cfg.loss_aggregation == "token-mean" else len(global_mb)
            kept_scale = None  # DAPO's overlong filtering: the actor's terms averaged over the answers that ended
            if cfg.mask_truncated_completions:
                kept_scale = kept_rows_scale(ro.response_mask[global_mb], ro.eos[global_mb].to(torch.float32),
                                             cfg.loss_aggregation)
            # per micro-batch, once for both roles' passes and on the host (a GPU value read here would wait for the
            # queued kernels): its rows' index, sent to the device without waiting; its share of the minibatch; the
            # length of its rows' shared prompt prefix where a forward shares it
            cuts = [(torch.tensor(idx).to(device, non_blocking=True),
                     (ro.response_mask[idx].sum() if cfg.loss_aggregation == "token-mean" else len(idx)) / total,
                     shared_prefix_length(ro.prompt_ids[idx], ro.prompt_mask[idx]) if shares_prefix else None)
                    for idx in micro]
            stepped_all = True
            for part, indices in parts:
                for k, (index, share, prefix) in enumerate(cuts):
                    mb = rows.select(index).trimmed(span)
                    mb.prefix_tokens = prefix
                    with contextlib.nullcontext() if k == len(micro) - 1 else self.accelerator.no_sync(self.model):
                        loss, stats = self._loss(mb, beta, part, kept_scale)
                        self.accelerator.backward(loss * share * world)
                        # not held through the next micro-batch's forward: it kept 70-105 MB more at the update's
                        # peak (SmolLM2 LoRA + shared head, the demo's PPO, measured on the CPU)
                        del loss
                    for name, value in stats.items():  # summed where they were computed, read once at the end
                        sums[name] = sums.get(name, 0.0) + torch.as_tensor(value, dtype=torch.float64, device=device) \
                            * float(share)
                if iteration <= cfg.critic_warmup and part != "critic":  # the actor's gradients go unused
                    for param in self.optimizer.param_groups[0]["params"]:
                        param.grad = None
                group_norms, stepped = self._clip_and_step([self.clip_groups[i] for i in indices])
                for i, value in zip(indices, group_norms):
                    norms[i] += value
                stepped_all &= stepped
            self.scheduler.step()
            skipped += not stepped_all
        self.model.eval()
        names = sorted(sums)
        values = torch.stack([sums[n] for n in names])
        if world > 1:  # each process saw its own rows: the minibatch statistics are sums over all of them
            values = self.accelerator.reduce(values, "sum")
        values = values.cpu()
        stats = {n: float(v) / len(minibatches) for n, v in zip(names, values)}
        norms = norms / len(minibatches)
        out = {**stats, "optim/grad_norm": float(norms.square().sum().sqrt()), "optim/skipped_steps": skipped,
               "optim/actor_frozen": float(iteration <= cfg.critic_warmup)}
        if self.plan.separate_critic:
            out["policy/grad_norm"], out["value/grad_norm"] = float(norms[0]), float(norms[1])
        return out

    def _clip_and_step(self, groups: list[list[torch.Tensor]]) -> tuple[list[float], bool]:
        """Clip each group of parameters by its own gradient norm, then step unless a norm is not finite (the
        step is skipped and counted). Parameters without a gradient (the other role's) are not touched."""
        max_norm = self.cfg.optim.max_grad_norm
        norms = [float(self.accelerator.clip_grad_norm_(g, max_norm if max_norm is not None else float("inf")))
                 for g in groups]
        finite = all(map(math.isfinite, norms))
        if finite:
            self.optimizer.step()
        else:
            log.warning("%s: non-finite gradient norm, update skipped", self.estimator.algorithm)
        self.optimizer.zero_grad(set_to_none=True)
        return norms, finite

    def _check_weights(self, iteration: int) -> None:
        bad = next((n for n, p in self.accelerator.unwrap_model(self.model).named_parameters()
                    if p.requires_grad and not torch.isfinite(p).all()), None)
        if bad is not None:
            raise NonFiniteWeights(
                f"{self.estimator.algorithm}: iteration {iteration} made weight {bad} non-finite (check optim.lr and "
                f"the rewards); "
                f"nothing from this iteration was saved, the newest checkpoint is the one to resume from"
            )

    # ------------------------------------------------------------------ the run
    def train(self) -> PPOResult:
        cfg, doctor = self.cfg, self.doctor
        metrics, stopped_by, iteration = {}, None, self.start_iteration
        bar = tqdm(range(self.start_iteration + 1, cfg.iterations + 1), desc=self.estimator.algorithm,
                   initial=self.start_iteration, total=cfg.iterations, disable=not (self.progress and self.main),
                   dynamic_ncols=True)
        with self._lock, MetricsLogger(self.run_dir, "ppo", tracking=cfg.tracking, params=cfg,
                                       algorithm=self.estimator.algorithm) if self.main else \
                contextlib.nullcontext() as logger:
            self.events.train_begin()
            for iteration in bar:
                result = self.step(iteration)
                metrics = result.metrics
                stop_asked = self.events.step(iteration)
                if self.main:
                    self._start_output()
                    logger.log(iteration, metrics)
                self.events.log(iteration, metrics)
                if self.main:
                    append_samples(self.run_dir, result.samples)
                    # not sharded: a best copy would hold this process's shard only
                    if self.plan.sharded is None and cfg.best_metric != "none":
                        self.best.update(iteration, metrics, self.accelerator.unwrap_model(self.model))
                bar.set_postfix(score=f"{metrics['objective/score']:.3f}", kl=f"{metrics['objective/kl']:.2f}",
                                len=f"{metrics['rollout/length_mean']:.0f}", ent=f"{metrics['policy/entropy']:.2f}")
                for finding in doctor.update(iteration, metrics):  # the same metrics on every process
                    if self.main:
                        tqdm.write(finding.format())
                if cfg.save_every and iteration % cfg.save_every == 0 and iteration < cfg.iterations:
                    self.save_checkpoint(iteration)
                if doctor.should_stop or stop_asked:
                    stopped_by = doctor.stop_reason if doctor.should_stop else "a callback"
                    if self.main:
                        tqdm.write(f"{self.estimator.algorithm}: stopping at iteration {iteration}: {stopped_by}")
                    break
            self.events.train_end()
            bar.close()
            return self._finish(iteration, metrics, stopped_by)

    def _finish(self, iteration: int, metrics: dict, stopped_by: str | None) -> PPOResult:
        if self.main:
            self._start_output()  # a resumed run that had no iteration left to run
        # save_every: 0 keeps no checkpoint, the last one neither; sharded: none (refused at start-up), the final
        # model below is full
        if self.cfg.save_every and self.plan.sharded is None:
            self.save_checkpoint(iteration)
        policy = self.accelerator.unwrap_model(self.model)
        result = PPOResult(self.run_dir, self.run_dir / "model", None, iteration, metrics, stopped_by,
                           self.extended_from)
        with sharding.saveable(self.accelerator, self.model, "actor") as actor:  # every process: a collective
            if self.main:
                save_model(actor, self.roles.tokenizer, result.model_dir, card=self._card(result))
        if self.main:
            if policy.critic is not None and policy.shared_critic:
                save_value_head(policy.critic, self.run_dir / "value_head.safetensors")
            elif policy.critic is not None:
                save_critic(policy.critic, self.run_dir / "critic")
            if self.best.iteration is not None and self.best.iteration != iteration:
                result.best_dir = self.run_dir / "best"
                current = ckpt.trainable_state(policy)
                self.best.load_into(policy)
                save_model(policy.actor, self.roles.tokenizer, result.best_dir, card=self._card(result, best=True))
                ckpt.load_trainable_state(policy, current, "current")
            diagnose_run(self.run_dir)
            summary = _summary(self.cfg, result, self.best, self._notes)
            atomic_write_text(self.run_dir / "summary.md", summary)
            print(summary)
        self.accelerator.wait_for_everyone()
        return result

    def _card(self, result: PPOResult, best: bool = False):
        """The model card of the final (or the best) policy: the last iteration's numbers (the best one's value)."""
        precision = loop.precision_name(self.cfg.precision)
        if best:
            return stage_card("ppo", self.cfg, {self.cfg.best_metric: self.best.value}, precision=precision, note=(
                f"This is the best iteration by {self.cfg.best_metric} (iteration {self.best.iteration} of "
                f"{result.iterations}); the final policy is in `model/`."))
        stopped = f" (stopped by {result.stopped_by})" if result.stopped_by else ""
        numbers = {k: result.metrics[k] for k in CARD_METRICS if k in result.metrics}
        return stage_card("ppo", self.cfg, {"iterations": f"{result.iterations}/{self.cfg.iterations}{stopped}",
                                            **numbers}, precision=precision)

    def save_checkpoint(self, iteration: int) -> Path | None:
        self.accelerator.wait_for_everyone()
        path = None
        if self.main:
            state = {  # STATE_FIELDS
                "iteration": iteration,
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "kl_ctl": self.kl_ctl.state_dict(),
                "moments": self.moments.state_dict() if self.moments else None,
                "best": self.best.state_dict(),
            }
            modules = {"policy": self.accelerator.unwrap_model(self.model)}
            path = ckpt.save_checkpoint(self.run_dir, iteration, modules, state, self.cfg.keep_checkpoints,
                                        protect=self.resumed_from)
            self.best.prune()
        self.accelerator.wait_for_everyone()
        self.events.save(path)
        return path

    def _start_output(self) -> None:
        """Write what a run writes before its metrics, once the first iteration has a result: the config and the
        marker, and the records a crashed attempt logged after the iteration this run starts from dropped (from
        metrics.jsonl and samples.jsonl alike). Nothing is written before, so a run that fails before its first
        result (a reward that raises on its first call) leaves the output folder as it was, or absent."""
        if self._output_started:
            return
        self._output_started = True
        if not self.resumed or self._config_changed:  # a resume records its allowed changes
            save_config(self.cfg, self.run_dir / "config.yaml", self._notes)
        if self.resumed:  # the run it continues is not finished any more (see `_resume`)
            (self.run_dir / "summary.md").unlink(missing_ok=True)
        write_marker(self.run_dir, "ppo")
        for name in ("metrics.jsonl", "samples.jsonl"):
            truncate_after(self.run_dir / name, "ppo", self.start_iteration)

    def _resume(self) -> None:
        # the checkpoint first: an unreadable or pickled one is the thing to say, whatever the settings
        cfg, saved = self.cfg, self.run_dir / "config.yaml"
        path, state = ckpt.load_latest(self.run_dir, {"policy": self.accelerator.unwrap_model(self.model)},
                                       required=STATE_FIELDS)
        self.resumed_from, done = path, int(state["iteration"])
        changed = ckpt.check_resume_config(saved, to_dict(cfg), RESUMABLE_CHANGES, where="ppo --resume",
                                           unset_ok=FILLED_DEFAULTS)
        # a run that has `done` iterations and wrote its summary finished them; without the summary (removed when a
        # resumed run starts, written last) it was stopped while finishing, and resuming completes that
        if done > cfg.iterations or (done == cfg.iterations and (self.run_dir / "summary.md").is_file()):
            raise ConfigError(f"ppo --resume: {self.run_dir} already has {done} iterations ({path.name}), so "
                              f"iterations={cfg.iterations} adds none; pass iterations=N with N > {done} to extend it")
        lines = saved.read_text(encoding="utf-8").splitlines()
        self._notes = [line.removeprefix("# ") for line in itertools.takewhile(lambda x: x.startswith("#"), lines)]
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.kl_ctl.load_state_dict(state["kl_ctl"])
            if self.moments is not None and state["moments"]:
                self.moments.load_state_dict(state["moments"])
            self.best.load_state_dict(state["best"])
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise ConfigError(f"{path / ckpt.STATE_JSON}: does not fit this run's optimizer or controllers ({e})") from None
        # the scheduler's state holds the step reached, not the schedule's length: from here it follows the schedule
        # of a run of cfg.iterations. The optimizer holds the lr of the schedule its checkpoint was written under (0
        # at the end of a decay) for the next step: set cfg.iterations' one, the same number when that is unchanged
        # (and when an extension that changed it stopped before this checkpoint's successor)
        lr, new_lr = self.optimizer.param_groups[0]["lr"], loop.set_scheduled_lr(self.scheduler)[0]
        if "iterations" in changed:
            old = changed["iterations"][0]
            self.extended_from = old
            kind = "extended_from" if cfg.iterations > old else "shortened_from"
            self._notes.append(
                f"ppo --resume at iteration {done}: iterations {old} -> {cfg.iterations} ({kind}: {old}); the "
                f"{cfg.optim.schedule} LR schedule rebuilt over {cfg.iterations} iterations, continuing from optimizer "
                f"step {done * cfg.updates_per_iteration} of {cfg.iterations * cfg.updates_per_iteration}: "
                f"lr {lr:.3g} -> {new_lr:.3g}")
        if changed and self.main:
            log.info("ppo --resume: %s (recorded in config.yaml)",
                     "; ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))
            if self.extended_from is not None:
                log.info("%s", self._notes[-1])
            self._config_changed = True
        self.start_iteration = done
        log.info("%s: resumed from %s (iteration %d)", self.estimator.algorithm, path, self.start_iteration)


def _no_checkpoint(run_dir: Path) -> str:
    """What to do when --resume finds no checkpoint: a finished run that kept none goes on as a new run from its
    final model (against the same reference); one stopped before it finished starts again."""
    head = f"{run_dir}: --resume given but there is no checkpoint under {run_dir / 'checkpoints'}"
    try:
        saved = read_yaml(run_dir / "config.yaml")
    except ConfigError:
        saved = {}
    why = " (it ran with save_every: 0, which keeps none)" if saved.get("save_every") == 0 else ""
    if (run_dir / "model").is_dir():
        reference = saved.get("reference") or saved.get("policy") or "<the policy it started from>"
        return (f"{head}{why}; to train its policy further, start a new run from its model: "
                f"policy={run_dir / 'model'} reference={reference} output_dir=<a new folder> (a new optimizer, "
                f"schedule and critic; with save_every > 0 that run can be extended with --resume iterations=N)")
    return f"{head}{why}; run it again without --resume (with save_every > 0 to be able to resume it)"


CARD_METRICS = ("objective/score", "objective/gold", "objective/kl", "policy/entropy", "rollout/length_mean",
                "rollout/eos_rate")
"""the last iteration's numbers a model card states"""


def _summary(cfg: PPOConfig, result: PPOResult, best: ckpt.BestTracker, notes: list[str]) -> str:
    m = result.metrics
    keys = ["objective/score", "objective/gold", "objective/kl", "objective/kl_coef", "policy/entropy",
            "policy/clipfrac", "value/loss", "value/explained_variance", "rollout/length_mean",
            "rollout/eos_rate", "rollout/distinct_2", "timing/total", "memory/peak_rss_mb"]
    run = {
        "policy / reward": f"{cfg.policy} / {cfg.reward_text}",
        "advantage estimator": f"{cfg.advantage} (G = {cfg.samples_per_prompt}), critic: {cfg.critic_kind}",
        "LoRA": cfg.lora.enabled,
        "iterations": f"{result.iterations}/{cfg.iterations}"
        + (f" (stopped by {result.stopped_by})" if result.stopped_by else ""),
        "final model": result.model_dir,
    }
    if notes:  # what resumes changed (config.yaml keeps the same lines)
        run["resumes"] = "; ".join(notes)
    if result.best_dir is not None:
        run[f"best by {cfg.best_metric}"] = f"iteration {best.iteration} ({best.value:.4g}) at {result.best_dir}"
    return loop.format_summary(f"{get_estimator(cfg.advantage).title} summary", {
        "run": run, "last iteration": {k: m[k] for k in keys if k in m},
    })


def train_ppo(cfg: PPOConfig, resume: bool = False, progress: bool = True, overwrite: bool = False,
              callbacks=None) -> PPOResult:
    return PPOTrainer(cfg, resume=resume, progress=progress, overwrite=overwrite, callbacks=callbacks).train()


def cli(args) -> int:
    cfg = load_config(PPOConfig, args.config, args.overrides, defaults=PRESETS.get(args.command))
    train_ppo(cfg, resume=getattr(args, "resume", False), overwrite=args.overwrite)
    return 0
