"""Stage 4: PPO with the four roles (Actor, Critic, Reference, Reward), InstructGPT style.

One iteration (`PPOTrainer.step`) is the recipe:
    1. sample a rollout batch of prompts; the Actor generates responses (old log-probs kept);
    2. the Reward scores each full response; missing-EOS penalty, running normalisation, clipping;
    3. the Reference gives its log-probs; per-token reward = -beta * KL, plus the score at the last token;
    4. the Critic gives values; GAE advantages and returns; advantages whitened over the batch;
    5. `ppo_epochs` passes over shuffled minibatches: clipped policy loss + vf_coef * clipped value loss
       - entropy_coef * entropy, gradient accumulation, grad-norm clipping, LR schedule;
    6. beta is updated by the KL controller; every metric is logged and the doctor reads it.

Everything random in an iteration is seeded from (seed, iteration), so a resumed run repeats exactly
what an uninterrupted one does.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from quartet.algo import (
    AdaptiveKL,
    FixedKL,
    aggregate,
    clipped_policy_loss,
    clipped_value_loss,
    explained_variance,
    gae,
    kl_estimate,
    masked_mean,
    masked_whiten,
    reinforce_advantages,
    token_rewards,
)
from quartet.atomic import atomic_write_text
from quartet.config import PPOConfig, load_config, save_config
from quartet.errors import ConfigError
from quartet.rollout.engine import make_engine
from quartet.rollout.record import Rollout
from quartet.rollout.scoring import RunningMoments, shape_scores
from quartet.trainers import checkpoint as ckpt
from quartet.trainers.loop import make_accelerator
from quartet.trainers.ppo_roles import build_roles, critic_forward, policy_forward, reference_model

log = logging.getLogger("quartet")


@dataclass
class PPOResult:
    run_dir: Path
    model_dir: Path
    best_dir: Path | None
    iterations: int
    metrics: dict = field(default_factory=dict)
    stopped_by: str | None = None


class PPOTrainer:
    """`PPOTrainer(cfg).train()`; `step(iteration)` runs one iteration and returns its metrics."""

    def __init__(self, cfg: PPOConfig, resume: bool = False, progress: bool = True):
        from quartet.data import encode_prompts, load_prompts

        cfg.validate()
        self.cfg = cfg
        self.run_dir = Path(cfg.output_dir)
        self.progress = progress
        self.start_iteration = 0
        existing = ckpt.list_checkpoints(self.run_dir)
        if existing and not resume:
            raise ConfigError(
                f"ppo.output_dir: {self.run_dir} already holds a PPO run; pass --resume to continue it "
                f"or choose another output_dir"
            )
        from quartet.monitor.doctor import LiveDoctor

        self.doctor = LiveDoctor(stop_on=cfg.stop_on, kl_target=cfg.kl_target if cfg.adaptive_kl else None)
        torch.manual_seed(cfg.seed)
        self.accelerator = make_accelerator(cfg.precision, grad_accum=1)  # accumulation is done by hand
        self.roles = build_roles(cfg)
        tok = self.roles.tokenizer

        # prompts: encoded once, sampled in a seeded order per epoch
        examples = load_prompts(cfg.prompts)
        encoded = encode_prompts(
            tok, [e.prompt for e in examples], cfg.prompts.max_prompt_tokens, cfg.prompts.truncation,
            cfg.prompts.chat_template, where=cfg.prompts.path,
        )
        self.prompts = [examples[i].prompt for i in encoded.kept]
        self.prompt_ids = encoded.input_ids
        limit = getattr(self.roles.actor.config, "max_position_embeddings", None)
        longest = max(map(len, self.prompt_ids)) + cfg.generation.max_new_tokens
        if limit is not None and longest > limit:
            raise ConfigError(
                f"ppo.prompts.max_prompt_tokens + generation.max_new_tokens = {longest} exceeds the policy's "
                f"context of {limit} tokens; lower one of them"
            )
        self._perms: dict[int, list[int]] = {}

        # optimisation: one AdamW with the actor's and the critic's parameters as two groups
        actor_params = [p for p in self.roles.actor.parameters() if p.requires_grad]
        groups = [{"params": actor_params, "lr": cfg.optim.lr}]
        critic = self.roles.critic_module
        if critic is not None:
            groups.append({"params": list(critic.parameters()), "lr": cfg.critic_lr or cfg.optim.lr})
        self.optimizer = torch.optim.AdamW(groups, weight_decay=cfg.optim.weight_decay, eps=cfg.optim.adam_eps)
        self.scheduler = _scheduler(self.optimizer, cfg)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(
            self.roles.actor, self.optimizer, self.scheduler
        )
        if critic is not None:
            critic = self.accelerator.prepare(critic)
        self.critic = critic
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]

        self.kl_ctl = AdaptiveKL(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon) if cfg.adaptive_kl else FixedKL(cfg.kl_coef)
        self.moments = RunningMoments() if cfg.reward_norm else None
        self.engine = make_engine(self.roles.actor, tok, cfg.generation, _engine_dtype(self.accelerator))
        self.best = {"value": None, "iteration": None, "state": None}
        if resume and existing:
            self._resume(existing[-1])
        elif not resume:
            save_config(cfg, self.run_dir / "config.yaml")

    # ------------------------------------------------------------------ the recipe
    def step(self, iteration: int) -> dict[str, float]:
        cfg, tok = self.cfg, self.roles.tokenizer
        t0 = time.perf_counter()
        timing = {}

        # 1. rollout: sample a prompt batch and generate with the current policy
        batch = self._batch_indices(iteration)
        from quartet.data import left_pad

        prompt_ids, prompt_mask = left_pad([self.prompt_ids[i] for i in batch], tok.pad_token_id)
        self.engine.sync(self.accelerator.unwrap_model(self.model))
        ro = self.engine.generate(prompt_ids, prompt_mask, seed=_seed(cfg.seed, iteration, 1))
        ro.prompts = [self.prompts[i] for i in batch]
        timing["timing/generate"] = time.perf_counter() - t0

        # 2. score full responses (reward model or callable), then penalties / normalisation
        t = time.perf_counter()
        raw_scores = self.roles.scorer(ro.prompts, ro.responses)
        gold = self.roles.gold(ro.prompts, ro.responses) if self.roles.gold is not None else None
        ro.scores = shape_scores(
            raw_scores, ro.eos, missing_eos_penalty=cfg.missing_eos_penalty, moments=self.moments, clip=cfg.reward_clip
        )
        timing["timing/score"] = time.perf_counter() - t

        # 3. old log-probs and values (Actor, Critic), reference log-probs (Reference)
        t = time.perf_counter()
        mask = ro.response_mask
        ro.old_logprobs, entropy, ro.values = self._no_grad_forward(ro)
        t_ref = time.perf_counter()
        ro.ref_logprobs = self._reference_logprobs(ro)
        timing["timing/reference"] = time.perf_counter() - t_ref
        beta = self.kl_ctl.value
        ro.rewards, ro.kl = token_rewards(
            ro.scores, ro.old_logprobs, ro.ref_logprobs, mask, beta if cfg.kl_in_reward else 0.0, cfg.kl_estimator
        )

        # 4. advantages: token-level GAE with the critic, or sequence-level REINFORCE
        if cfg.policy_loss == "ppo":
            ro.advantages, ro.returns = gae(ro.rewards, ro.values, mask, cfg.gamma, cfg.lam)
        else:
            seq_return = (ro.rewards * mask).sum(1)
            ro.advantages, ro.returns = reinforce_advantages(ro.rewards, mask, baseline=seq_return.mean())
        if cfg.whiten_advantages:
            ro.advantages = masked_whiten(ro.advantages, mask) * mask
        timing["timing/forward"] = t_ref - t

        # 5. PPO epochs over shuffled minibatches
        t = time.perf_counter()
        update_stats = self._update(ro, iteration, beta)
        timing["timing/update"] = time.perf_counter() - t

        # 6. KL controller and metrics
        k1 = kl_estimate(ro.old_logprobs, ro.ref_logprobs, "k1") * mask
        seq_kl = k1.sum(1)
        self.kl_ctl.update(seq_kl.mean().item(), len(ro))
        timing["timing/total"] = time.perf_counter() - t0
        metrics = {
            "objective/score": raw_scores.mean().item(),
            "objective/reward": (ro.rewards * mask).sum(1).mean().item(),
            "objective/non_score_reward": (-beta * ro.kl).sum(1).mean().item(),
            "objective/kl": seq_kl.mean().item(),
            "objective/kl_coef": beta,
            "policy/entropy": masked_mean(entropy, mask).item(),
            **update_stats,
            **_rollout_stats(ro),
            "optim/lr": self.scheduler.get_last_lr()[0],
            **timing,
        }
        if gold is not None:
            metrics["objective/gold"] = gold.mean().item()
        if ro.values is not None:
            metrics["value/explained_variance"] = explained_variance(ro.values, ro.returns, mask).item()
        metrics["memory/peak_rss_mb"] = _peak_rss_mb()
        self._write_samples(iteration, ro, raw_scores, gold)
        return metrics

    @torch.no_grad()
    def _no_grad_forward(self, ro: Rollout):
        chunks = []
        for idx in _chunks(list(range(len(ro))), self.cfg.micro_batch_size):
            mb = ro.select(idx)
            with self.accelerator.autocast():
                logprobs, entropy, values = policy_forward(
                    self.model, mb, self.cfg.generation.temperature, value_head=self.roles.value_head
                )
                if self.roles.critic is not None:
                    values = critic_forward(self.critic, mb)
            chunks.append((logprobs, entropy, values))
        cat = [torch.cat([c[i] for c in chunks]) if chunks[0][i] is not None else None for i in range(3)]
        mask = ro.response_mask
        return cat[0] * mask, cat[1] * mask, (cat[2] * mask if cat[2] is not None else None)

    @torch.no_grad()
    def _reference_logprobs(self, ro: Rollout) -> torch.Tensor:
        out = []
        with reference_model(self.roles) as ref:
            for idx in _chunks(list(range(len(ro))), self.cfg.micro_batch_size):
                with self.accelerator.autocast():
                    logprobs, _, _ = policy_forward(ref, ro.select(idx), self.cfg.generation.temperature)
                out.append(logprobs)
        return torch.cat(out) * ro.response_mask

    def _update(self, ro: Rollout, iteration: int, beta: float) -> dict[str, float]:
        cfg = self.cfg
        agg = cfg.loss_aggregation
        gen = torch.Generator().manual_seed(_seed(cfg.seed, iteration, 2))
        sums: dict[str, float] = {}
        n_updates = 0
        self.model.train()
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(len(ro), generator=gen).tolist()
            for mb_idx in _chunks(order, cfg.minibatch_size):
                mb_tokens = ro.response_mask[mb_idx].sum()
                micro = _chunks(mb_idx, cfg.micro_batch_size)
                for idx in micro:
                    mb = ro.select(idx)
                    mask = mb.response_mask
                    # weight so that accumulated micro-batch gradients equal the whole minibatch's
                    weight = (mask.sum() / mb_tokens) if agg == "token-mean" else len(idx) / len(mb_idx)
                    with self.accelerator.autocast():
                        logprobs, entropy, values = policy_forward(
                            self.model, mb, cfg.generation.temperature,
                            value_head=self.roles.value_head, with_entropy=cfg.entropy_coef > 0,
                        )
                        if self.roles.critic is not None:
                            values = critic_forward(self.critic, mb)
                    pg_loss, stats = clipped_policy_loss(logprobs, mb.old_logprobs, mb.advantages, mask, cfg.clip, agg)
                    loss = pg_loss
                    stats = {"policy/loss": pg_loss.detach(), **stats}
                    if values is not None:
                        vf_loss, vstats = clipped_value_loss(values, mb.values, mb.returns, mask, cfg.value_clip, agg)
                        loss = loss + cfg.vf_coef * vf_loss
                        stats.update({"value/loss": vf_loss.detach(), "value/clipfrac": vstats["value/clipfrac"]})
                    if cfg.entropy_coef > 0:
                        loss = loss - cfg.entropy_coef * aggregate(entropy, mask, agg)
                    if not cfg.kl_in_reward:
                        kl_loss = aggregate(kl_estimate(logprobs, mb.ref_logprobs, cfg.kl_estimator), mask, agg)
                        loss = loss + beta * kl_loss
                        stats["policy/kl_loss"] = kl_loss.detach()
                    if not torch.isfinite(loss):
                        stats["policy/loss"] = loss.detach()
                    self.accelerator.backward(loss * weight)
                    for k, v in stats.items():
                        if k != "policy/ratio":
                            sums[k] = sums.get(k, 0.0) + float(v) * float(weight)
                grad_norm = self._clip_and_step()
                sums["optim/grad_norm"] = sums.get("optim/grad_norm", 0.0) + grad_norm
                n_updates += 1
        self.model.eval()
        return {k: v / n_updates for k, v in sums.items()}

    def _clip_and_step(self) -> float:
        max_norm = self.cfg.optim.max_grad_norm
        if max_norm is not None:
            norm = self.accelerator.clip_grad_norm_(self.params, max_norm)
        else:
            grads = [p.grad.norm() for p in self.params if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack(grads)) if grads else torch.zeros(())
        norm = float(norm)
        if torch.isfinite(torch.tensor(norm)):
            self.optimizer.step()
        else:
            log.warning("ppo: non-finite gradient norm, update skipped")
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    # ------------------------------------------------------------------ the run
    def train(self) -> PPOResult:
        from quartet.monitor.metrics import MetricsLogger

        cfg, doctor = self.cfg, self.doctor
        metrics: dict = {}
        stopped_by = None
        bar = tqdm(
            range(self.start_iteration + 1, cfg.iterations + 1), desc="ppo", initial=self.start_iteration,
            total=cfg.iterations, disable=not self.progress, dynamic_ncols=True,
        )
        iteration = self.start_iteration
        with MetricsLogger(self.run_dir, "ppo") as logger:
            for iteration in bar:
                metrics = self.step(iteration)
                logger.log(iteration, metrics)
                bar.set_postfix(
                    score=f"{metrics['objective/score']:.3f}", kl=f"{metrics['objective/kl']:.2f}",
                    len=f"{metrics['rollout/length_mean']:.0f}", ent=f"{metrics['policy/entropy']:.2f}",
                )
                for finding in doctor.update(iteration, metrics):
                    tqdm.write(finding.format())
                self._track_best(iteration, metrics)
                if cfg.save_every and iteration % cfg.save_every == 0 and iteration < cfg.iterations:
                    self.save_checkpoint(iteration)
                if doctor.should_stop:
                    stopped_by = doctor.stop_reason
                    tqdm.write(f"ppo: stopping at iteration {iteration}: {stopped_by}")
                    break
        bar.close()
        return self._finish(iteration, metrics, stopped_by)

    def _finish(self, iteration: int, metrics: dict, stopped_by: str | None) -> PPOResult:
        from quartet.models import save_model

        self.save_checkpoint(iteration)
        actor = self.accelerator.unwrap_model(self.model)
        model_dir = self.run_dir / "model"
        save_model(actor, self.roles.tokenizer, model_dir)
        self._save_critic()
        best_dir = None
        if self.best["state"] is not None and self.best["iteration"] != iteration:
            best_dir = self.run_dir / "best"
            current = ckpt.trainable_state(actor)
            ckpt.load_trainable_state(actor, self.best["state"], "best")
            save_model(actor, self.roles.tokenizer, best_dir)
            ckpt.load_trainable_state(actor, current, "current")
        result = PPOResult(self.run_dir, model_dir, best_dir, iteration, metrics, stopped_by)
        from quartet.monitor.doctor import diagnose_run

        diagnose_run(self.run_dir)
        atomic_write_text(self.run_dir / "summary.md", _summary(self.cfg, result, self.best))
        print(_summary(self.cfg, result, self.best))
        return result

    def _save_critic(self) -> None:
        critic = self.roles.critic_module
        if critic is None:
            return
        if self.roles.critic is not None:
            from quartet.models import save_critic

            save_critic(self.accelerator.unwrap_model(self.critic), self.run_dir / "critic")
        else:
            from safetensors.torch import save

            from quartet.atomic import atomic_write_bytes

            atomic_write_bytes(self.run_dir / "value_head.safetensors", save(ckpt.trainable_state(critic)))

    def save_checkpoint(self, iteration: int) -> Path:
        state = {
            "iteration": iteration,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "kl_ctl": self.kl_ctl.state_dict(),
            "moments": self.moments.state_dict() if self.moments else None,
            "best": self.best,
        }
        modules = {"actor": self.accelerator.unwrap_model(self.model), "critic": self.roles.critic_module}
        return ckpt.save_checkpoint(self.run_dir, iteration, modules, state, self.cfg.keep_checkpoints)

    def _resume(self, path: Path) -> None:
        modules = {"actor": self.accelerator.unwrap_model(self.model), "critic": self.roles.critic_module}
        state = ckpt.load_checkpoint(path, modules)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        if self.moments is not None and state["moments"]:
            self.moments.load_state_dict(state["moments"])
        self.best = state["best"]
        self.start_iteration = int(state["iteration"])
        for name in ("metrics.jsonl", "samples.jsonl"):  # drop what was logged after the checkpoint
            _truncate_jsonl(self.run_dir / name, self.start_iteration)
        log.info("ppo: resumed from %s (iteration %d)", path, self.start_iteration)

    def _track_best(self, iteration: int, metrics: dict) -> None:
        value = metrics.get(self.cfg.best_metric)
        if value is None or (self.best["value"] is not None and value <= self.best["value"]):
            return
        actor = self.accelerator.unwrap_model(self.model)
        self.best = {"value": value, "iteration": iteration, "state": ckpt.trainable_state(actor)}

    def _batch_indices(self, iteration: int) -> list[int]:
        n, size = len(self.prompt_ids), self.cfg.rollout_batch_size
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        out = []
        for k in range(size):
            epoch, offset = divmod(((iteration - 1) * world + rank) * size + k, n)
            if epoch not in self._perms:
                g = torch.Generator().manual_seed(_seed(self.cfg.seed, epoch, 3))
                self._perms = {epoch: torch.randperm(n, generator=g).tolist()}
            out.append(self._perms[epoch][offset])
        return out

    def _write_samples(self, iteration: int, ro: Rollout, scores: torch.Tensor, gold: torch.Tensor | None) -> None:
        from quartet.data import prompt_text

        lines = []
        for i in range(len(ro)):
            rec = {"step": iteration, "prompt": prompt_text(ro.prompts[i]), "response": ro.responses[i],
                   "score": round(float(scores[i]), 5), "length": int(ro.response_mask[i].sum()),
                   "eos": bool(ro.eos[i])}
            if gold is not None:
                rec["gold"] = round(float(gold[i]), 5)
            lines.append(json.dumps(rec, ensure_ascii=False))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / "samples.jsonl", "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")


# ---------------------------------------------------------------------- helpers
def _seed(seed: int, iteration: int, stream: int) -> int:
    return (seed * 1_000_003 + iteration * 7919 + stream * 104_729) % (2**31)


def _chunks(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _engine_dtype(accelerator: Accelerator) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)


def _scheduler(optimizer, cfg: PPOConfig):
    from transformers import get_scheduler

    total = cfg.iterations * cfg.updates_per_iteration
    name = {"constant": "constant_with_warmup"}.get(cfg.optim.schedule, cfg.optim.schedule)
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.optim.warmup_steps, num_training_steps=total)


def _rollout_stats(ro: Rollout) -> dict[str, float]:
    from quartet.eval.stats import distinct_n, repetition_rate

    lengths = ro.lengths
    tokens = [ro.response_ids[i, : int(lengths[i])].tolist() for i in range(len(ro))]
    return {
        "rollout/length_mean": lengths.mean().item(),
        "rollout/length_max": lengths.max().item(),
        "rollout/eos_rate": ro.eos.float().mean().item(),
        "rollout/distinct_1": distinct_n(tokens, 1),
        "rollout/distinct_2": distinct_n(tokens, 2),
        "rollout/repetition": sum(repetition_rate(t) for t in tokens) / len(tokens),
    }


def _peak_rss_mb() -> float:
    from quartet.monitor.metrics import peak_rss_mb

    return peak_rss_mb()


def _truncate_jsonl(path: Path, last_step: int) -> None:
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("stage", "ppo") != "ppo" or rec.get("step", 0) <= last_step:
            kept.append(line)
    atomic_write_text(path, "".join(k + "\n" for k in kept))


def _summary(cfg: PPOConfig, result: PPOResult, best: dict) -> str:
    m = result.metrics
    keys = ["objective/score", "objective/gold", "objective/kl", "objective/kl_coef", "policy/entropy",
            "policy/clipfrac", "value/loss", "value/explained_variance", "rollout/length_mean",
            "rollout/eos_rate", "rollout/distinct_2", "timing/total", "memory/peak_rss_mb"]
    rows = "\n".join(f"| {k} | {m[k]:.4g} |" for k in keys if k in m)
    lines = [
        "# PPO summary", "",
        f"- policy: `{cfg.policy}`  reward: `{cfg.reward}`  critic: {cfg.critic}  lora: {cfg.lora.enabled}",
        f"- iterations: {result.iterations}/{cfg.iterations}" + (f" (stopped by {result.stopped_by})" if result.stopped_by else ""),
        f"- final model: `{result.model_dir}`",
    ]
    if result.best_dir is not None:
        lines.append(f"- best by {cfg.best_metric}: iteration {best['iteration']} ({best['value']:.4g}) at `{result.best_dir}`")
    lines += ["", "| last iteration | value |", "|---|---|", rows, ""]
    return "\n".join(lines)


def train_ppo(cfg: PPOConfig, resume: bool = False, progress: bool = True) -> PPOResult:
    return PPOTrainer(cfg, resume=resume, progress=progress).train()


def cli(args) -> int:
    cfg = load_config(PPOConfig, args.config, args.overrides)
    train_ppo(cfg, resume=getattr(args, "resume", False))
    return 0
