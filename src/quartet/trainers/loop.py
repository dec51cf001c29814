"""Small pieces the SFT and reward-model recipes share; not a framework.

Each trainer owns its loop. From here it takes: an `Accelerator` (bf16 autocast where the hardware
has it, fp32 master weights), the run directory (atomic, main process only), AdamW with warmup +
decay, the optimizer-step count, a seeded train/eval split, a shuffled loader, the optimizer step
(clip + step + schedule), and the one-screen summary.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import transformers
from accelerate import Accelerator, PartialState
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from quartet.allocator import retain_freed_memory
from quartet.config import OptimConfig
from quartet.errors import ConfigError, DataError
from quartet.models.precision import (  # noqa: F401 (the trainers call them as loop.*; eval needs them too)
    compute_device,
    cpu_has_bf16,
    generation_dtype,
    mixed_precision,
    on_gpu,
    precision_name,
)
from quartet.outputs import staged_output

log = logging.getLogger("quartet")
SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


# --------------------------------------------------------------------------- precision + accelerator
def make_accelerator(precision: str, grad_accum: int) -> Accelerator:
    """Autocast in the compute dtype; weights and optimizer state stay fp32.

    accelerate keeps its state in a process-wide singleton; stages run one after another in one process
    (`quartet run`) may use different precisions, so the mixed-precision part is reset first (the
    distributed part, set up by `accelerate launch`, is kept).
    """
    from accelerate.state import AcceleratorState

    retain_freed_memory()  # no page faults on memory a step frees and the next takes again
    AcceleratorState._reset_state()
    # without a GPU, say so: then a multi-process launch (torchrun, or `accelerate launch` with the
    # configs/accelerate/ddp-cpu.yaml config) runs data-parallel over gloo instead of N separate runs
    timeout = process_group_timeout()
    if timeout is not None:
        # the process group is made once, by the first state of the process: made here, it takes the timeout as
        # given (accelerate's InitProcessGroupKwargs drops a value equal to its NCCL default of 600 s, leaving gloo's
        # 1800)
        PartialState(cpu=not on_gpu(), timeout=timeout)
    return Accelerator(mixed_precision=mixed_precision(precision), gradient_accumulation_steps=grad_accum,
                       cpu=not on_gpu())


DIST_TIMEOUT = "QUARTET_DIST_TIMEOUT"


def process_group_timeout() -> datetime.timedelta | None:
    """QUARTET_DIST_TIMEOUT=<seconds>: how long a process of a multi-process run waits in one collective (or at the
    rendezvous) for a peer before it stops with an error. It bounds a peer that went silent: its host powered off or
    cut off, or its process stuck. A peer whose process died is noticed at once whatever this is: its kernel closes
    its connections. Unset (None): torch's default, 30 min on gloo and 10 on NCCL. A value must outlast the longest
    wait of a healthy run: the processes' start-up (the first to import waits for the last at the process group),
    the main process writing a checkpoint or the final model while the others wait at a barrier, and one process's
    judge call (up to judge_timeout, 600 s by default) while the others wait at the experience gather."""
    text = os.environ.get(DIST_TIMEOUT)
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"{DIST_TIMEOUT}: must be a number of seconds > 0, got {text!r}")
    return datetime.timedelta(seconds=seconds)


@contextlib.contextmanager
def run_dir(output_dir: str, accelerator: Accelerator, stage: str, overwrite: bool = False) -> Iterator[Path]:
    """The run directory to write into: on the main process a temporary dir renamed onto `output_dir`
    only when the block succeeds (so a crash leaves no half-written run), under the run lock and the
    output rule of `quartet.outputs`; on other processes of a multi-process launch a scratch dir that
    is thrown away."""
    if accelerator.is_main_process:
        with staged_output(output_dir, stage, overwrite) as tmp:
            yield tmp
            accelerator.wait_for_everyone()
    else:
        with tempfile.TemporaryDirectory(prefix="quartet-rank-") as tmp:
            yield Path(tmp)
            accelerator.wait_for_everyone()


def seed_everything(seed: int) -> None:
    set_seed(seed)


# --------------------------------------------------------------------------- data
def split_train_eval(examples: list, eval_fraction: float, seed: int, eval_examples: list | None = None):
    """(train, eval): the given eval set, or a seeded random `eval_fraction` of `examples` (>= 1 row).

    Rows that share a prompt stay on one side: several answers to one prompt (AI-feedback all-pairs, K
    demonstrations) would otherwise put the same texts on both sides and flatter the held-out score. Data
    with a single prompt (nothing to group) is split by rows."""
    if eval_examples is not None:
        return list(examples), list(eval_examples)
    if eval_fraction <= 0:
        return list(examples), []
    if len(examples) < 2:
        raise DataError(f"only {len(examples)} row(s): too few to hold out an eval split (set eval_fraction: 0)")
    groups: dict[str, list[int]] = {}
    for i, ex in enumerate(examples):
        key = json.dumps(ex.prompt, sort_keys=True) if hasattr(ex, "prompt") else str(i)
        groups.setdefault(key, []).append(i)
    if len(groups) < 2:
        groups = {str(i): [i] for i in range(len(examples))}
    keys = list(groups)
    random.Random(seed).shuffle(keys)
    n_eval = min(len(examples) - 1, max(1, round(eval_fraction * len(examples))))
    held: set[int] = set()
    for key in keys:
        if len(held) >= n_eval:
            break
        if len(held) + len(groups[key]) < len(examples):  # keep at least one training row
            held.update(groups[key])
    train = [ex for i, ex in enumerate(examples) if i not in held]
    return train, [examples[i] for i in sorted(held)]


def make_loader(items: Sequence, batch_size: int, collate: Callable, shuffle: bool, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(list(items), batch_size=batch_size, shuffle=shuffle, collate_fn=collate, generator=generator)


class GroupBatches:
    """Batches of row indices made of whole groups (a prompt's pairs): groups in a seeded random order each epoch
    (`shuffle=False`: in the order they first appear), packed in that order into batches of at most `max_rows` rows;
    a group larger than that is a batch of its own.

    The number of batches follows the packing, so it may differ by a batch or two from epoch to epoch; `len` is the
    coming epoch's (the trainers count their steps from the first). No `batch_size` attribute: accelerate then shards
    the batches as they are, of any size, instead of expecting full ones."""

    def __init__(self, groups: Sequence, max_rows: int, seed: int, shuffle: bool = True):
        members: dict = {}
        for i, key in enumerate(groups):
            members.setdefault(key, []).append(i)
        self.groups = list(members.values())
        self.max_rows = max_rows
        self.shuffle = shuffle
        self.rng = random.Random(seed)
        self.coming = self._pack()

    def _pack(self) -> list[list[int]]:
        order = list(self.groups)
        if self.shuffle:
            self.rng.shuffle(order)
        batches: list[list[int]] = []
        for group in order:
            if batches and len(batches[-1]) + len(group) <= self.max_rows:
                batches[-1] = batches[-1] + group
            else:
                batches.append(list(group))
        return batches

    def __len__(self) -> int:
        return len(self.coming)

    def __iter__(self):
        batches, self.coming = self.coming, self._pack()
        return iter(batches)


def prompt_groups(examples: Sequence) -> list[str]:
    """The group of each example: its prompt (text or messages) as one key."""
    return [json.dumps(ex.prompt, sort_keys=True) for ex in examples]


def make_group_loader(items: Sequence, groups: Sequence, max_rows: int, collate: Callable, seed: int,
                      shuffle: bool = True) -> DataLoader:
    """A loader whose batches hold whole groups (`GroupBatches`)."""
    return DataLoader(list(items), batch_sampler=GroupBatches(groups, max_rows, seed, shuffle), collate_fn=collate)


def model_max_len(config, max_seq_len: int, stage: str) -> int:
    """`max_seq_len`, capped at the context length in a model's `config` (logged when it is)."""
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit and limit < max_seq_len:
        log.info("%s: max_seq_len %d exceeds the model's context %d; using %d", stage, max_seq_len, limit, limit)
        return limit
    return max_seq_len


def count_update_steps(batches_per_epoch: int, grad_accum: int, epochs: float, max_steps: int | None) -> int:
    """Optimizer steps in the run: `max_steps`, else `epochs` passes (an epoch's last partial
    accumulation still steps, as accelerate syncs at the end of the loader)."""
    if max_steps is not None:
        return max_steps
    per_epoch = math.ceil(batches_per_epoch / grad_accum)
    return max(1, math.ceil(epochs * per_epoch))


def forever(loader: DataLoader):
    """Loop over `loader` epoch after epoch (reshuffled each time)."""
    while True:
        yield from loader


# --------------------------------------------------------------------------- optimisation
def make_optimizer(model: torch.nn.Module, cfg: OptimConfig, total_steps: int, num_processes: int = 1):
    """AdamW over the trainable parameters + warmup then constant/linear/cosine decay to 0."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw(params, lr=cfg.lr, weight_decay=cfg.weight_decay, eps=cfg.adam_eps)
    return optimizer, make_scheduler(optimizer, cfg, total_steps, num_processes)


def adamw(params_or_groups, **kwargs) -> torch.optim.AdamW:
    """torch's AdamW, fused (one kernel over all tensors per step) where every parameter is a float tensor on a
    device torch has the kernel for; the default per-tensor loop otherwise (same update either way, tested).
    On a 2-core CPU a step over SmolLM2-135M's parameters takes 0.29 s fused against 0.69 s (one thread)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    groups = list(params_or_groups)
    tensors = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    devices = set(_get_fused_kernels_supported_devices())
    fused = bool(tensors) and all(t.is_floating_point() and t.device.type in devices for t in tensors)
    return torch.optim.AdamW(groups, fused=fused or None, **kwargs)


def make_scheduler(optimizer, cfg: OptimConfig, total_steps: int, num_processes: int = 1):
    """Warmup then constant/linear/cosine decay to 0 over `total_steps` optimizer steps.

    accelerate's scheduler wrapper steps the schedule once per process per optimizer step, hence the
    `num_processes` factor (without it an N-process run decays N times too fast)."""
    return transformers.get_scheduler(
        SCHEDULES[cfg.schedule],
        optimizer,
        num_warmup_steps=min(cfg.warmup_steps, total_steps) * num_processes,
        num_training_steps=total_steps * num_processes,
    )


def set_scheduled_lr(scheduler) -> list[float]:
    """Set each parameter group's lr to the schedule's value at the step the scheduler is at, and return them.

    For a resume whose schedule was rebuilt over another number of steps: a LambdaLR's state holds the step
    reached but not the schedule's length, and the optimizer's saved lr is the old schedule's (the one its next
    step would use)."""
    inner = getattr(scheduler, "scheduler", scheduler)  # accelerate's AcceleratedScheduler wraps the LambdaLR
    lrs = [base * fn(inner.last_epoch) for base, fn in zip(inner.base_lrs, inner.lr_lambdas)]
    for group, lr in zip(inner.optimizer.param_groups, lrs):
        group["lr"] = lr
    inner._last_lr = lrs
    return lrs


def optimizer_step(accelerator: Accelerator, model, optimizer, scheduler, max_grad_norm: float | None) -> float:
    """Clip (only when gradients are synced), step, schedule, zero. Returns the pre-clip grad norm (or nan)."""
    grad_norm = float("nan")
    if accelerator.sync_gradients:
        params = [p for p in model.parameters() if p.requires_grad]
        norm = accelerator.clip_grad_norm_(params, max_grad_norm if max_grad_norm is not None else float("inf"))
        grad_norm = float(norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, total


class Timer:
    def __init__(self):
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start


# --------------------------------------------------------------------------- summary
def format_summary(title: str, sections: dict[str, dict[str, object]]) -> str:
    """A one-screen markdown summary: a title, then `key: value` bullet lists per section."""
    lines = [f"# {title}", ""]
    for name, rows in sections.items():
        lines.append(f"## {name}")
        for key, value in rows.items():
            lines.append(f"- {key}: {fmt(value)}")
        lines.append("")
    return "\n".join(lines)


def fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:.4g}"
    return str(value)
