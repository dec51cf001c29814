"""Resumable training state, written atomically.

A checkpoint directory `checkpoints/iter-N/` holds:
    <module>.safetensors   the trainable tensors of each trained module (LoRA adapter, value head, ...)
    state.pt               optimizer, scheduler, KL controller, reward statistics, RNG states, counters
A directory appears under its final name only once every file in it is complete.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from quartet.atomic import atomic_dir
from quartet.errors import ConfigError

_ITER = re.compile(r"^iter-(\d+)$")


def trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter that is trained, by name (detached, contiguous CPU copies)."""
    return {n: p.detach().to("cpu").contiguous().clone() for n, p in module.named_parameters() if p.requires_grad}


def load_trainable_state(module: torch.nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    params = dict(module.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in state]
    unexpected = [n for n in state if n not in params]
    if missing or unexpected:
        raise ConfigError(f"{where}: checkpoint does not match the model (missing {missing[:2]}, unexpected {unexpected[:2]})")
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def save_checkpoint(run_dir: Path, iteration: int, modules: dict[str, torch.nn.Module], state: dict, keep: int) -> Path:
    """Write checkpoints/iter-<iteration>/ atomically and prune all but the newest `keep`."""
    root = Path(run_dir) / "checkpoints"
    path = root / f"iter-{iteration}"
    with atomic_dir(path) as tmp:
        for name, module in modules.items():
            if module is not None:
                save_file(trainable_state(module), str(tmp / f"{name}.safetensors"))
        torch.save({**state, "rng": rng_state()}, tmp / "state.pt")
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _ITER.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def load_checkpoint(path: Path, modules: dict[str, torch.nn.Module]) -> dict:
    """Restore module tensors from `path` and return the saved state dict (RNG restored too)."""
    path = Path(path)
    for name, module in modules.items():
        if module is None:
            continue
        file = path / f"{name}.safetensors"
        if not file.is_file():
            raise ConfigError(f"{path}: checkpoint has no {file.name}; it was written by a different setup")
        load_trainable_state(module, load_file(str(file)), str(file))
    state = torch.load(path / "state.pt", weights_only=False)
    set_rng_state(state.pop("rng"))
    return state
