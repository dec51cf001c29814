"""The Critic: per-token values V(s_t) from a transformer backbone and a scalar head.

A separate critic is a causal-LM backbone (no LM head) + `ScalarHead`. Started from a reward model,
it reuses the RM's backbone and its score layer folded with the RM normalisation, so at the last
token its first values are the normalised reward (a warm start, as in InstructGPT).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save, save_file
from torch import nn

from quartet.algo.positions import position_ids_from_mask
from quartet.atomic import atomic_dir, atomic_write_bytes
from quartet.errors import ModelError
from quartet.models.attention import fit_attention_to_shape
from quartet.models.heads import ScalarHead
from quartet.models.loading import (
    _auto_tokenizer,
    base_model_of,
    check_finite_weights,
    disable_dropout,
    hidden_size,
    load_causal_lm,
    save_pretrained_clean,
    set_tokenizer_sides,
)
from quartet.models.lora import merged_copy
from quartet.models.names import _first_line, resolve_model
from quartet.models.prefix import forward_shared_prefix
from quartet.models.reward import REWARD_META, load_reward_model, score_layer

CRITIC_META = "quartet_critic.json"
HEAD_FILE = "value_head.safetensors"


class Critic(nn.Module):
    """``backbone``: an AutoModel (no LM head), possibly peft-wrapped; ``head``: ScalarHead."""

    def __init__(self, backbone: nn.Module, head: ScalarHead, tokenizer=None, init: str = ""):
        super().__init__()
        self.backbone = backbone
        fit_attention_to_shape(backbone)
        self.head = head
        self.tokenizer = tokenizer
        self.init = init

    @property
    def config(self):
        return base_model_of(self.backbone).config

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None,
        shared_prefix: tuple[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """(B, T) values. Default positions count real tokens, as `generate` does for left-padded prompts.
        `shared_prefix`: (n, each row's left pads): the n tokens every row starts with run once (models/prefix.py),
        and the values are (B, T - n), those of the other columns."""
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        if shared_prefix is not None:
            out = forward_shared_prefix(self.backbone, *shared_prefix, **inputs)
        else:
            out = self.backbone(**inputs, use_cache=False)
        return self.head(out.last_hidden_state)


ValueHeadCritic = Critic


def make_critic(init: str, dtype: torch.dtype = torch.float32, *, trust_remote_code: bool = False) -> Critic:
    """A Critic from a causal-LM name (its backbone, fresh head) or a reward-model dir (backbone and
    head from the RM). The caller checks that its vocabulary matches the actor's (``critic.tokenizer``)."""
    source = resolve_model(init)
    if source.kind == "dir" and (source.path / REWARD_META).is_file():
        rm = load_reward_model(init, dtype, trust_remote_code=trust_remote_code)
        if not rm.causal:
            raise ModelError(
                f"critic init '{init}': the reward model's {rm.config.model_type} backbone is an encoder; "
                "per-token values need a causal LM (an encoder's token t sees the tokens after it)"
            )
        seq = base_model_of(rm.model)
        layer = score_layer(seq)
        head = ScalarHead(layer.in_features)
        with torch.no_grad():  # value = (raw - mean) / std, the reward's own scale
            head.summary.weight.copy_(layer.weight.float() / rm.std)
            bias = layer.bias.float() if layer.bias is not None else torch.zeros(1)
            head.summary.bias.copy_((bias - rm.mean) / rm.std)
        tokenizer = rm.tokenizer
        set_tokenizer_sides(tokenizer, padding="left")
        backbone = seq.base_model
    else:
        lm, tokenizer = load_causal_lm(init, dtype, trust_remote_code=trust_remote_code)
        backbone = lm.base_model
        head = ScalarHead(hidden_size(lm), init="zero")
    disable_dropout(backbone)
    return Critic(backbone, head, tokenizer, init=init)


def save_critic(critic: Critic, out_dir: str | os.PathLike) -> Path:
    """Atomic: the backbone as a plain AutoModel dir (LoRA merged), value_head.safetensors, tokenizer."""
    out_dir = Path(out_dir)
    check_finite_weights(critic.state_dict().items(), str(out_dir))
    with atomic_dir(out_dir) as tmp:
        save_pretrained_clean(merged_copy(critic.backbone), tmp)
        save_file(
            {k: v.detach().contiguous() for k, v in critic.head.state_dict().items()}, str(tmp / HEAD_FILE)
        )
        if critic.tokenizer is not None:
            critic.tokenizer.save_pretrained(tmp)
        meta = {"init": critic.init, "hidden_size": hidden_size(critic.backbone)}
        (tmp / CRITIC_META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return out_dir


def load_critic(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Critic:
    """A Critic written by `save_critic`."""
    from transformers import AutoModel

    path = Path(path)
    if not (path / CRITIC_META).is_file() or not (path / HEAD_FILE).is_file():
        raise ModelError(
            f"critic dir '{path}': no {CRITIC_META} / {HEAD_FILE} (expected a save_critic directory)"
        )
    try:
        meta = json.loads((path / CRITIC_META).read_text(encoding="utf-8"))
        backbone = AutoModel.from_pretrained(path, dtype=dtype, local_files_only=True)
        head = ScalarHead(int(meta["hidden_size"]))
        head.load_state_dict(load_file(str(path / HEAD_FILE)))
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ModelError(f"critic dir '{path}': cannot load ({_first_line(e)})") from None
    tokenizer = (
        _auto_tokenizer(path, str(path), False) if (path / "tokenizer_config.json").is_file() else None
    )
    if tokenizer is not None:
        set_tokenizer_sides(tokenizer, padding="left")
    disable_dropout(backbone)
    return Critic(backbone, head, tokenizer, init=str(meta.get("init", "")))


def save_value_head(head: ScalarHead, path: str | os.PathLike) -> Path:
    """A shared critic's value head (it reads the actor's hidden states) as one safetensors file."""
    check_finite_weights(head.state_dict().items(), str(path))
    return atomic_write_bytes(path, save({k: v.detach().contiguous() for k, v in head.state_dict().items()}))
