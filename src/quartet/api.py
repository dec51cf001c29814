"""The Python API: trainers shaped like TRL's, on the CLI's path.

    trainer = quartet.GRPOTrainer(model, tokenizer=tok, train_dataset=rows, reward_funcs=[f, g],
                                  reward_weights=[1.0, 0.1], generation={"max_new_tokens": 32}, iterations=20)
    result = trainer.train()

Each trainer takes its stage's config (``SFTConfig``, ``GRPOConfig``, ..., or a dict) and any of its fields as
keywords, sub-configs as dicts; TRL's names too (``model``, ``args``, ``tokenizer`` / ``processing_class``,
``train_dataset``, ``eval_dataset``, ``ref_model``, ``reward_funcs``, ``reward_weights``, ``callbacks``). Models
may be names, paths or loaded transformers models with their tokenizer; data paths, lists of dicts or
``datasets.Dataset``; rewards specs or Python callables (quartet's ``(prompts, responses)`` or TRL's
``(prompts, completions, **kwargs)``).

It stays thin: objects are registered under ``memory:`` names (quartet.handles), which makes the arguments a plain
config dict; that dict goes through `config.from_dict` and `config.validate` and the stage's own function, exactly
as `quartet <stage> key=value` does, so every mistake is the ConfigError / DataError / ModelError the CLI prints
(before any model loads). A list of rewards becomes the config's ``reward_funcs`` / ``reward_weights``, as in YAML: the
weighted sum is optimised and each term is logged as ``rollout/reward_<name>``, computed once per rollout.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
import typing
import weakref

import torch

from quartet import handles
from quartet.config import (
    DataConfig,
    DPOConfig,
    GRPOConfig,
    LabelConfig,
    PPOConfig,
    RewardConfig,
    RLOOConfig,
    SFTConfig,
    from_dict,
    merge,
    read_yaml,
    validate,
)
from quartet.errors import ConfigError, DataError
from quartet.eval.evaluate import evaluate as run_eval
from quartet.monitor.rules import check_rule_names
from quartet.pipeline import PipelineConfig, wire
from quartet.pipeline import run_pipeline as run_configured_pipeline
from quartet.rollout.rewards import as_reward_fn
from quartet.trainers import ppo
from quartet.trainers.callbacks import check_callbacks
from quartet.trainers.dpo import train_dpo
from quartet.trainers.label import label as run_label
from quartet.trainers.reward import train_reward
from quartet.trainers.sft import train_sft

MODEL_FIELDS = ("model", "policy", "reference", "critic_init", "normalize_policy")
"""config fields that name a model: a loaded model object may stand there"""
REWARD_FIELDS = ("reward", "gold", "judge")
"""config fields that hold a reward spec: a callable may stand there"""


class _Objects:
    """The objects one API call registered (quartet.handles), released together when its owner goes."""

    def __init__(self, owner=None, tokenizer=None):
        self.names: list[str] = []
        self.tokenizer = tokenizer
        if owner is not None:
            weakref.finalize(owner, handles.release, self.names)

    def release(self) -> None:
        handles.release(self.names)

    def _register(self, kind: str, obj, label: str) -> str:
        name = handles.register(kind, obj, label)
        self.names.append(name)
        return name

    def model(self, value, where: str, tokenizer=None):
        """A model name as it is; a loaded model (with ``tokenizer``, or as a (model, tokenizer) pair) registered."""
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if isinstance(value, tuple) and len(value) == 2:
            value, tokenizer = value
        if not isinstance(value, torch.nn.Module):
            raise ConfigError(f"{where}: expected a model name, a path or a loaded transformers model, got "
                              f"{type(value).__name__}")
        tokenizer = tokenizer if tokenizer is not None else self.tokenizer
        if tokenizer is None:
            raise ConfigError(f"{where}: a loaded model needs its tokenizer: pass tokenizer=... (or the pair "
                              f"(model, tokenizer))")
        label = os.path.basename(str(getattr(getattr(value, "config", None), "_name_or_path", "") or "")) or \
            type(value).__name__
        return self._register("model", (value, tokenizer), label)

    def data(self, value, where: str):
        """A data section: a path, rows (a list of dicts, a datasets.Dataset), a DataConfig or its dict."""
        if value is None:
            return None
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = _fields(value)
        if isinstance(value, dict):
            return {**value, "path": self._rows(value["path"], f"{where}.path")} if "path" in value else value
        return {"path": self._rows(value, where)}

    def _rows(self, value, where: str):
        if isinstance(value, str):
            return value
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if isinstance(value, (list, tuple)):
            bad = next((i for i, row in enumerate(value) if not isinstance(row, dict)), None)
            if bad is not None:
                raise DataError(f"{where} row {bad + 1}: expected a dict, got {type(value[bad]).__name__}")
            return self._register("data", value, "rows")
        if hasattr(value, "to_list"):  # a datasets.Dataset
            return self._register("data", value, "dataset")
        raise ConfigError(f"{where}: expected a path, a list of dicts or a datasets.Dataset, got "
                          f"{type(value).__name__}")

    def reward(self, value, where: str):
        """A reward spec as it is; a callable registered."""
        if value is None or isinstance(value, str):
            return value
        if not callable(value):
            raise ConfigError(f"{where}: expected a reward spec or a callable, got {type(value).__name__}")
        name = _callable_name(value)
        as_reward_fn(value, name, where)  # its signature checked now; loading it checks again
        return self._register("reward", value, name)

    def convert(self, cls: type, data: dict, where: str = "") -> dict:
        """``data`` for ``cls`` with every object in it replaced by its registered name (sections recursively)."""
        hints = typing.get_type_hints(cls)
        out = {}
        for key, value in data.items():
            path = f"{where}.{key}" if where else str(key)
            section = _dataclass_in(hints.get(key))
            if section is DataConfig:
                value = self.data(value, path)
            elif section is not None and (isinstance(value, dict) or dataclasses.is_dataclass(value)):
                value = self.convert(section, value if isinstance(value, dict) else _fields(value), path)
            elif key in MODEL_FIELDS:
                value = self.model(value, path)
            elif key in REWARD_FIELDS:
                value = self.reward(value, path)
            elif key == "monitor_judges" and isinstance(value, dict):
                value = {k: self.reward(v, f"{path}.{k}") for k, v in value.items()}
            elif key == "reward_funcs" and isinstance(value, (list, tuple)):
                value = [self.reward(v, f"{path}[{i}]") for i, v in enumerate(value)]
            elif isinstance(value, os.PathLike):  # output_dir=Path(...)
                value = os.fspath(value)
            out[key] = value
        return out


def _base(config_class: type, stage: str, config) -> tuple[type, dict]:
    """(the config class, the fields given) from a config object or dict; another stage's config is refused (a
    PPOConfig given to GRPOTrainer would silently run PPO)."""
    if config is None:
        return config_class, {}
    if isinstance(config, dict):
        return config_class, dict(config)
    if isinstance(config, config_class):
        return type(config), _fields(config)
    raise ConfigError(f"{stage}: the config must be a {config_class.__name__} or a dict, got {type(config).__name__}")


def _dataclass_in(tp):
    """The dataclass a field holds (``X`` or ``X | None``), else None."""
    args = typing.get_args(tp) or (tp,)
    return next((a for a in args if dataclasses.is_dataclass(a)), None)


def _fields(obj) -> dict:
    """A config dataclass as a dict of its fields, sections as dicts; values are not copied (a model or a callable
    set on a field stays the object it is, for `_Objects.convert` to register)."""
    return {f.name: _fields(v) if dataclasses.is_dataclass(v := getattr(obj, f.name)) and not isinstance(v, type)
            else v for f in dataclasses.fields(obj)}


def _callable_name(fn) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    name = re.sub(r"\W+", "_", name).strip("_") or "fn"
    return name if name[0].isalpha() else f"fn_{name}"


def reward_list(funcs, weights, objects: _Objects, where: str = "reward_funcs") -> dict:
    """TRL's ``reward_funcs`` / ``reward_weights`` -> the config fields they become: one function with weight 1 is the
    ``reward`` as it is; more (or a weight) are ``reward_funcs`` (specs, callables registered) and ``reward_weights``,
    each term logged as rollout/reward_<name> (its function's name: quartet.config.stages.reward_term_names)."""
    funcs = list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]
    if not funcs:
        raise ConfigError(f"{where}: give at least one reward function or spec")
    if weights is None:
        weights = [1.0] * len(funcs)
    weights = list(weights) if isinstance(weights, (list, tuple)) else [weights]
    if len(weights) != len(funcs):
        raise ConfigError(f"reward_weights: {len(weights)} weights for {len(funcs)} reward functions (one each)")
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w):
            raise ConfigError(f"reward_weights[{i}]: must be a finite number, got {w!r}")
    specs = [objects.reward(f, f"{where}[{i}]") for i, f in enumerate(funcs)]
    if len(specs) == 1 and weights[0] == 1:
        return {"reward": specs[0]}
    return {"reward_funcs": specs, "reward_weights": [float(w) for w in weights]}


# --------------------------------------------------------------------------- trainers
class _Trainer:
    config_class: type
    stage: str
    model_field = "model"
    data_field = "data"
    aliases: dict[str, str] = {}
    """TRL keyword -> quartet field"""

    def __init__(self, model=None, args=None, *, config=None, tokenizer=None, processing_class=None,
                 train_dataset=None, eval_dataset=None, callbacks=None, overwrite: bool = False, **fields):
        if dataclasses.is_dataclass(model) and not isinstance(model, type):  # Trainer(cfg): the config first
            model, config = None, model
        if args is not None and config is not None:
            raise ConfigError(f"{self.stage}: give the config once (args= or config=)")
        config = config if config is not None else args
        tokenizer = tokenizer if tokenizer is not None else processing_class
        self.objects = _Objects(self, tokenizer)
        self.callbacks = check_callbacks(callbacks)
        self.overwrite = overwrite
        cls, data = _base(self.config_class, self.stage, config)
        given = {self.model_field: model, self.data_field: train_dataset, "eval_data": eval_dataset}
        given.update({self.aliases.get(k, k): v for k, v in fields.items()})
        if tokenizer is not None and isinstance(given.get(self.model_field), (str, os.PathLike)):
            raise ConfigError(f"{self.stage}: tokenizer= goes with a loaded model; a model given by name is loaded "
                              f"with its own tokenizer")
        self._rewards(given)
        data = merge(data, {k: v for k, v in given.items() if v is not None})
        self.config = from_dict(cls, self.objects.convert(cls, data))
        validate(self.config)

    def _rewards(self, given: dict) -> None:
        """Stages with a reward take TRL's reward_funcs / reward_weights (PPO family)."""

    def train(self):
        raise NotImplementedError


class SFTTrainer(_Trainer):
    """Stage 1, supervised fine-tuning (quartet.trainers.sft); `train()` -> SFTResult."""

    config_class, stage = SFTConfig, "sft"

    def train(self):
        return train_sft(self.config, overwrite=self.overwrite, callbacks=self.callbacks)


class RewardTrainer(_Trainer):
    """Stage 3, a Bradley-Terry reward model (quartet.trainers.reward); `train()` -> RewardResult."""

    config_class, stage = RewardConfig, "rm"

    def train(self):
        return train_reward(self.config, overwrite=self.overwrite, callbacks=self.callbacks)


class DPOTrainer(_Trainer):
    """DPO and its kin on preference pairs (quartet.trainers.dpo); `train()` -> DPOResult."""

    config_class, stage, model_field = DPOConfig, "dpo", "policy"
    aliases = {"ref_model": "reference"}

    def train(self):
        return train_dpo(self.config, overwrite=self.overwrite, callbacks=self.callbacks)


class PPOTrainer(_Trainer):
    """Stage 4 (quartet.trainers.ppo): `train()` -> PPOResult; `trainer` is then the running PPO trainer (its roles,
    `step`). ``resume=True`` continues the run in output_dir from its newest checkpoint."""

    config_class, stage, model_field, data_field = PPOConfig, "ppo", "policy", "prompts"
    aliases = {"ref_model": "reference", "reward_model": "reward"}

    def __init__(self, *args, resume: bool = False, progress: bool = True, reward_funcs=None, reward_weights=None,
                 **kwargs):
        self.resume, self.progress, self.trainer = resume, progress, None
        self._reward_funcs, self._reward_weights = reward_funcs, reward_weights
        super().__init__(*args, **kwargs)
        check_rule_names(self.config.stop_on, "ppo.stop_on")  # the doctor's rules: config knows none of them

    def _rewards(self, given: dict) -> None:
        funcs = self._reward_funcs
        if isinstance(given.get("reward"), (list, tuple)):
            if funcs is not None:
                raise ConfigError(f"{self.stage}: give the rewards once (reward= or reward_funcs=)")
            funcs = given.pop("reward")
        if funcs is None:
            if self._reward_weights is not None:
                raise ConfigError("reward_weights: given without reward_funcs")
            return
        if given.get("reward") is not None:
            raise ConfigError(f"{self.stage}: give the rewards once (reward= or reward_funcs=)")
        given.update(reward_list(funcs, self._reward_weights, self.objects))

    def train(self):
        self.trainer = ppo.PPOTrainer(self.config, resume=self.resume, progress=self.progress, overwrite=self.overwrite,
                               callbacks=self.callbacks)
        return self.trainer.train()


class GRPOTrainer(PPOTrainer):
    """PPOTrainer with GRPO's defaults (GRPOConfig: group-normalised advantages, no critic, KL as a loss term)."""

    config_class, stage = GRPOConfig, "grpo"


class RLOOTrainer(PPOTrainer):
    """PPOTrainer with RLOO's defaults (RLOOConfig: leave-one-out baseline, no critic)."""

    config_class, stage = RLOOConfig, "rloo"


# --------------------------------------------------------------------------- functions
def label(config=None, *, tokenizer=None, overwrite: bool = False, **fields):
    """Stage 2, AI feedback (quartet.trainers.label): a LabelConfig or dict, and/or its fields (policy may be a
    loaded model with tokenizer=, prompts rows, judge a callable) -> LabelResult."""
    objects = _Objects(tokenizer=tokenizer)
    try:
        cls, data = _base(LabelConfig, "label", config)
        cfg = from_dict(cls, objects.convert(cls, merge(data, fields)))
        validate(cfg)
        return run_label(cfg, overwrite=overwrite)
    finally:
        objects.release()


def evaluate(checkpoints, *, tokenizer=None, prompts="task:positive-review/eval", gold=None, relevance="auto",
             reference=None, baseline=None, **kwargs):
    """quartet.eval.evaluate with objects: checkpoints (and reference, baseline) may be loaded models (with
    tokenizer=, or (model, tokenizer) pairs), prompts rows, gold and relevance callables -> EvalResult."""
    objects = _Objects(tokenizer=tokenizer)
    try:
        items = list(checkpoints) if isinstance(checkpoints, (list, tuple)) and not _is_pair(checkpoints) \
            else [checkpoints]
        names = [objects.model(c, f"checkpoints[{i}]") for i, c in enumerate(items)]
        known = {id(c): n for c, n in zip(items, names)}  # the same object named twice is one checkpoint

        def model(value, where):
            return known.get(id(value)) or objects.model(value, where)

        relevance = relevance if relevance in ("auto", None) else objects.reward(relevance, "relevance")
        return run_eval(names, prompts=objects.data(prompts, "prompts")["path"], gold=objects.reward(gold, "gold"),
                        relevance=relevance, reference=model(reference, "reference"),
                        baseline=model(baseline, "baseline"), **kwargs)
    finally:
        objects.release()


def run_pipeline(config=None, *, force: bool = False, **fields) -> dict:
    """`quartet run` from Python: a pipeline YAML path, a dict or a PipelineConfig, and/or its fields (stage
    sections as dicts, which may hold objects as the trainers take them) -> {stage: seconds}."""
    objects = _Objects()
    try:
        if isinstance(config, PipelineConfig):  # already built (and wired) by load_pipeline or by hand
            if fields:
                raise ConfigError("run_pipeline: a PipelineConfig is run as it is; put the fields in it")
            cfg = config
        else:
            data = read_yaml(config) if isinstance(config, (str, os.PathLike)) else dict(config or {})
            data = objects.convert(PipelineConfig, merge(data, fields))
            cfg = wire(from_dict(PipelineConfig, data), data)
        validate(cfg)
        return run_configured_pipeline(cfg, force=force)
    finally:
        objects.release()


def _is_pair(value) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], torch.nn.Module)


__all__ = ["DPOTrainer", "GRPOTrainer", "PPOTrainer", "RLOOTrainer", "RewardTrainer", "SFTTrainer", "evaluate",
           "label", "reward_list", "run_pipeline"]
