"""Model cards: the README.md every saved model folder gets (the Hugging Face convention).

A YAML front-matter block the Hub reads (base_model, library_name, pipeline_tag, tags), then for a person: the base
model, the stages that made the model (read from the base's own card when the base is a Quartet model), the data,
the key settings, the final training numbers and, once a pipeline's evaluation ran, its numbers (`add_eval`).
transformers ignores the file: the folder still loads with `AutoModelForCausalLM.from_pretrained(dir)`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from quartet import handles
from quartet.algo.estimators import ESTIMATORS
from quartet.atomic import atomic_write_text

CARD = "README.md"
HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
           "minilm": "sentence-transformers/all-MiniLM-L6-v2"}
"""Quartet's model aliases -> the Hub models they are, for `base_model`"""

BASE = {"sft": "model", "rm": "model", "ppo": "policy", "dpo": "policy"}
"""the config field naming the model each stage starts from"""
DATA = {
    "sft": {"demonstrations": "data.path", "held-out demonstrations": "eval_data.path"},
    "rm": {"preference pairs": "data.path", "held-out pairs": "eval_data.path"},
    "ppo": {"prompts": "prompts.path", "reward": "reward_text", "reference": "reference"},
    "dpo": {"preference pairs": "data.path", "held-out pairs": "eval_data.path", "reference": "reference"},
}
"""what each stage learned from: label -> config field or property (left out when unset; ppo's reward_text is `reward`
or its reward_funcs' weighted sum)"""
_COMMON = ("optim.lr", "optim.schedule", "lora.enabled", "lora.r", "precision", "seed")
SETTINGS = {
    "sft": ("epochs", "max_steps", "batch_size", "grad_accum", "max_seq_len", *_COMMON),
    "rm": ("epochs", "max_steps", "batch_size", "grad_accum", "max_seq_len", "margin", "center_coef", *_COMMON),
    "ppo": ("advantage", "iterations", "rollout_batch_size", "samples_per_prompt", "ppo_epochs", "kl_coef",
            "kl_estimator", "kl_in_reward", "generation.max_new_tokens", "generation.temperature", *_COMMON),
    "dpo": ("loss", "beta", "epochs", "max_steps", "batch_size", "grad_accum", "max_seq_len", *_COMMON),
}
"""the settings a card lists per stage (every one a config field: tests/models/test_card.py holds them to it)"""
DPO_LOSSES = {"sigmoid": ("dpo", "DPO"), "ipo": ("ipo", "IPO"), "hinge": ("slic", "SLiC"), "simpo": ("simpo", "SimPO")}
"""dpo's `loss` -> the algorithm it makes (record word, title)"""


@dataclass
class ModelCard:
    stage: str
    """the stage that saved the model: sft, rm, ppo or dpo"""
    algorithm: str
    """what ran, as one lower-case word: sft, reward-model, ppo, grpo, rloo, dpo, ipo ..."""
    title: str
    """the same as people write it: SFT, GRPO, DPO ..."""
    base_model: str
    """the model the stage started from, as its config names it"""
    data: dict[str, str] = field(default_factory=dict)
    settings: dict[str, object] = field(default_factory=dict)
    metrics: dict[str, object] = field(default_factory=dict)
    note: str = ""
    """one line on what this copy is (e.g. the best iteration rather than the last)"""
    parents: list[str] = field(default_factory=list)
    """the stages that made the base model, oldest first, from the base's card"""

    @property
    def stages(self) -> list[str]:
        return [*self.parents, self.algorithm]

    def front_matter(self) -> dict:
        tags = ["quartet", *dict.fromkeys(self.stages)]
        if any(s != "sft" for s in self.stages):
            tags.insert(1, "rlhf")
        return {
            "base_model": hub_name(self.base_model),
            "library_name": "quartet",
            "pipeline_tag": "text-classification" if self.stage == "rm" else "text-generation",
            "tags": tags,
            "quartet_stages": self.stages,
        }

    def render(self) -> str:
        chain = " -> ".join(self.stages)
        loader = "AutoModelForSequenceClassification" if self.stage == "rm" else "AutoModelForCausalLM"
        lines = [
            "---", yaml.safe_dump(self.front_matter(), sort_keys=False).rstrip(), "---", "",
            f"# {self.title} model trained with Quartet", "",
            f"Trained from `{self.base_model}` by Quartet's `{self.stage}` stage ({self.title}); "
            f"stages from the base model: {chain}.",
        ]
        if self.note:
            lines += ["", self.note]
        lines += ["", "## Data", ""] + [f"- {k}: `{v}`" for k, v in self.data.items()]
        lines += ["", "## Settings", "", "| setting | value |", "| --- | --- |"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in self.settings.items()]
        if self.metrics:
            lines += ["", "## Training results (end of training)", "", "| metric | value |", "| --- | --- |"]
            lines += [f"| {k} | {_fmt(v)} |" for k, v in self.metrics.items()]
        lines += ["", "## Use", "", "```python", f"from transformers import AutoTokenizer, {loader}", "",
                  f'model = {loader}.from_pretrained("path/to/this/folder")',
                  'tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")', "```", ""]
        return "\n".join(lines)


def stage_card(stage: str, cfg, metrics: dict | None = None, note: str = "", precision: str = "") -> ModelCard:
    """The card of a model saved by ``stage`` (sft, rm, ppo, dpo) from its config and final ``metrics``;
    ``precision``: the one the run used (fp32, bf16, fp16) where the config says `auto`."""
    base = str(_get(cfg, BASE[stage]))
    data = {label: str(v) for label, key in DATA[stage].items() if (v := _get(cfg, key)) is not None}
    settings = {key: _get(cfg, key) for key in SETTINGS[stage]}
    if precision:
        settings["precision"] = precision
    if not settings.get("lora.enabled"):
        settings.pop("lora.r", None)
    algorithm, title = algorithm_of(stage, cfg)
    return ModelCard(stage, algorithm, title, base, data, settings, dict(metrics or {}), note,
                     parents=read_stages(base))


def algorithm_of(stage: str, cfg) -> tuple[str, str]:
    """(record word, title) of what ``stage`` ran: ppo by its advantage estimator, dpo by its loss."""
    if stage == "ppo":
        est = ESTIMATORS[cfg.advantage]
        return est.algorithm, est.title
    if stage == "dpo":
        return DPO_LOSSES[cfg.loss]
    return ("reward-model", "Reward model (Bradley-Terry)") if stage == "rm" else ("sft", "SFT")


def read_card(model_dir: str | os.PathLike) -> dict | None:
    """The front matter of the Quartet card in ``model_dir``, None when there is none (not a folder, no card, a
    card another library wrote, or front matter that does not parse)."""
    path = Path(model_dir) / CARD
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError):
        return None
    if not text.startswith("---\n") or "\n---\n" not in text[4:]:
        return None
    try:
        meta = yaml.safe_load(text[4 : text.index("\n---\n", 4)])
    except yaml.YAMLError:
        return None
    return meta if isinstance(meta, dict) and meta.get("library_name") == "quartet" else None


def read_stages(base_model: str) -> list[str]:
    """The stages that made ``base_model``, from its card ([] for a model Quartet did not train)."""
    if handles.is_handle(base_model):
        return []
    meta = read_card(base_model)
    stages = meta.get("quartet_stages") if meta else None
    return [str(s) for s in stages] if isinstance(stages, list) else []


def add_eval(model_dir: str | os.PathLike, table: str, where: str) -> None:
    """Put an evaluation ``table`` (markdown) into the card in ``model_dir``, in place of an earlier one."""
    path = Path(model_dir) / CARD
    if not path.is_file():
        return
    text = path.read_text(encoding="utf-8")
    use_at = text.find("\n## Use\n")  # the evaluation goes before the closing "Use" section
    head, use = (text[:use_at], text[use_at:]) if use_at >= 0 else (text, "")
    head = head.split("\n## Evaluation\n")[0]
    atomic_write_text(path, f"{head.rstrip()}\n\n## Evaluation\n\n{where}\n\n{table.strip()}\n{use}")


def hub_name(name: str) -> str:
    """``name`` as `base_model` states it: an alias as the Hub model it is, a memory: model by its own name."""
    if handles.is_handle(name):
        try:
            model = handles.lookup(name, "model", LookupError)[0]
        except LookupError:
            return name
        return str(getattr(model, "name_or_path", "") or name)
    return HUB_IDS.get(name, name)


def _get(cfg, dotted: str):
    value = cfg
    for part in dotted.split("."):
        if value is None:  # an unset sub-config (eval_data: none)
            return None
        value = getattr(value, part)
    return value


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value))
    return "-" if value is None else str(value)
