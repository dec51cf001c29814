"""Direct preference optimisation: the policy learns from preference pairs with no reward model and no sampling.

DPO (Rafailov et al. 2023) shows the KL-regularised RLHF optimum is pi* ~ pi_ref exp(r / beta), so
r = beta log(pi* / pi_ref) + const and a Bradley-Terry fit of that implicit reward to the pairs trains the
policy directly. The losses (sigmoid / ipo / hinge / simpo) are in quartet.algo.preference.

The reference's log-probs of every pair are computed once, before training (one pass over the data), so
the reference never runs in the loop; it is kept only to measure KL on a few sampled answers at each eval
(`kl_samples`; with LoRA it is the adapter-disabled policy and costs no memory).

    quartet dpo -c dpo.yaml policy=runs/sft/model data.path=runs/label/preferences.jsonl beta=0.1
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from quartet.algo import full_kl, gather_logprobs, preference_loss
from quartet.atomic import atomic_write_text
from quartet.config import DPOConfig, load_config, save_config, validate
from quartet.data import (
    IGNORE_INDEX,
    SFTExample,
    encode_prompts,
    encode_sft,
    left_pad,
    load_preferences,
    right_pad,
)
from quartet.errors import DataError
from quartet.models import apply_lora, load_causal_lm, make_reference, precast_lora_base, save_model
from quartet.models.card import stage_card
from quartet.monitor import MetricsLogger, Progress, peak_rss_mb
from quartet.outputs import check_output_dir
from quartet.preflight import check_names
from quartet.rollout.engine import sample_as_is
from quartet.rollout.record import position_ids_from_mask, response_mask_from_ids
from quartet.rollout.sampling import EVAL_STREAM, sample_seed
from quartet.trainers import loop, sharding
from quartet.trainers.callbacks import CallbackHandler, check_callbacks

log = logging.getLogger("quartet")


@dataclass
class DPOEval:
    """Held-out numbers: the loss and implicit rewards over every held-out pair, KL over sampled answers."""

    loss: float
    accuracy: float
    """share of pairs whose implicit reward ranks chosen above rejected"""
    margin: float
    chosen_reward: float
    rejected_reward: float
    chosen_logps: float
    rejected_logps: float
    kl: float | None
    """mean over `kl_samples` answers of the summed full-vocabulary KL(pi || pi_ref) per response; None when not
    measured (kl_samples: 0), and then not logged at all: a NaN in its place would read as a diverged run"""

    def metrics(self) -> dict[str, float]:
        out = {
            "dpo/eval_loss": self.loss, "rewards/eval_accuracy": self.accuracy, "rewards/eval_margins": self.margin,
            "rewards/eval_chosen": self.chosen_reward, "rewards/eval_rejected": self.rejected_reward,
            "logps/eval_chosen": self.chosen_logps, "logps/eval_rejected": self.rejected_logps,
        }  # fmt: skip
        if self.kl is not None:
            out["dpo/kl"] = self.kl
        return out


@dataclass
class DPOResult:
    run_dir: Path
    model_dir: Path
    steps: int
    train_loss: float
    """mean loss over the last logging window"""
    train: dict[str, float]
    """the last logged training metrics (dpo/loss, rewards/*, logps/*, optim/*)"""
    first_eval: DPOEval | None
    """held-out numbers before the first step (None without an eval split)"""
    eval: DPOEval | None
    seconds: float


@dataclass
class _Pair:
    """One encoded pair: ids and labels (-100 on the prompt) of both answers, and the reference's log-probs."""

    chosen: list[int]
    chosen_labels: list[int]
    rejected: list[int]
    rejected_labels: list[int]
    ref_chosen: float = 0.0
    ref_rejected: float = 0.0


def train_dpo(cfg: DPOConfig, overwrite: bool = False, callbacks=None) -> DPOResult:
    """`callbacks`: objects with on_step / on_log / on_evaluate / on_save ... (quartet.trainers.callbacks)."""
    validate(cfg)
    callbacks = check_callbacks(callbacks)
    check_output_dir(cfg.output_dir, "dpo", overwrite)  # before minutes of reference log-probs (again in run_dir)
    loop.seed_everything(cfg.seed)
    # 1. inputs first: names, pairs, model, tokens -- all before the run dir is touched
    check_names("dpo", cfg)
    examples = load_preferences(cfg.data)
    given = load_preferences(cfg.eval_data) if cfg.eval_data is not None else None
    train_ex, eval_ex = loop.split_train_eval(examples, cfg.eval_fraction, cfg.seed, given)
    model, tok = load_causal_lm(cfg.policy, torch.float32)
    max_len = loop.model_max_len(model.config, cfg.max_seq_len, "dpo")
    train_pairs = _encode(tok, train_ex, max_len, cfg.data.chat_template, cfg.data.path)
    eval_cfg = cfg.eval_data or cfg.data
    eval_pairs = _encode(tok, eval_ex, max_len, eval_cfg.chat_template, eval_cfg.path)
    probe = _kl_probe(cfg, tok, eval_ex) if cfg.kl_samples and eval_pairs else None  # KL is a held-out number

    # 2. policy, reference, and the reference's log-probs of every pair (once)
    if cfg.lora.enabled:
        model = apply_lora(model, cfg.lora)
    reference = make_reference(model, cfg.reference) if cfg.reference or probe else None
    accelerator = loop.make_accelerator(cfg.precision, cfg.grad_accum)
    sharding.refuse_unsupported(accelerator, "dpo", {"DPO (use DDP)": True})
    if cfg.lora.enabled:  # the frozen base in the autocast dtype (the adapter-disabled reference runs on it too)
        precast_lora_base(model, loop.generation_dtype(cfg.precision))
    model.to(accelerator.device)
    if reference is not None and not reference.shared:
        reference.model.to(accelerator.device)
    collate = _Collate(tok.pad_token_id)
    if cfg.loss != "simpo":  # SimPO is reference-free
        timer = loop.Timer()
        _add_reference_logps(train_pairs + eval_pairs, reference, model, collate, cfg.batch_size, accelerator)
        log.info("dpo: reference log-probs of %d pairs in %.1fs", len(train_pairs) + len(eval_pairs), timer.seconds)
    train_loader = loop.make_loader(train_pairs, cfg.batch_size, collate, shuffle=True, seed=cfg.seed)
    eval_loader = loop.make_loader(eval_pairs, cfg.batch_size, collate, shuffle=False)
    total = loop.count_update_steps(len(train_loader), cfg.grad_accum, cfg.epochs, cfg.max_steps)
    optimizer, scheduler = loop.make_optimizer(model, cfg.optim, total, accelerator.num_processes)
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)
    trainable, n_params = loop.count_parameters(model)
    events = CallbackHandler(callbacks, cfg, "dpo", total, accelerator, model=accelerator.unwrap_model(model),
                             tokenizer=tok)

    def held_out() -> DPOEval | None:
        if not eval_pairs:
            return None
        policy = accelerator.unwrap_model(model)
        kl = _sample_kl(policy, reference, probe, cfg, tok) if probe else None
        return _evaluate(cfg, policy, eval_loader, accelerator.device, kl)

    # 3. train into a temporary run dir that replaces output_dir only when complete
    with loop.run_dir(cfg.output_dir, accelerator, "dpo", overwrite) as run_dir:
        save_config(cfg, run_dir / "config.yaml")
        metrics = MetricsLogger(run_dir, "dpo", tracking=cfg.tracking, params=cfg)
        try:
            first = held_out()
            if first:
                metrics.log(0, first.metrics())
            timer = loop.Timer()
            train, final, steps = _train(cfg, model, optimizer, scheduler, train_loader, accelerator, metrics,
                                         total, held_out, events)
            seconds = timer.seconds
        finally:
            metrics.close()
        held = {"eval loss": final.loss, "eval implicit-reward accuracy": final.accuracy,
                "eval KL": final.kl} if final else {}
        card = stage_card("dpo", cfg, {"train loss": train["dpo/loss"], **held, "optimizer steps": steps},
                          precision=loop.precision_name(cfg.precision))
        save_model(accelerator.unwrap_model(model, keep_fp32_wrapper=False), tok, run_dir / "model", card=card)
        result = DPOResult(Path(cfg.output_dir), Path(cfg.output_dir) / "model", steps, train["dpo/loss"], train,
                           first, final, seconds)
        summary = _summary(cfg, result, len(train_pairs), len(eval_pairs), max_len, trainable, n_params)
        atomic_write_text(run_dir / "summary.md", summary)
    events.save(result.model_dir)
    if accelerator.is_main_process:
        print(summary)
    return result


def _train(cfg, model, optimizer, scheduler, train_loader, accelerator, metrics, total, held_out, events):
    """Micro-batches -> accumulate -> step; log every log_every, held-out pass every eval_every. A callback that
    asks to stop makes the current step the last. Returns (last train metrics, held-out eval, steps taken)."""
    step, window, train, final, shown = 0, [], {"dpo/loss": math.nan}, None, {}
    keys = {"dpo/loss": "loss", "rewards/accuracy": "acc", "rewards/eval_accuracy": "eval_acc", "dpo/kl": "kl"}
    bar = Progress(total, "dpo", keys=keys, every=cfg.log_every)
    model.train()
    events.train_begin()
    for batch in loop.forever(train_loader):
        with accelerator.accumulate(model):
            loss, stats = _loss(cfg, model, batch)
            accelerator.backward(loss)
            grad_norm = loop.optimizer_step(accelerator, model, optimizer, scheduler, cfg.optim.max_grad_norm)
        window.append({"dpo/loss": loss.item(), **{k: v.item() for k, v in stats.items()}})
        if not accelerator.sync_gradients:
            continue
        step += 1
        last = events.step(step) or step >= total
        if step % cfg.log_every == 0 or last:
            train = _global_means(window, accelerator)  # a global quantity under a multi-process launch
            window = []
            logs = {
                **train,
                "dpo/beta": cfg.beta,
                "optim/lr": scheduler.get_last_lr()[0],
                "optim/grad_norm": grad_norm,
                "memory/peak_rss_mb": peak_rss_mb(),
            }
            shown |= metrics.log(step, logs)
            events.log(step, logs)
        if step % cfg.eval_every == 0 or last:
            ev = held_out()
            if ev is not None:
                final = ev
                shown |= metrics.log(step, ev.metrics())
                events.log(step, ev.metrics())
                events.evaluate(ev.metrics())
            model.train()
        bar.update(step, shown)
        if last:
            break
    events.train_end()
    bar.close()
    if not math.isfinite(train["dpo/loss"]):
        raise DataError("DPO loss became non-finite; lower optim.lr or check the data")
    return train, final, step


def _loss(cfg: DPOConfig, model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    chosen, rejected = _sequence_logps(logits, batch["labels"], mean=cfg.loss == "simpo")
    return _preference(cfg, chosen, rejected, batch["ref_chosen"], batch["ref_rejected"])


def _preference(cfg: DPOConfig, chosen, rejected, ref_chosen, ref_rejected):
    if cfg.loss == "simpo":  # reference-free, length-normalised, with a target margin (Meng et al. 2024)
        return preference_loss(chosen, rejected, None, None, cfg.beta, "sigmoid", cfg.label_smoothing,
                               cfg.simpo_gamma)
    return preference_loss(chosen, rejected, ref_chosen, ref_rejected, cfg.beta, cfg.loss, cfg.label_smoothing)


def _sequence_logps(logits: torch.Tensor, labels: torch.Tensor, mean: bool = False):
    """(2B, T, V) logits of chosen-then-rejected rows, (2B, T) labels -> (chosen, rejected) log pi(y | x), each
    (B,): summed over the response tokens, or averaged over them when `mean`."""
    labels = labels[:, 1:]
    mask = (labels != IGNORE_INDEX).float()
    token_logps = gather_logprobs(logits[:, :-1], labels.clamp(min=0)) * mask  # (2B, T-1)
    seq = token_logps.sum(-1)
    if mean:
        seq = seq / mask.sum(-1)
    n = seq.shape[0] // 2
    return seq[:n], seq[n:]


@torch.no_grad()
def _add_reference_logps(pairs: list[_Pair], reference, policy, collate, batch_size: int, accelerator) -> None:
    """One no-grad pass: each pair's ref_chosen / ref_rejected under the reference (the starting policy when
    no separate reference is kept), in the same autocast as training so step 0 has implicit rewards of 0."""
    policy.eval()
    device = next(policy.parameters()).device
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        batch = {k: v.to(device) for k, v in collate(chunk).items()}
        with accelerator.autocast():
            if reference is not None:
                logits = reference.logits(batch["input_ids"], batch["attention_mask"])
            else:
                logits = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        chosen, rejected = _sequence_logps(logits, batch["labels"])
        for pair, c, r in zip(chunk, chosen.tolist(), rejected.tolist()):
            pair.ref_chosen, pair.ref_rejected = c, r
    policy.train()


@torch.no_grad()
def _evaluate(cfg: DPOConfig, policy, loader, device, kl: float | None) -> DPOEval:
    """The loss and implicit rewards over every held-out pair (one set, the same on every process)."""
    policy.eval()
    cols = [[], [], [], []]
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        chosen, rejected = _sequence_logps(logits, batch["labels"], mean=cfg.loss == "simpo")
        for col, x in zip(cols, (chosen, rejected, batch["ref_chosen"], batch["ref_rejected"])):
            col.append(x.float())
    loss, stats = _preference(cfg, *(torch.cat(c) for c in cols))
    s = {k: float(v) for k, v in stats.items()}
    return DPOEval(float(loss), s["rewards/accuracy"], s["rewards/margins"], s["rewards/chosen"],
                   s["rewards/rejected"], s["logps/chosen"], s["logps/rejected"], kl)


# --------------------------------------------------------------------------- KL on sampled answers
def _kl_probe(cfg: DPOConfig, tok, examples) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(prompt ids, mask, seeds) of the first `kl_samples` distinct prompts; fixed seeds, so every eval
    answers with the same random numbers and KL changes only because the policy did."""
    prompts, seen = [], set()
    for ex in examples:
        key = json.dumps(ex.prompt, sort_keys=True)
        if key not in seen:
            seen.add(key)
            prompts.append(ex.prompt)
        if len(prompts) == cfg.kl_samples:
            break
    data = cfg.eval_data or cfg.data
    enc = encode_prompts(tok, prompts, data.max_prompt_tokens, data.truncation, data.chat_template, "KL prompts")
    ids, mask = left_pad(enc.input_ids, tok.pad_token_id)
    return ids, mask, [sample_seed(cfg.seed, i, 0, stream=EVAL_STREAM) for i in range(len(enc.input_ids))]


@torch.no_grad()
def _sample_kl(policy, reference, probe, cfg: DPOConfig, tok) -> float:
    """Mean over the probe prompts of sum_t KL(pi(.|prefix) || pi_ref(.|prefix)) along the policy's own answer
    (the chain rule makes this KL(pi || pi_ref) per sequence; full-vocabulary terms are never negative)."""
    ids, mask, seeds = probe
    device = next(policy.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    gen = cfg.generation
    policy.eval()
    responses = sample_as_is(policy, tok, gen, next(policy.parameters()).dtype, ids, mask, seeds)  # (B, R)
    response_mask, _ = response_mask_from_ids(responses, tok.eos_token_id)
    input_ids = torch.cat([ids, responses], dim=1)  # (B, T)
    attention_mask = torch.cat([mask, response_mask.long()], dim=1)
    positions = position_ids_from_mask(attention_mask)
    R = responses.shape[1]
    logits = policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits
    ref_logits = reference.logits(input_ids, attention_mask, positions)
    logp = (logits[:, -R - 1 : -1].float() / gen.temperature).log_softmax(-1)  # (B, R, V)
    ref_logp = (ref_logits[:, -R - 1 : -1].float() / gen.temperature).log_softmax(-1)
    kl = full_kl(logp, ref_logp)  # (B, R)
    return float((kl * response_mask).sum(-1).mean())


# --------------------------------------------------------------------------- data
def _encode(tok, examples, max_len: int, chat_template: bool, source: str) -> list[_Pair]:
    """Both answers of each pair as policy rows (the SFT encoding: prompt, answer, EOS). A pair is dropped
    only when its prompt alone fills max_len, which holds for both answers alike."""
    if not examples:
        return []
    try:
        chosen = encode_sft(tok, [SFTExample(ex.prompt, ex.chosen) for ex in examples], max_len, chat_template)
        rejected = encode_sft(tok, [SFTExample(ex.prompt, ex.rejected) for ex in examples], max_len, chat_template)
    except DataError:
        raise DataError(f"{source}: every one of the {len(examples)} prompts fills max_seq_len={max_len} by "
                        f"itself, leaving no answer token to compare; raise max_seq_len") from None
    assert chosen.kept == rejected.kept  # the prompt decides dropping
    return [_Pair(c, cl, r, rl) for (c, cl), (r, rl) in zip(chosen, rejected)]


class _Collate:
    """B pairs -> one (2B, T) right-padded batch, chosen rows first, + the reference's log-probs (B,) each."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, pairs: list[_Pair]) -> dict[str, torch.Tensor]:
        input_ids, mask = right_pad([p.chosen for p in pairs] + [p.rejected for p in pairs], self.pad_id)
        labels, _ = right_pad([p.chosen_labels for p in pairs] + [p.rejected_labels for p in pairs], IGNORE_INDEX)
        ref = torch.tensor([[p.ref_chosen, p.ref_rejected] for p in pairs], dtype=torch.float32)
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels,
                "ref_chosen": ref[:, 0], "ref_rejected": ref[:, 1]}


def _global_means(window: list[dict], accelerator) -> dict[str, float]:
    keys = list(window[0])
    local = torch.tensor([statistics.fmean(w[k] for w in window) for k in keys], device=accelerator.device)
    return dict(zip(keys, accelerator.reduce(local, "mean").tolist()))


# --------------------------------------------------------------------------- summary
def _summary(cfg: DPOConfig, result: DPOResult, n_train, n_eval, max_len, trainable, n_params) -> str:
    ev, first = result.eval, result.first_eval
    held = {"pairs": n_eval or "none (eval_fraction 0)"}
    if ev is not None:
        held.update({
            "implicit-reward accuracy (start -> end)": f"{loop.fmt(first.accuracy)} -> {loop.fmt(ev.accuracy)}",
            "loss (start -> end)": f"{loop.fmt(first.loss)} -> {loop.fmt(ev.loss)}",
            "reward chosen / rejected / margin": f"{ev.chosen_reward:.3f} / {ev.rejected_reward:.3f} / {ev.margin:.3f}",
            "log-prob chosen / rejected": f"{ev.chosen_logps:.2f} / {ev.rejected_logps:.2f}",
        })
        if ev.kl is not None:
            held[f"KL to the reference ({cfg.kl_samples} sampled answers)"] = ev.kl
    loss = {"sigmoid": "DPO (sigmoid)", "ipo": "IPO", "hinge": "SLiC hinge", "simpo": "SimPO"}[cfg.loss]
    if cfg.label_smoothing:
        loss += f", label smoothing {cfg.label_smoothing}"
    reference = "none (SimPO)" if cfg.loss == "simpo" else cfg.reference or (
        "the adapter-disabled policy" if cfg.lora.enabled else "the starting policy")
    return loop.format_summary(
        f"DPO: {cfg.policy}",
        {
            "data": {"train pairs": n_train, "max_seq_len": max_len, "loss": f"{loss}, beta {cfg.beta}",
                     "reference": reference},
            "training": {
                "mode": f"LoRA r={cfg.lora.r}" if cfg.lora.enabled else "full fine-tune",
                "trainable parameters": f"{trainable:,} of {n_params:,}",
                "precision": loop.precision_name(cfg.precision),
                "optimizer steps": result.steps,
                "time": f"{result.seconds:.1f} s ({result.seconds / result.steps:.3f} s/step)",
                "final train loss / accuracy": f"{loop.fmt(result.train_loss)} / "
                                               f"{loop.fmt(result.train.get('rewards/accuracy', math.nan))}",
                "peak RSS": f"{peak_rss_mb():.0f} MB",
            },
            "held-out": held,
            "output": {"policy": result.model_dir},
        },
    )


def cli(args) -> int:
    train_dpo(load_config(DPOConfig, args.config, args.overrides), overwrite=getattr(args, "overwrite", False))
    return 0
