"""Critic: per-token values, warm start from a reward model, save/load."""

from __future__ import annotations

import pytest
import torch

from quartet.errors import ModelError
from quartet.models import (
    Critic,
    ValueHeadCritic,
    hidden_size,
    load_critic,
    load_reward_model,
    make_critic,
    save_critic,
    save_reward_model,
    value_head_for,
)
from quartet.models.tiny import build_tiny_tokenizer

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA

TINY = "tiny:llama?hidden=32&layers=2&heads=4&vocab=300"


def _enc(tok, side="left"):
    tok.padding_side = side
    return tok(
        ["hello there<|im_end|>", "a longer second response<|im_end|>"], return_tensors="pt", padding=True
    )


def test_critic_values_per_token_and_trainable():
    critic = make_critic(TINY)
    assert isinstance(critic, Critic) and ValueHeadCritic is Critic
    assert not hasattr(critic.backbone, "lm_head")
    enc = _enc(critic.tokenizer)
    values = critic(enc["input_ids"], enc["attention_mask"])
    assert values.shape == enc["input_ids"].shape and values.dtype == torch.float32
    assert torch.equal(values, torch.zeros_like(values))  # a fresh head starts at 0 (see ScalarHead)
    values.sum().backward()
    assert critic.head.summary.weight.grad.abs().sum() > 0
    torch.nn.init.normal_(critic.head.summary.weight)  # once the head is non-zero, the backbone learns too
    critic.zero_grad()
    critic(enc["input_ids"], enc["attention_mask"]).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in critic.backbone.parameters())


def test_critic_save_load_roundtrip(tmp_path):
    critic = make_critic(TINY)
    torch.nn.init.normal_(critic.head.summary.weight)  # not the all-zero fresh head
    out = save_critic(critic, tmp_path / "critic")
    again = load_critic(out)
    enc = _enc(critic.tokenizer)
    with torch.no_grad():
        assert torch.equal(critic(**enc), again(**enc))
    assert again.tokenizer.get_vocab() == critic.tokenizer.get_vocab() and again.init == TINY


def test_critic_from_reward_model_starts_at_the_normalised_reward(tmp_path):
    rm = load_reward_model(TINY)
    rm.set_normalization(0.5, 2.0)
    rm_dir = save_reward_model(rm, tmp_path / "rm")
    critic = make_critic(str(rm_dir))
    enc = _enc(rm.tokenizer, side="right")
    last = enc["attention_mask"].sum(-1) - 1
    with torch.no_grad():
        values = critic(enc["input_ids"], enc["attention_mask"])
        scores = rm(enc["input_ids"], enc["attention_mask"])
    torch.testing.assert_close(values[torch.arange(2), last], scores, rtol=1e-5, atol=1e-5)
    assert critic.tokenizer.padding_side == "left"


def test_critic_from_an_encoder_reward_model_is_refused(tmp_path):
    from transformers import BertConfig, BertModel

    tok = build_tiny_tokenizer()
    BertModel(
        BertConfig(
            vocab_size=300,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            pad_token_id=0,
        )
    ).save_pretrained(tmp_path / "bert")
    tok.save_pretrained(tmp_path / "bert")
    rm_dir = save_reward_model(load_reward_model(str(tmp_path / "bert")), tmp_path / "rm")
    with pytest.raises(ModelError, match="per-token values need a causal LM"):
        make_critic(str(rm_dir))


def test_load_critic_needs_a_critic_dir(tmp_path):
    with pytest.raises(ModelError, match="expected a save_critic directory"):
        load_critic(tmp_path)


def test_value_head_for_actor(tiny_lm):
    head = value_head_for(tiny_lm[0])
    assert head.summary.in_features == hidden_size(tiny_lm[0]) == 32
    # a fresh value head predicts 0 everywhere (explained variance starts at 0, not below) and still learns
    hidden = torch.randn(4, 7, 32)
    assert torch.equal(head(hidden), torch.zeros(4, 7))
    loss = (head(hidden) - 1.0).pow(2).mean()
    loss.backward()
    assert head.summary.weight.grad.abs().sum() > 0
