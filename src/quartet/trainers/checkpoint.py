"""Resumable training state, written atomically, read without unpickling anything.

A checkpoint directory `checkpoints/iter-N/` holds:
    <module>.safetensors   the trainable tensors of each trained module (LoRA adapter, value head, ...)
    state.safetensors      every tensor of the training state (optimizer moments, RNG states)
    state.json             the rest of that state (counters, scheduler, KL controller, ...), with each
                           tensor replaced by a reference into state.safetensors
A directory appears under its final name only once every file in it is complete.

Nothing here calls `pickle` or `torch.load`: a crafted checkpoint can hold wrong numbers, never code.
Checkpoints of older versions (a pickled `state.pt`) are refused with a message instead of read.
This is the one module that reads checkpoints; `load_latest` falls back past a damaged newest one.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from quartet.atomic import atomic_dir
from quartet.config import read_yaml
from quartet.errors import ConfigError

log = logging.getLogger("quartet")
_ITER = re.compile(r"^iter-(\d+)$")
STATE_JSON, STATE_TENSORS, LEGACY_STATE = "state.json", "state.safetensors", "state.pt"


def trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter that is trained, by name (detached, contiguous CPU copies)."""
    return {n: p.detach().to("cpu").contiguous().clone() for n, p in module.named_parameters() if p.requires_grad}


def load_trainable_state(module: torch.nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    params = dict(module.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in state]
    unexpected = [n for n in state if n not in params]
    if missing or unexpected:
        raise ConfigError(f"{where}: checkpoint does not match the model (missing {missing[:2]}, unexpected {unexpected[:2]})")
    wrong = [n for n, v in state.items() if v.shape != params[n].shape]
    if wrong:
        raise ConfigError(f"{where}: tensor {wrong[0]} has shape {tuple(state[wrong[0]].shape)}, the model's is "
                          f"{tuple(params[wrong[0]].shape)}")
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


# --------------------------------------------------------------------------- writing
def save_checkpoint(run_dir: Path, iteration: int, modules: dict[str, torch.nn.Module], state: dict, keep: int,
                    protect: Path | None = None) -> Path:
    """Write checkpoints/iter-<iteration>/ atomically and prune all but the newest `keep` up to it.

    Pruning never removes `protect` (the checkpoint a resumed run started from: the one known to read back
    whole) nor a checkpoint newer than this one (a resumed run's predecessor got further before it stopped, and
    the folders it left are replaced as this run reaches them, not pruned in favour of older ones)."""
    root = Path(run_dir) / "checkpoints"
    path = root / f"iter-{iteration}"
    with atomic_dir(path) as tmp:
        for name, module in modules.items():
            if module is not None:
                save_file(trainable_state(module), str(tmp / f"{name}.safetensors"))
        tensors: dict[str, torch.Tensor] = {}
        tree = encode_state({**state, "rng": rng_state()}, tensors)
        save_file(tensors, str(tmp / STATE_TENSORS))
        (tmp / STATE_JSON).write_text(json.dumps(tree) + "\n", encoding="utf-8")
    upto = [p for p in list_checkpoints(run_dir) if _number(p) <= iteration]
    for old in upto[:-keep]:
        if protect is None or old.resolve() != Path(protect).resolve():
            shutil.rmtree(old, ignore_errors=True)
    return path


def _number(path: Path) -> int:
    return int(_ITER.match(path.name).group(1))


def encode_state(obj, tensors: dict[str, torch.Tensor]):
    """A JSON-able tree for `obj`; tensors go into `tensors` and are referenced by name.

    Dicts with non-string keys (optimizer state is keyed by parameter index), tuples (RNG states) and
    numpy arrays are tagged so that `decode_state` gives back the same types.
    """
    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = obj.detach().to("cpu").contiguous().clone()
        return {"__tensor__": name}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_state(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [encode_state(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode_state(v, tensors) for k, v in obj.items()}
        return {"__items__": [[encode_state(k, tensors), encode_state(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"checkpoint state: cannot store a {type(obj).__name__}")


def decode_state(tree, tensors: dict[str, torch.Tensor]):
    """The inverse of `encode_state`; a malformed tree raises ValueError."""
    if isinstance(tree, list):
        return [decode_state(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if "__tensor__" in tree:
        name = tree["__tensor__"]
        if name not in tensors:
            raise ValueError(f"refers to tensor {name!r}, which state.safetensors does not hold")
        return tensors[name]
    if "__ndarray__" in tree:
        return np.asarray(tree["__ndarray__"], dtype=np.dtype(tree["dtype"]))
    if "__tuple__" in tree:
        return tuple(decode_state(v, tensors) for v in tree["__tuple__"])
    if "__items__" in tree:
        return {_hashable(decode_state(k, tensors)): decode_state(v, tensors) for k, v in tree["__items__"]}
    return {k: decode_state(v, tensors) for k, v in tree.items()}


def _hashable(key):
    if isinstance(key, (list, dict, torch.Tensor)):
        raise ValueError(f"a dict key of type {type(key).__name__}")
    return key


# --------------------------------------------------------------------------- reading
def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _ITER.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


class InvalidState(ConfigError):
    """A state.json that reads but holds what no Quartet run writes (a hand edit): a wrong type, an iteration out
    of range, a missing field. Refused, not skipped for an older checkpoint: resuming from another one than the
    files say would be a guess."""


def read_checkpoint(path: Path, module_names: list[str], max_iteration: int | None = None,
                    required: tuple[str, ...] = ()) -> tuple[dict[str, dict], dict]:
    """Read (module tensors by module name, training state) from `path` without applying anything.

    Any missing, truncated or malformed file is a ConfigError naming it; a state whose fields are wrong (see
    `check_state`) an InvalidState naming the file and field.
    """
    path = Path(path)
    if (path / LEGACY_STATE).exists() and not (path / STATE_JSON).exists():
        raise ConfigError(
            f"{path / LEGACY_STATE}: checkpoint of an older Quartet (pickled state); it is not loaded because "
            f"unpickling a file can run code. Start a new run, or resume with the Quartet version that wrote it"
        )
    modules = {name: _read_tensors(path / f"{name}.safetensors") for name in module_names}
    tensors = _read_tensors(path / STATE_TENSORS)
    file = path / STATE_JSON
    try:
        tree = json.loads(file.read_text(encoding="utf-8"))
        state = decode_state(tree, tensors)
    except FileNotFoundError:
        raise ConfigError(f"{file}: missing from the checkpoint") from None
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"{file}: damaged or not a Quartet checkpoint state ({e})") from None
    check_state(state, file, max_iteration, ("rng", *required))
    return modules, state


def check_state(state, file: Path, max_iteration: int | None, required: tuple[str, ...]) -> None:
    """The fields a resume relies on, in type and range: `iteration` the whole number of its folder (iter-N) and
    at most `max_iteration` (the run's configured length), `best` a finite value and an iteration up to it, and
    every key in `required` present. An InvalidState naming `file` and the field otherwise."""
    if not isinstance(state, dict):
        raise InvalidState(f"{file}: not a Quartet checkpoint state (a JSON object of the training state)")
    for key in ("iteration", *required):
        if key not in state:
            raise InvalidState(f"{file}: missing field '{key}'")
    iteration = state["iteration"]
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise InvalidState(f"{file}: iteration must be a whole number >= 0, got {iteration!r}")
    folder = _ITER.match(file.parent.name)
    if folder is not None and int(folder.group(1)) != iteration:
        raise InvalidState(f"{file}: iteration {iteration} does not match its folder {file.parent.name}")
    if max_iteration is not None and iteration > max_iteration:
        raise InvalidState(f"{file}: iteration {iteration} is past the run's iterations ({max_iteration}); "
                           f"set iterations to at least {iteration} to resume it")
    best = state.get("best")
    if best is not None:
        if not isinstance(best, dict):
            raise InvalidState(f"{file}: best must be an object with value and iteration, got {best!r}")
        value, at = best.get("value"), best.get("iteration")
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise InvalidState(f"{file}: best.value must be a finite number or null, got {value!r}")
        if at is not None and (isinstance(at, bool) or not isinstance(at, int) or not 0 <= at <= iteration):
            raise InvalidState(f"{file}: best.iteration must be a whole number from 0 to {iteration} or null, "
                               f"got {at!r}")


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise ConfigError(f"{file}: missing from the checkpoint (it was written by a different setup, or deleted)")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ConfigError(f"{file}: damaged safetensors file ({str(e).splitlines()[0][:120]})") from None


def load_checkpoint(path: Path, modules: dict[str, torch.nn.Module | None]) -> dict:
    """Restore module tensors from `path` and return the saved state dict (RNG restored too)."""
    present = {k: m for k, m in modules.items() if m is not None}
    return _apply(path, present, *read_checkpoint(path, list(present)))


def _apply(path: Path, modules: dict[str, torch.nn.Module], tensors: dict[str, dict], state: dict) -> dict:
    for name, module in modules.items():
        load_trainable_state(module, tensors[name], str(Path(path) / f"{name}.safetensors"))
    try:
        set_rng_state(state.pop("rng"))
    except (TypeError, ValueError, KeyError, RuntimeError) as e:
        raise ConfigError(f"{Path(path) / STATE_JSON}: damaged RNG state ({e})") from None
    return state


def load_latest(run_dir: Path, modules: dict[str, torch.nn.Module | None], max_iteration: int | None = None,
                required: tuple[str, ...] = ()) -> tuple[Path, dict]:
    """Load the newest checkpoint that reads completely; a damaged newer one is reported and skipped.

    Raises ConfigError when there is no checkpoint, or when none can be read (naming the newest's fault), and
    InvalidState for a state that reads but is wrong (`check_state`, with `max_iteration` and `required`).
    Checkpoints are read before anything is applied, so a damaged one leaves the modules untouched.
    """
    found = list_checkpoints(run_dir)
    if not found:
        raise ConfigError(f"{run_dir}: --resume given but there is no checkpoint under {Path(run_dir) / 'checkpoints'}")
    present = {k: m for k, m in modules.items() if m is not None}
    errors = []
    for path in reversed(found):
        try:
            tensors, state = read_checkpoint(path, list(present), max_iteration, required)
        except ConfigError as e:
            if LEGACY_STATE in str(e) or isinstance(e, InvalidState):
                raise
            errors.append(e)
            log.warning("resume: skipping damaged checkpoint: %s", e)
            continue
        if errors:
            log.warning("resume: continuing from %s, the newest checkpoint that reads completely", path.name)
        return path, _apply(path, present, tensors, state)
    raise ConfigError(f"no readable checkpoint in {Path(run_dir) / 'checkpoints'}; the newest: {errors[0]}")


# --------------------------------------------------------------------------- resuming with a config
def check_resume_config(saved_file: Path, now: dict, may_change: tuple[str, ...], where: str,
                        unset_ok: tuple[str, ...] = ()) -> dict[str, tuple]:
    """A resumed run continues the run it resumes: a setting that differs from `saved_file` is refused,
    except those in `may_change` (how long to run, how often to save). `unset_ok`: settings a run written before
    Quartet filled in their defaults holds as null; null there is not a change (the checkpoint still has to fit).
    Returns the allowed changes, {setting: (saved, now)}."""
    if not Path(saved_file).is_file():
        raise ConfigError(f"{saved_file}: missing, so this run's settings are unknown; it cannot be resumed")
    saved, now = _flatten(read_yaml(saved_file)), _flatten(now)
    changed = [k for k in sorted(set(saved) | set(now))
               if saved.get(k) != now.get(k) and not (k in unset_ok and saved.get(k) is None)]
    refused = [k for k in changed if k not in may_change]
    if refused:
        k = refused[0]
        raise ConfigError(
            f"{where}: {k} was {saved.get(k)!r} in {saved_file}, now {now.get(k)!r}; a resumed run must keep "
            f"its settings (only {', '.join(may_change)} may change): set {k}={_override(saved.get(k))} to resume "
            f"it, or start a new output_dir"
        )
    return {k: (saved.get(k), now.get(k)) for k in changed}


def _override(value) -> str:
    """`value` as a command-line override writes it (YAML flow style: null, [a, b], 1.0e-05)."""
    return yaml.safe_dump([value], default_flow_style=True, width=1 << 30).strip()[1:-1]


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# --------------------------------------------------------------------------- best iteration
class BestTracker:
    """The trainable weights of the best iteration by `metric`, kept on disk (checkpoints/best-N/) rather
    than in memory or in every checkpoint's state; its (value, iteration) go into the state.

    A best found after the newest checkpoint gets its own folder, so a run killed before its next checkpoint
    resumes with the best its checkpoint names; `prune` removes the folders no checkpoint names any more.
    """

    def __init__(self, run_dir: Path, metric: str):
        self.root = Path(run_dir) / "checkpoints"
        self.metric = metric
        self.value: float | None = None
        self.iteration: int | None = None

    @property
    def dir(self) -> Path:
        return self.root / f"best-{self.iteration}"

    def update(self, iteration: int, metrics: dict, module: torch.nn.Module) -> bool:
        value = metrics.get(self.metric)
        if value is None or value != value or (self.value is not None and value <= self.value):
            return False
        with atomic_dir(self.root / f"best-{iteration}") as tmp:
            save_file(trainable_state(module), str(tmp / "weights.safetensors"))
        self.value, self.iteration = float(value), int(iteration)
        return True

    def load_into(self, module: torch.nn.Module) -> None:
        load_trainable_state(module, _read_tensors(self.dir / "weights.safetensors"), str(self.dir))

    def prune(self) -> None:
        """Delete best-N folders that neither this tracker nor any checkpoint on disk refers to."""
        named = {self.iteration}
        for path in list_checkpoints(self.root.parent):
            try:
                named.add(json.loads((path / STATE_JSON).read_text(encoding="utf-8"))["best"]["iteration"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
        for folder in self.root.glob("best-*"):
            if folder.name.removeprefix("best-") not in {str(i) for i in named if i is not None}:
                shutil.rmtree(folder, ignore_errors=True)

    def state_dict(self) -> dict:
        return {"value": self.value, "iteration": self.iteration}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.iteration = state.get("value"), state.get("iteration")
