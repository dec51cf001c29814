"""What a stage reads, checked before any model loads: a typo costs a second, not a model load (and, in
`quartet run`, not the hours of the stages before the one that reads it).

`stage_inputs(stage, cfg)` lists what a stage reads, each input with its config key and the check its own loader
makes, so nothing here is a second copy of a check:

- model names and dirs: `models.resolve_model` (config.json, tokenizer files, weight headers; nothing is loaded);
- reward and judge specs: `rollout.scoring.check_reward_spec` (task names, `module:function` imports, trained
  reward-model dirs); an `llm:<model>` judge: `rollout.judging.check_llm_judge` (its settings and rubric file, then
  the model resolved, or the server asked for its model list);
- data: the stage's own schema loader (the file, every row and the fields the stage needs).

A stage calls `check_names(stage, cfg)` first thing (its data it reads itself, before its model); `quartet run`
checks every input of every stage with `check_inputs`, skipping what an earlier stage of the run writes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from quartet.config import DataConfig
from quartet.config.stages import NO_JUDGE
from quartet.data.schemas import load_preferences, load_prompts, load_samples, load_sft
from quartet.errors import QuartetError
from quartet.models.names import resolve_model
from quartet.rollout.judging import check_llm_judge, is_llm_spec
from quartet.rollout.scoring import check_reward_spec


@dataclass(frozen=True)
class Input:
    key: str
    """the config key an error names, e.g. ``ppo.reward``, ``sft.data.path``"""
    value: str | None
    """the model name, reward spec or data path (None: not set, nothing to check)"""
    check: Callable[[], object]
    """the loader's own check of ``value``"""
    data: bool = False
    """a data file (checked row by row by the stage's schema loader)"""
    named: tuple[str, ...] = ()
    """settings the check's own errors name first (an `llm:` judge's `label.llm_judge.base_url: ...`): such an
    error is not prefixed with ``key`` again"""


def stage_inputs(stage: str, cfg) -> list[Input]:
    """Every input `stage` (sft, label, rm, ppo/grpo/rloo, dpo, eval) reads with config `cfg` (the stage's own
    config; for eval, `quartet run`'s eval section)."""
    stage = "ppo" if stage in ("grpo", "rloo") else stage
    out: list[Input] = []

    def model(key: str, name: str | None) -> None:
        out.append(Input(f"{stage}.{key}", name or None, lambda: resolve_model(name)))

    def reward(key: str, spec: str | None) -> None:
        out.append(Input(f"{stage}.{key}", spec or None, lambda: check_reward_spec(spec)))

    def data(key: str, dcfg: DataConfig | None, loader: Callable) -> None:
        if dcfg is not None:
            out.append(Input(f"{stage}.{key}.path", dcfg.path, lambda: loader(dcfg), data=True))

    def llm_judge(spec: str, settings) -> None:
        # the value is the model, so a judge an earlier stage of `quartet run` writes is skipped like a policy
        out.append(Input(f"{stage}.judge", spec[len("llm:"):].strip() or spec,
                         lambda: check_llm_judge(spec, settings, stage),
                         named=(f"{stage}.judge", f"{stage}.llm_judge")))

    if stage == "sft":
        model("model", cfg.model)
        data("data", cfg.data, load_sft)
        data("eval_data", cfg.eval_data, load_sft)
    elif stage == "label":
        model("policy", cfg.policy)
        if is_llm_spec(cfg.judge):
            llm_judge(cfg.judge, cfg.llm_judge)
        else:
            reward("judge", None if cfg.judge == NO_JUDGE else cfg.judge)
        data("prompts", cfg.prompts, load_prompts)
    elif stage == "rm":
        model("model", cfg.model)
        # the policy samples the normalisation's answers only when none are given
        model("normalize_policy", None if cfg.normalize_responses else cfg.normalize_policy)
        data("data", cfg.data, load_preferences)
        data("eval_data", cfg.eval_data, load_preferences)
        data("normalize_prompts", cfg.normalize_prompts, load_prompts)
        if cfg.normalize_responses:
            responses = DataConfig(path=cfg.normalize_responses)
            out.append(Input("rm.normalize_responses", responses.path, lambda: load_samples(responses), data=True))
    elif stage == "ppo":
        for key in ("policy", "reference", "critic_init"):
            model(key, getattr(cfg, key))
        if cfg.reward_funcs:  # in place of `reward`
            for i, spec in enumerate(cfg.reward_funcs):
                reward(f"reward_funcs[{i}]", spec)
        else:
            reward("reward", cfg.reward)
        reward("gold", cfg.gold)
        for name, spec in cfg.monitor_judges.items():
            reward(f"monitor_judges.{name}", spec)
        data("prompts", cfg.prompts, load_prompts)
    elif stage == "dpo":
        model("policy", cfg.policy)
        model("reference", cfg.reference)
        data("data", cfg.data, load_preferences)
        data("eval_data", cfg.eval_data, load_preferences)
    elif stage == "eval":
        prompts = DataConfig(path=cfg.prompts, limit=cfg.num_prompts)
        out.append(Input("eval.prompts", prompts.path, lambda: load_prompts(prompts), data=True))
        for i, task in enumerate(cfg.extra_tasks):
            reward(f"extra_tasks[{i}]", f"task:{task}")
        if cfg.judge:
            llm_judge(cfg.judge, cfg.llm_judge)
    else:
        raise ValueError(f"stage_inputs: unknown stage {stage!r}")
    return out


def check_inputs(inputs: Iterable[Input], skip: Iterable[str] = ()) -> None:
    """Run each input's check; the first failure is raised as its own kind of error, prefixed with the config key.
    ``skip``: paths an earlier stage of the run writes (not there yet, and Quartet's own)."""
    skip = {os.path.normpath(p) for p in skip}
    for item in inputs:
        if item.value is None or os.path.normpath(item.value) in skip:
            continue
        try:
            item.check()
        except QuartetError as e:
            raise type(e)(str(e) if str(e).startswith(item.named) else f"{item.key}: {e}") from None


def check_names(stage: str, cfg) -> None:
    """A stage's first check: every model name and reward spec it will load, before it loads the first."""
    check_inputs(i for i in stage_inputs(stage, cfg) if not i.data)
