"""Stage 3, reward model: learn a scalar score from preference pairs (InstructGPT's RM step).

Bradley-Terry: P(chosen > rejected) = sigmoid(r_chosen - r_rejected), so the loss is
`-log sigmoid(r_c - r_r)`. Options: a per-pair margin subtracted inside the sigmoid (Llama 2, eq. 2)
and a small centering term `coef * (r_c + r_r)^2` that keeps scores near 0 (Eisenstein et al. 2023).
The score is read at the last real token (causal LMs) or [CLS] (encoders such as MiniLM).
After training the head's output is normalised so the SFT policy's own answers score mean 0, std 1
(the offsets are saved with the model), which keeps PPO's reward scale independent of the RM run.

    quartet rm data.path=runs/label/preferences.jsonl model=minilm normalize_policy=runs/sft/model
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from quartet.atomic import atomic_write_text
from quartet.config import DataConfig, RewardConfig, load_config, save_config, validate
from quartet.data import (
    encode_pairs,
    encode_prompts,
    left_pad,
    load_preferences,
    load_prompts,
    load_samples,
    right_pad,
)
from quartet.errors import DataError, ModelError
from quartet.eval.calibration import BUCKETS, bt_nll, calibration_table, cross_fitted, fit_temperature
from quartet.models import apply_lora, load_causal_lm, load_reward_model, save_reward_model
from quartet.models.card import stage_card
from quartet.models.loading import check_context
from quartet.monitor import MetricsLogger, Progress, peak_rss_mb
from quartet.outputs import check_output_dir
from quartet.preflight import check_names
from quartet.rollout.engine import make_engine
from quartet.trainers import loop, sharding
from quartet.trainers.callbacks import CallbackHandler, check_callbacks

log = logging.getLogger("quartet")


@dataclass
class RewardEval:
    accuracy: float
    """share of held-out pairs with r_chosen > r_rejected"""
    margin: float
    """mean r_chosen - r_rejected"""
    chosen_mean: float
    chosen_std: float
    rejected_mean: float
    rejected_std: float
    calibration: list[dict]
    """per |margin| bucket: count, accuracy, and the accuracy Bradley-Terry predicts (mean sigmoid|margin|)"""
    nll: float
    """Bradley-Terry's mean -log sigmoid(r_c - r_r) on these pairs"""
    temperature: float = 1.0
    """T fitted on all these pairs: sigmoid((r_c - r_r) / T) is the calibrated P(chosen > rejected)"""
    fold_temperatures: list[float] | None = None
    """the T fitted on each half of the pairs (split by prompt), each applied to the other half"""
    calibration_scaled: list[dict] | None = None
    """the calibration table of the margins divided by the other half's T: an out-of-sample check of T"""
    nll_scaled: float | None = None
    """the mean -log sigmoid of those cross-fitted margins"""


@dataclass
class RewardResult:
    run_dir: Path
    model_dir: Path
    steps: int
    train_loss: float
    first_eval: RewardEval | None
    eval: RewardEval | None
    """held-out metrics in raw (pre-normalisation) units; None without an eval split"""
    norm_mean: float
    norm_std: float
    normalized_on: str
    seconds: float


def train_reward(cfg: RewardConfig, overwrite: bool = False, callbacks=None) -> RewardResult:
    """`callbacks`: objects with on_step / on_log / on_evaluate / on_save ... (quartet.trainers.callbacks)."""
    validate(cfg)
    callbacks = check_callbacks(callbacks)
    check_output_dir(cfg.output_dir, "rm", overwrite)  # before any work (checked again when it is written)
    loop.seed_everything(cfg.seed)
    # 1. inputs first: names and specs, data, margins, model, tokens -- all before the run dir is touched
    check_names("rm", cfg)
    pairs = load_preferences(cfg.data)
    given = load_preferences(cfg.eval_data) if cfg.eval_data is not None else None
    train_ex, eval_ex = loop.split_train_eval(pairs, cfg.eval_fraction, cfg.seed, given)
    if cfg.margin:
        _check_margins(train_ex, cfg.data.path)
    norm_prompts = load_prompts(cfg.normalize_prompts) if cfg.normalize_prompts is not None else None
    norm_answers = _spread(load_samples(DataConfig(path=cfg.normalize_responses)), cfg.normalize_samples) \
        if cfg.normalize_responses else None
    if cfg.normalize_policy and norm_answers is None:  # it samples after training: a bad policy fails now
        try:
            model, tok = load_causal_lm(cfg.normalize_policy, torch.float32)
        except ModelError as e:
            raise ModelError(f"rm.normalize_policy: {e}") from None
        _policy_prompt_ids(cfg, model, tok, _normalization_prompts(cfg, norm_prompts, train_ex))
        del model, tok
    rm = load_reward_model(cfg.model, torch.float32)
    rm.set_normalization(0.0, 1.0)  # train on raw scores; normalised at the end
    tok = rm.tokenizer
    max_len = loop.model_max_len(rm.config, cfg.max_seq_len, "rm")
    train_rows = _encode(tok, train_ex, max_len, cfg.data.chat_template)
    eval_rows = _encode(tok, eval_ex, max_len, (cfg.eval_data or cfg.data).chat_template)

    # 2. model, optimizer, loaders under accelerate
    if cfg.lora.enabled:
        rm.model = apply_lora(rm.model, cfg.lora, task_type="SEQ_CLS")  # the score head trains fully
    accelerator = loop.make_accelerator(cfg.precision, cfg.grad_accum)
    sharding.refuse_unsupported(accelerator, "rm", {"training the reward model (use DDP)": True})
    collate = _Collate(tok.pad_token_id)
    if cfg.group_by_prompt:  # rows carry their prompt group, so the collate weighs each group the same
        groups = loop.prompt_groups(train_ex)
        train_rows = [(*row, g) for row, g in zip(train_rows, groups)]
        train_loader = loop.make_group_loader(train_rows, groups, cfg.batch_size, collate, cfg.seed)
    else:
        train_loader = loop.make_loader(train_rows, cfg.batch_size, collate, shuffle=True, seed=cfg.seed)
    # the held-out pairs a prompt at a time, its pairs in one batch: `_scores` scores each of its answers once for
    # all its pairs (eight answers' 28 pairs: 8 forwards, not 56)
    eval_groups = loop.prompt_groups(eval_ex)
    order = _prompt_by_prompt(eval_groups)
    eval_rows, eval_groups = [eval_rows[i] for i in order], [eval_groups[i] for i in order]
    eval_loader = loop.make_group_loader(eval_rows, eval_groups, cfg.batch_size, collate, cfg.seed, shuffle=False)
    total = loop.count_update_steps(len(train_loader), cfg.grad_accum, cfg.epochs, cfg.max_steps)
    optimizer, scheduler = loop.make_optimizer(rm, cfg.optim, total, accelerator.num_processes)
    rm, optimizer, train_loader, scheduler = accelerator.prepare(rm, optimizer, train_loader, scheduler)
    trainable, n_params = loop.count_parameters(rm)
    events = CallbackHandler(callbacks, cfg, "rm", total, accelerator, model=accelerator.unwrap_model(rm),
                             tokenizer=tok)

    with loop.run_dir(cfg.output_dir, accelerator, "rm", overwrite) as run_dir:
        save_config(cfg, run_dir / "config.yaml")
        metrics = MetricsLogger(run_dir, "rm", tracking=cfg.tracking, params=cfg)
        try:
            first = evaluate(rm, eval_loader, eval_groups) if eval_rows else None
            if first:
                metrics.log(0, {"rm/eval_accuracy": first.accuracy, "rm/eval_margin": first.margin})
            timer = loop.Timer()
            train_loss, final, steps = _train(cfg, rm, optimizer, scheduler, train_loader, eval_loader, eval_groups,
                                              accelerator, metrics, total, events)
            seconds = timer.seconds
        finally:
            metrics.close()
        # 3. normalise: the policy's answers (or, without a policy, the training responses) -> mean 0, std 1
        rm = accelerator.unwrap_model(rm, keep_fp32_wrapper=False)
        mean, std, normalized_on = _normalization(cfg, rm, train_ex, norm_prompts, norm_answers, max_len)
        rm.set_normalization(mean, std)
        rm.set_temperature(final.temperature if final else 1.0)
        if accelerator.is_main_process:  # the one writer (other processes' run_dir is thrown away)
            held = {"eval accuracy": final.accuracy, "eval margin": final.margin,
                    "Bradley-Terry temperature": final.temperature} if final else {}
            card = stage_card("rm", cfg, {"train loss": train_loss, **held, "optimizer steps": steps},
                              precision=loop.precision_name(cfg.precision))
            save_reward_model(rm, run_dir / "model", card=card)
        result = RewardResult(Path(cfg.output_dir), Path(cfg.output_dir) / "model", steps, train_loss,
                              first, final, mean, std, normalized_on, seconds)
        report = {"eval": asdict(final) if final else None, "bucket_edges": [str(e) for e in BUCKETS],
                  "normalization": {"mean": mean, "std": std, "on": normalized_on}}
        atomic_write_text(run_dir / "calibration.json", json.dumps(report, indent=2) + "\n")
        summary = _summary(cfg, result, len(train_rows), len(eval_rows), max_len, trainable, n_params)
        atomic_write_text(run_dir / "summary.md", summary)
    events.save(result.model_dir)
    if accelerator.is_main_process:
        print(summary)
    return result


def bradley_terry_loss(r_chosen, r_rejected, margin=None, center_coef: float = 0.0, weight=None):
    """-log sigmoid(r_c - r_r [- margin]) + center_coef * (r_c + r_r)^2, averaged; all inputs (B,).

    `weight` (B,), summing to 1: a weighted mean instead (group_by_prompt: each prompt's pairs share its weight)."""
    diff = r_chosen - r_rejected
    if margin is not None:
        diff = diff - margin

    def mean(x):
        return x.mean() if weight is None else (weight * x).sum()

    loss = mean(-F.logsigmoid(diff))
    if center_coef:
        loss = loss + center_coef * mean((r_chosen + r_rejected) ** 2)
    return loss


def group_weights(groups: list) -> torch.Tensor:
    """(B,) weights of a batch's pairs from their groups: 1 / (groups in the batch x pairs in the group), so every
    group weighs the same and its pairs share that (InstructGPT's loss: each prompt's C(K,2) comparisons summed and
    divided by C(K,2), as one batch element)."""
    sizes = {g: groups.count(g) for g in groups}
    return torch.tensor([1.0 / (len(sizes) * sizes[g]) for g in groups], dtype=torch.float32)


def _train(cfg, rm, optimizer, scheduler, train_loader, eval_loader, eval_groups, accelerator, metrics, total, events):
    """Micro-batches -> accumulate -> step; log every log_every, held-out pass every eval_every. A callback that
    asks to stop makes the current step the last. Returns (train loss, held-out eval, steps taken)."""
    step, window, final, shown = 0, [], None, {}
    train_loss = float("nan")
    bar = Progress(total, "rm", keys={"rm/loss": "loss", "rm/accuracy": "acc", "rm/eval_accuracy": "eval_acc"},
                   every=cfg.log_every)
    rm.train()
    events.train_begin()
    for batch in loop.forever(train_loader):
        with accelerator.accumulate(rm):
            r_chosen, r_rejected = _scores(rm, batch)
            loss = bradley_terry_loss(r_chosen, r_rejected, batch["margin"] if cfg.margin else None,
                                      cfg.center_coef, batch.get("weight"))
            accelerator.backward(loss)
            grad_norm = loop.optimizer_step(accelerator, rm, optimizer, scheduler, cfg.optim.max_grad_norm)
        diff = (r_chosen - r_rejected).detach()
        window.append((loss.item(), (diff > 0).float().mean().item(), diff.mean().item()))
        if not accelerator.sync_gradients:
            continue
        step += 1
        last = events.step(step) or step >= total
        if step % cfg.log_every == 0 or last:
            # means over this window's micro-batches, then over processes (equal batch sizes: the global means)
            local = torch.tensor([statistics.fmean(col) for col in zip(*window)], dtype=torch.float64,
                                 device=accelerator.device)
            if accelerator.num_processes > 1:
                local = accelerator.reduce(local, "mean")
            train_loss, acc, margin = local.tolist()
            window = []
            logs = {
                "rm/loss": train_loss,
                "rm/accuracy": acc,
                "rm/margin": margin,
                "optim/lr": scheduler.get_last_lr()[0],
                "optim/grad_norm": grad_norm,
                "memory/peak_rss_mb": peak_rss_mb(),
            }
            shown |= metrics.log(step, logs)
            events.log(step, logs)
        if len(eval_loader) and (step % cfg.eval_every == 0 or last):
            final = evaluate(rm, eval_loader, eval_groups)
            logs = {"rm/eval_accuracy": final.accuracy, "rm/eval_margin": final.margin}
            shown |= metrics.log(step, logs)
            events.log(step, logs)
            events.evaluate(logs)
            rm.train()
        bar.update(step, shown)
        if last:
            break
    events.train_end()
    bar.close()
    if not math.isfinite(train_loss):
        raise DataError("reward-model loss became non-finite; lower optim.lr or check the data")
    return train_loss, final, step


CHUNK_ROWS = 8
"""Rows per forward: the distinct sequences of a batch go through the model in chunks of similar length."""


def _scores(rm, batch, chunk_rows: int | None = None):
    """(r_chosen, r_rejected), each (B,), over the 2B stacked right-padded sequences.

    A sequence that occurs more than once in the batch is scored once: with a prompt's K answers in one batch
    (group_by_prompt) its C(K, 2) pairs need K forwards, not 2 C(K, 2) (InstructGPT's reason for that batching);
    autograd sums the gradient over its occurrences, so the loss and its gradient are those of scoring every row.
    Forwards run on chunks of `chunk_rows` distinct rows in order of length, each cut to its longest row: the
    padding a batch pays for is its chunks' and not its longest sequence's (on the demo's pairs 23% fewer tokens
    than one forward over the batch). Right padding ends every row, so a cut loses nothing but padding.
    Under DDP every process must run as many forwards as the others (each one syncs buffers), so rows are not
    deduplicated there.
    """
    device = next(rm.parameters()).device  # a held-out loader is not prepared: its batches come on the CPU
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    if isinstance(rm, torch.nn.parallel.DistributedDataParallel):
        inverse = torch.arange(ids.shape[0], device=device)
    else:
        rows, inverse = torch.unique(torch.cat([ids, mask.to(ids.dtype)], 1), dim=0, return_inverse=True)
        ids, mask = rows[:, : ids.shape[1]], rows[:, ids.shape[1] :]
    chunk_rows = chunk_rows or CHUNK_ROWS
    lengths = mask.sum(1)
    order = torch.argsort(lengths, stable=True)
    parts = []
    for chunk in order.split(chunk_rows):
        cut = max(int(lengths[chunk].max()), 1)
        parts.append(rm(ids[chunk, :cut], mask[chunk, :cut]))
    r = torch.cat(parts)[torch.argsort(order)][inverse]
    n = r.shape[0] // 2
    return r[:n], r[n:]


@torch.no_grad()
def evaluate(rm, loader, groups: list | None = None) -> RewardEval:
    """Held-out accuracy, margin, reward mean/std per side, calibration per |margin| bucket, and the temperature
    that calibrates the margins. `groups`: each pair's prompt, in the loader's order (unshuffled); the temperature
    check is cross-fitted over two halves by prompt (quartet.eval.calibration)."""
    rm.eval()
    chosen, rejected = [], []
    for batch in loader:
        c, r = _scores(rm, batch)
        chosen.append(c.float())
        rejected.append(r.float())
    c, r = torch.cat(chosen), torch.cat(rejected)
    diff = c - r
    temperature, scaled, fold_temps = 1.0, diff, []
    if bool(torch.isfinite(diff).all()):  # a diverged model: the trainer stops on its non-finite loss, one error line
        temperature = fit_temperature(diff)
        scaled, fold_temps = cross_fitted(diff, groups if groups is not None else list(range(len(diff))))
    return RewardEval(
        accuracy=float((diff > 0).float().mean()),
        margin=float(diff.mean()),
        chosen_mean=float(c.mean()),
        chosen_std=float(c.std()) if len(c) > 1 else 0.0,
        rejected_mean=float(r.mean()),
        rejected_std=float(r.std()) if len(r) > 1 else 0.0,
        calibration=calibration_table(diff, groups),
        nll=bt_nll(diff),
        temperature=temperature,
        fold_temperatures=fold_temps or None,
        calibration_scaled=calibration_table(scaled, groups) if fold_temps else None,
        nll_scaled=bt_nll(scaled) if fold_temps else None,
    )


# --------------------------------------------------------------------------- normalisation
def _normalization(cfg: RewardConfig, rm, train_ex, norm_prompts, norm_answers, max_len) -> tuple[float, float, str]:
    """(mean, std) of raw scores on the policy's answers (given, or sampled now), or on the training responses
    without a policy."""
    tok = rm.tokenizer
    if norm_answers is not None:
        ids = encode_pairs(tok, [a.prompt for a in norm_answers], [a.completion for a in norm_answers], max_len,
                           cfg.data.chat_template)
        where = f"{len(ids)} answers from {cfg.normalize_responses}"
    elif cfg.normalize_policy:
        prompts = _normalization_prompts(cfg, norm_prompts, train_ex)
        responses = _sample(cfg, prompts)
        ids = encode_pairs(tok, prompts, responses, max_len, cfg.data.chat_template)
        where = f"{len(ids)} answers of {cfg.normalize_policy}"
    else:
        rows = _encode(tok, train_ex, max_len, cfg.data.chat_template)
        ids = [c for c, _, _ in rows] + [r for _, r, _ in rows]
        where = f"the {len(ids)} training responses (normalize_policy is not set)"
        log.info("rm: normalize_policy is not set; normalising on the training responses instead")
    scores = _raw_scores(rm, ids, tok.pad_token_id, cfg.batch_size * 2)
    mean = float(scores.mean())
    std = float(scores.std()) if len(scores) > 1 else 1.0
    if not std > 1e-6:
        log.warning("rm: normalisation scores are all equal (std %.2g); keeping std = 1", std)
        std = 1.0
    return mean, std, where


def _spread(answers: list, n: int) -> list:
    """The first `n` of a policy's answers taken across prompts: every prompt's first answer, then every prompt's
    second, ..., so K answers per prompt do not fill the sample with a few prompts."""
    by_prompt: dict[str, list] = {}
    for a in answers:
        by_prompt.setdefault(json.dumps(a.prompt, sort_keys=True), []).append(a)
    rounds = max(map(len, by_prompt.values()), default=0)
    return [group[j] for j in range(rounds) for group in by_prompt.values() if j < len(group)][:n]


def _normalization_prompts(cfg: RewardConfig, norm_prompts, train_ex) -> list:
    prompts = [ex.prompt for ex in norm_prompts] if norm_prompts is not None else _unique_prompts(train_ex)
    return [prompts[i % len(prompts)] for i in range(cfg.normalize_samples)]


def _policy_prompt_ids(cfg: RewardConfig, model, tok, prompts: list) -> list[list[int]]:
    """The normalisation prompts as the policy reads them; ConfigError if they leave no room to answer."""
    pcfg = cfg.normalize_prompts or cfg.data
    enc = encode_prompts(tok, prompts, pcfg.max_prompt_tokens, "left", pcfg.chat_template, where="normalize_prompts")
    check_context(model, enc.input_ids, cfg.normalize_generation.max_new_tokens,
                  f"rm.normalize_policy '{cfg.normalize_policy}'",
                  "lower normalize_generation.max_new_tokens or the prompts' max_prompt_tokens")
    return enc.input_ids


def _sample(cfg: RewardConfig, prompts: list) -> list[str]:
    model, tok = load_causal_lm(cfg.normalize_policy, torch.float32)
    model.to(loop.compute_device())
    prompt_ids = _policy_prompt_ids(cfg, model, tok, prompts)
    engine = make_engine(model, tok, cfg.normalize_generation, loop.generation_dtype(cfg.precision))
    del model
    ids, mask = left_pad(prompt_ids, tok.pad_token_id)
    return engine.generate(ids, mask, seed=cfg.seed).responses


@torch.no_grad()
def _raw_scores(rm, ids: list[list[int]], pad_id: int, batch_size: int) -> torch.Tensor:
    rm.eval()
    out = []
    for start in range(0, len(ids), batch_size):
        input_ids, mask = right_pad(ids[start : start + batch_size], pad_id)
        device = next(rm.parameters()).device
        out.append(rm.raw_scores(input_ids.to(device), mask.to(device)).float().cpu())
    return torch.cat(out)


def _unique_prompts(examples) -> list:
    seen, out = set(), []
    for ex in examples:
        key = json.dumps(ex.prompt, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(ex.prompt)
    return out


# --------------------------------------------------------------------------- data
def _check_margins(examples, source: str) -> None:
    missing = sum(ex.margin is None for ex in examples)
    if missing:
        raise DataError(f"{source}: `margin: true` but {missing} of {len(examples)} pairs have no 'margin' "
                        f"value (add the column, or set margin: false)")


def _encode(tok, examples, max_len: int, chat_template: bool) -> list[tuple]:
    """(chosen_ids, rejected_ids, margin) per pair."""
    if not examples:
        return []
    prompts = [ex.prompt for ex in examples]
    chosen = encode_pairs(tok, prompts, [ex.chosen for ex in examples], max_len, chat_template)
    rejected = encode_pairs(tok, prompts, [ex.rejected for ex in examples], max_len, chat_template)
    return [(c, r, ex.margin or 0.0) for c, r, ex in zip(chosen, rejected, examples)]


def _prompt_by_prompt(groups: list) -> list[int]:
    """The row order that puts each prompt's pairs together, prompts in the order they first appear (stable: a
    prompt's pairs keep their order). `groups`: each row's prompt (`loop.prompt_groups`)."""
    first: dict = {}
    for i, g in enumerate(groups):
        first.setdefault(g, i)
    return sorted(range(len(groups)), key=lambda i: first[groups[i]])


class _Collate:
    """B pairs -> one (2B, T) right-padded batch, chosen rows first, + margins (B,); rows that carry a 4th element,
    their prompt group (group_by_prompt), also get loss weights (B,) (`group_weights`)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows):
        input_ids, mask = right_pad([row[0] for row in rows] + [row[1] for row in rows], self.pad_id)
        margin = torch.tensor([row[2] for row in rows], dtype=torch.float32)
        batch = {"input_ids": input_ids, "attention_mask": mask, "margin": margin}
        if len(rows[0]) > 3:
            batch["weight"] = group_weights([row[3] for row in rows])
        return batch


# --------------------------------------------------------------------------- summary
def _summary(cfg, result: RewardResult, n_train, n_eval, max_len, trainable, n_params) -> str:
    ev, first = result.eval, result.first_eval
    held = {"pairs": n_eval or "none (eval_fraction 0)"}
    if ev is not None:
        held.update({
            "accuracy (start -> end)": f"{first.accuracy:.3f} -> {ev.accuracy:.3f}",
            "mean margin r_c - r_r": ev.margin,
            "chosen reward mean / std": f"{ev.chosen_mean:.3f} / {ev.chosen_std:.3f}",
            "rejected reward mean / std": f"{ev.rejected_mean:.3f} / {ev.rejected_std:.3f}",
            "Bradley-Terry temperature T": f"{ev.temperature:.3g} (P(chosen > rejected) = sigmoid((r_c - r_r) / T); "
                                           f"saved with the model)",
            "BT log-loss raw -> / T": f"{ev.nll:.3f} -> " + (f"{ev.nll_scaled:.3f} (T cross-fitted by prompt halves: "
                                      + ", ".join(f"{t:.3g}" for t in ev.fold_temperatures) + ")"
                                      if ev.fold_temperatures else "- (one prompt: nothing to cross-fit)"),
        })
    lines = [loop.format_summary(
        f"reward model: {cfg.model}",
        {
            "data": {"train pairs": n_train, "max_seq_len": max_len,
                     "loss": "Bradley-Terry" + (" - margin" if cfg.margin else "")
                     + (f" + {cfg.center_coef} centering" if cfg.center_coef else "")
                     + (", a prompt's pairs in one batch, weighted per prompt" if cfg.group_by_prompt else "")},
            "training": {
                "mode": f"LoRA r={cfg.lora.r}" if cfg.lora.enabled else "full fine-tune",
                "trainable parameters": f"{trainable:,} of {n_params:,}",
                "precision": loop.precision_name(cfg.precision),
                "optimizer steps": result.steps,
                "time": f"{result.seconds:.1f} s ({result.seconds / result.steps:.3f} s/step)",
                "final train loss": result.train_loss,
                "peak RSS": f"{peak_rss_mb():.0f} MB",
            },
            "held-out (raw scores)": held,
            "normalisation": {"mean / std": f"{result.norm_mean:.4g} / {result.norm_std:.4g}",
                              "measured on": result.normalized_on},
            "output": {"reward model": result.model_dir},
        },
    ).rstrip()]
    if ev is not None:
        lines += ["", "## calibration (held-out, by |r_c - r_r|)", "",
                  "| margin | pairs | accuracy [95% CI, prompts as draws] | BT predicts |", "|---|---|---|---|"]
        lines += _calibration_rows(ev.calibration)
        if ev.calibration_scaled is not None:
            lines += ["", "## calibration with the temperature (held-out, by |r_c - r_r| / T, each half's margins "
                      "divided by the T fitted on the other half)", "",
                      "| margin / T | pairs | accuracy [95% CI, prompts as draws] | BT predicts |", "|---|---|---|---|"]
            lines += _calibration_rows(ev.calibration_scaled)
    return "\n".join(lines) + "\n"


def _calibration_rows(table: list[dict]) -> list[str]:
    def accuracy(b: dict) -> str:
        if b["accuracy"] is None or b.get("lo") is None:
            return loop.fmt(b["accuracy"])
        return f"{b['accuracy']:.3f} [{b['lo']:.3f}, {b['hi']:.3f}]"

    return [f"| {b['margin']} | {b['count']} | {accuracy(b)} | {loop.fmt(b['predicted'])} |" for b in table]


def cli(args) -> int:
    train_reward(load_config(RewardConfig, args.config, args.overrides), overwrite=args.overwrite)
    return 0
