"""Where a model computes and in which precision: the GPU when there is one, with bf16 autocast where it is native
(GPU or CPU), fp32 elsewhere.

Every stage reads it: the trainers' autocast (`mixed_precision`), the dtype of a sampling copy (`generation_dtype`:
the engines', `quartet eval`'s), the precision a run reports (`precision_name`).
"""

from __future__ import annotations

import functools
import os

import torch

from quartet.errors import ConfigError


@functools.cache
def cpu_has_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX-512 BF16 or AMX); otherwise bf16 autocast is slower.
    QUARTET_CPU_BF16=0 or 1 overrides the detection (a VM that hides the flags; or running a recipe as it runs
    on an AVX2-only CPU, in fp32)."""
    override = os.environ.get("QUARTET_CPU_BF16")
    if override is not None:
        if override not in ("0", "1"):
            raise ConfigError(f"QUARTET_CPU_BF16: must be 0 or 1, got {override!r}")
        return override == "1"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


DEVICE = "QUARTET_DEVICE"


@functools.cache
def compute_device() -> torch.device:
    """Where every stage computes: the GPU when one is visible (each process of a multi-GPU launch its own, as
    accelerate assigns it), else the CPU. QUARTET_DEVICE=cpu keeps a run on the CPU of a GPU machine; =cuda
    refuses to start without a GPU; auto (or unset) is the rule above."""
    choice = os.environ.get(DEVICE, "auto")
    if choice not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"{DEVICE}: must be auto, cpu or cuda, got {choice!r}")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{DEVICE}=cuda, but torch sees no GPU (torch {torch.__version__}, "
                          f"built for CUDA {torch.version.cuda or 'none'})")
    if choice == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local % torch.cuda.device_count())


def on_gpu() -> bool:
    return compute_device().type == "cuda"


def mixed_precision(precision: str) -> str:
    """Config precision -> accelerate's `mixed_precision` ("bf16", "fp16" or "no")."""
    cuda = on_gpu()
    if precision == "fp32":
        return "no"
    if precision == "auto":
        if cuda:
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "bf16" if cpu_has_bf16() else "no"
    if precision == "fp16" and not cuda:
        raise ConfigError("precision: fp16 needs a GPU; use bf16, fp32 or auto on CPU")
    return precision


def precision_name(precision: str) -> str:
    """The compute precision a run used, as a person reads it: "bf16", "fp16" or "fp32" (accelerate says "no")."""
    mode = mixed_precision(precision)
    return "fp32" if mode == "no" else mode


def generation_dtype(precision: str) -> torch.dtype:
    """Dtype of a sampling copy of a model (see quartet.rollout.engine)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision(precision), torch.float32)
