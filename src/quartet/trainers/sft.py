"""Stage 1, supervised fine-tuning: teach a causal LM the demonstrations (InstructGPT's SFT step).

The loss is next-token cross-entropy on the completion tokens only; prompt tokens are context
(labels -100). Full fine-tuning or LoRA (saved merged), AdamW + warmup + decay, bf16 autocast where
the hardware has it. The saved `model/` is the policy's start and the Reference of the later stages.

    quartet sft -c sft.yaml model=tiny:llama data.path=task:positive-review/sft max_steps=50
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from quartet.atomic import atomic_write_text
from quartet.config import SFTConfig, load_config, save_config, validate
from quartet.data import IGNORE_INDEX, encode_sft, load_sft, right_pad
from quartet.errors import DataError
from quartet.models import apply_lora, load_causal_lm, precast_lora_base, save_model
from quartet.models.card import stage_card
from quartet.monitor import MetricsLogger, Progress, peak_rss_mb
from quartet.outputs import check_output_dir
from quartet.preflight import check_names
from quartet.trainers import loop, sharding
from quartet.trainers.callbacks import CallbackHandler, check_callbacks

log = logging.getLogger("quartet")


@dataclass
class SFTResult:
    run_dir: Path
    model_dir: Path
    steps: int
    train_loss: float
    """mean loss over the last logging window"""
    eval_loss: float
    """final held-out loss per completion token (nan without an eval split)"""
    eval_ppl: float
    first_eval_loss: float
    """held-out loss before the first step"""
    seconds: float
    seconds_per_step: float


def train_sft(cfg: SFTConfig, overwrite: bool = False, callbacks=None) -> SFTResult:
    """`callbacks`: objects with on_step / on_log / on_evaluate / on_save ... (quartet.trainers.callbacks)."""
    validate(cfg)
    callbacks = check_callbacks(callbacks)
    check_output_dir(cfg.output_dir, "sft", overwrite)  # before any work (checked again when it is written)
    loop.seed_everything(cfg.seed)
    # 1. everything the user controls is read and checked before the run dir is touched, and before the model loads
    check_names("sft", cfg)
    examples = load_sft(cfg.data)
    eval_given = load_sft(cfg.eval_data) if cfg.eval_data is not None else None
    train_ex, eval_ex = loop.split_train_eval(examples, cfg.eval_fraction, cfg.seed, eval_given)
    model, tok = load_causal_lm(cfg.model, torch.float32)
    max_len = loop.model_max_len(model.config, cfg.max_seq_len, "sft")
    train_rows = encode_sft(tok, train_ex, max_len, cfg.data.chat_template)
    eval_rows = encode_sft(tok, eval_ex, max_len, (cfg.eval_data or cfg.data).chat_template) if eval_ex else []

    # 2. model, optimizer, loaders under accelerate (bf16 autocast, fp32 master weights)
    if cfg.lora.enabled:
        model = apply_lora(model, cfg.lora)
    accelerator = loop.make_accelerator(cfg.precision, grad_accum=1)  # accumulation is done by hand (_train)
    if cfg.lora.enabled and not sharding.accelerator_shards(accelerator):  # the frozen base in the autocast dtype
        precast_lora_base(model, loop.generation_dtype(cfg.precision))
    collate = _Collate(tok.pad_token_id)
    train_loader = loop.make_loader(train_rows, cfg.batch_size, collate, shuffle=True, seed=cfg.seed)
    eval_loader = loop.make_loader(eval_rows, cfg.batch_size, collate, shuffle=False)
    total = loop.count_update_steps(len(train_loader), cfg.grad_accum, cfg.epochs, cfg.max_steps)
    optimizer, scheduler = loop.make_optimizer(model, cfg.optim, total, accelerator.num_processes)
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)
    trainable, n_params = loop.count_parameters(model)
    events = CallbackHandler(callbacks, cfg, "sft", total, accelerator, model=accelerator.unwrap_model(model),
                             tokenizer=tok)

    # 3. train into a temporary run dir that replaces output_dir only when complete
    with loop.run_dir(cfg.output_dir, accelerator, "sft", overwrite) as run_dir:
        save_config(cfg, run_dir / "config.yaml")
        metrics = MetricsLogger(run_dir, "sft", tracking=cfg.tracking, params=cfg)
        try:
            first = _evaluate(model, eval_loader, accelerator)
            if eval_rows:
                metrics.log(0, {"sft/eval_loss": first, "sft/eval_ppl": _ppl(first)})
            timer = loop.Timer()
            train_loss, final, steps = _train(cfg, model, optimizer, scheduler, train_loader, eval_loader,
                                              accelerator, metrics, total, events)
            seconds = timer.seconds
        finally:
            metrics.close()
        # under FSDP / ZeRO-3 a plain copy with the gathered full weights (every process takes part)
        with sharding.saveable(accelerator, model, keep_fp32_wrapper=False) as unwrapped:
            if accelerator.is_main_process:  # the one writer (other processes' run_dir is thrown away)
                card = stage_card("sft", cfg, {"train loss": train_loss, "eval loss": final, "optimizer steps": steps},
                                  precision=loop.precision_name(cfg.precision))
                save_model(unwrapped, tok, run_dir / "model", card=card)
        result = SFTResult(
            run_dir=Path(cfg.output_dir),
            model_dir=Path(cfg.output_dir) / "model",
            steps=steps,
            train_loss=train_loss,
            eval_loss=final,
            eval_ppl=_ppl(final),
            first_eval_loss=first,
            seconds=seconds,
            seconds_per_step=seconds / steps,
        )
        summary = loop.format_summary(
            f"SFT: {cfg.model}",
            {
                "data": {
                    "train examples": len(train_rows),
                    "eval examples": len(eval_rows) if eval_rows else "none (eval_fraction 0)",
                    "cut at max_seq_len (completion end) / dropped": (
                        f"{train_rows.num_truncated} / {train_rows.num_dropped}"),
                    "max_seq_len": max_len,
                },
                "training": {
                    "mode": f"LoRA r={cfg.lora.r}" if cfg.lora.enabled else "full fine-tune",
                    "trainable parameters": f"{trainable:,} of {n_params:,}",
                    "precision": loop.precision_name(cfg.precision),
                    "optimizer steps": total if steps == total else f"{steps} of {total} (stopped by a callback)",
                    "micro-batch x grad_accum": f"{cfg.batch_size} x {cfg.grad_accum}",
                    "time": f"{seconds:.1f} s ({result.seconds_per_step:.3f} s/step)",
                    "final train loss": train_loss,
                    "peak RSS": f"{peak_rss_mb():.0f} MB",
                },
                "held-out": {
                    "eval loss (start -> end)": f"{loop.fmt(first)} -> {loop.fmt(final)}",
                    "eval perplexity (end)": result.eval_ppl,
                },
                "output": {"model (policy / reference for later stages)": result.model_dir},
            },
        )
        atomic_write_text(run_dir / "summary.md", summary)
    events.save(result.model_dir)
    if accelerator.is_main_process:
        print(summary)
    return result


def _train(cfg, model, optimizer, scheduler, train_loader, eval_loader, accelerator, metrics, total, events):
    """The loop: grad_accum micro-batches -> step; log every log_every, eval every eval_every. A callback that
    asks to stop makes the current step the last: logged and evaluated as the last one is. Returns
    (train loss, held-out loss, steps taken).

    The loss of a step is the mean over every completion token of its micro-batches on every process:
    each micro-batch's token-mean is weighted by its share of those tokens (times the process count, as
    DDP averages the processes' gradients), so N processes compute what one process with the whole batch
    computes, however the tokens fall. Only the last micro-batch of a step all-reduces.
    """
    step, final, shown = 0, float("nan"), {}
    window = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # (loss x tokens, tokens) since the last log line
    train_loss = float("nan")
    world = accelerator.num_processes
    bar = Progress(total, "sft", keys={"sft/loss": "loss", "sft/eval_loss": "eval_loss"}, every=cfg.log_every)
    model.train()
    batches = loop.forever(train_loader)
    events.train_begin()
    while step < total:
        group = [next(batches) for _ in range(cfg.grad_accum)]
        counts = [(b["labels"][:, 1:] != IGNORE_INDEX).sum() for b in group]
        tokens = _reduce(accelerator, torch.stack(counts).sum().double())
        for k, (batch, n) in enumerate(zip(group, counts)):
            with contextlib.nullcontext() if k == len(group) - 1 else accelerator.no_sync(model):
                loss = model(**batch).loss  # mean over this micro-batch's completion tokens
                accelerator.backward(loss * (n / tokens.clamp(min=1)).to(loss.dtype) * world)
            window += torch.stack([loss.detach().double() * n, n.double()])
        grad_norm = loop.optimizer_step(accelerator, model, optimizer, scheduler, cfg.optim.max_grad_norm)
        step += 1
        last = events.step(step) or step == total
        if step % cfg.log_every == 0 or last:
            total_loss, total_tokens = _reduce(accelerator, window).tolist()
            train_loss = total_loss / max(total_tokens, 1)
            window = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
            logs = {
                "sft/loss": train_loss,
                "optim/lr": scheduler.get_last_lr()[0],
                "optim/grad_norm": grad_norm,
                "memory/peak_rss_mb": peak_rss_mb(),
            }
            shown |= metrics.log(step, logs)
            events.log(step, logs)
        if len(eval_loader) and (step % cfg.eval_every == 0 or last):
            final = _evaluate(model, eval_loader, accelerator)
            logs = {"sft/eval_loss": final, "sft/eval_ppl": _ppl(final)}
            shown |= metrics.log(step, logs)
            events.log(step, logs)
            events.evaluate(logs)
            model.train()
        bar.update(step, shown)
        if last:
            break
    events.train_end()
    bar.close()
    if not math.isfinite(train_loss):
        raise DataError("SFT loss became non-finite; lower optim.lr or check the data")
    return train_loss, final, step


def _reduce(accelerator, x: torch.Tensor) -> torch.Tensor:
    """Sum over all processes (the identity in one process)."""
    return accelerator.reduce(x, "sum") if accelerator.num_processes > 1 else x


@torch.no_grad()
def _evaluate(model, loader, accelerator) -> float:
    """Held-out loss per completion token (token-weighted over the whole split)."""
    if not len(loader):
        return float("nan")
    model.eval()
    total, tokens = 0.0, 0
    for batch in loader:
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}  # the held-out loader is not prepared
        n = (batch["labels"][:, 1:] != IGNORE_INDEX).sum().item()
        out = model(**batch)
        total += out.loss.item() * n
        tokens += n
    return total / max(tokens, 1)


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 50.0)) if math.isfinite(loss) else float("nan")


class _Collate:
    """Right-pad (input_ids, labels) rows into a (B, T) batch; padding carries no loss."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows):
        input_ids, mask = right_pad([ids for ids, _ in rows], self.pad_id)
        labels, _ = right_pad([lab for _, lab in rows], IGNORE_INDEX)
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def cli(args) -> int:
    train_sft(load_config(SFTConfig, args.config, args.overrides), overwrite=args.overwrite)
    return 0
