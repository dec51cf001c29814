"""Packed linears (quartet.models.packed): the same products as nn.Linear from weights laid out once, re-laid out
by load_state_dict, given back plain by state_dict, and only where they change nothing but the speed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from quartet.config import GenerationConfig, LoraConfig
from quartet.models import apply_lora, load_causal_lm
from quartet.models.packed import PackedLinear, can_pack, pack_linears, tie_output
from quartet.rollout.engine import HFEngine

GQA = "tiny:llama?hidden=48&layers=2&heads=6&kv_heads=2&vocab=300&seed=5"
needs_bf16 = pytest.mark.skipif(not can_pack(torch.bfloat16), reason="no native bf16 oneDNN on this CPU: nothing is packed")


@needs_bf16
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_computes_what_the_linear_computes(bias):
    linear = nn.Linear(40, 24, bias=bias).to(torch.bfloat16).requires_grad_(False)
    packed = PackedLinear(linear, rows=16)
    for shape in [(5, 40), (3, 7, 40), (1, 1, 40)]:
        x = torch.randn(shape).to(torch.bfloat16)
        assert torch.equal(packed(x), linear(x))  # bit for bit
    assert torch.equal(packed.state_dict()["weight"], linear.weight)


@needs_bf16
def test_a_packed_model_gives_the_same_logits_and_takes_new_weights():
    model, _ = load_causal_lm(GQA, dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    plain = copy.deepcopy(model)
    assert pack_linears(model) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the untied head
    assert pack_linears(model) == 0  # idempotent
    ids = torch.randint(4, 300, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)

    # new weights through load_state_dict (the engine's sync): laid out again, the same as a plain model's
    other, _ = load_causal_lm(GQA.replace("seed=5", "seed=6"), dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(other.state_dict(), strict=False)
    assert not missing and not unexpected
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, other(input_ids=ids).logits)
    state = model.state_dict()
    assert state.keys() == other.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in other.state_dict().items())


def _tied(model):
    model.lm_head.weight = model.model.embed_tokens.weight
    model.config.tie_word_embeddings = True
    return model


def test_only_frozen_bf16_linears_are_packed():
    fp32, _ = load_causal_lm(GQA)
    assert pack_linears(fp32.requires_grad_(False)) == 0  # fp32: oneDNN would sum in another order than MKL
    model, _ = load_causal_lm(GQA, dtype=torch.bfloat16)
    assert pack_linears(model) == 0  # trainable weights


@needs_bf16
def test_a_tied_head_gets_its_own_packed_copy_and_follows_new_embeddings():
    model = _tied(load_causal_lm(GQA, dtype=torch.bfloat16)[0]).eval().requires_grad_(False)
    plain = copy.deepcopy(model)
    embedding = model.model.embed_tokens.weight
    assert pack_linears(model) == 2 * 7 + 1
    assert isinstance(model.lm_head, PackedLinear) and model.model.embed_tokens.weight is embedding  # stays plain
    ids = torch.randint(4, 300, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)
        # new weights without the head's key (a state dict of tied weights may hold only the embedding)
        other = _tied(load_causal_lm(GQA.replace("seed=5", "seed=6"), dtype=torch.bfloat16)[0])
        state = {k: v for k, v in other.state_dict().items() if k != "lm_head.weight"}
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert missing == ["lm_head.weight"] and not unexpected
        tie_output(model)
        assert torch.equal(model(input_ids=ids).logits, other(input_ids=ids).logits)
        tie_output(plain)  # a plain model: transformers' tie_weights
        assert plain.lm_head.weight is plain.model.embed_tokens.weight


@needs_bf16
@pytest.mark.parametrize("tied", [False, True])
def test_the_engine_copy_is_packed_and_synced(monkeypatch, tied):
    """The HF engine's bf16 copy of a LoRA actor: packed, and each sync lays the merged weights out again; its
    logits are those of the same engine copy unpacked. A tied head follows the embedding (full fine-tune)."""
    model, tok = load_causal_lm(GQA)
    if tied:
        model = _tied(model)
    actor = apply_lora(model, LoraConfig(enabled=True, r=4, alpha=8))
    gen = GenerationConfig(max_new_tokens=5, batch_size=4)
    engine = HFEngine(actor, tok, gen, dtype=torch.bfloat16)
    monkeypatch.setattr("quartet.rollout.engine.pack_linears", lambda model, rows: 0)
    plain = HFEngine(actor, tok, gen, dtype=torch.bfloat16)
    assert any(isinstance(m, PackedLinear) for m in engine.model.modules())
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    assert isinstance(engine.model.lm_head, PackedLinear) and engine.model.lm_head.tied == tied
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
        if tied:  # as a full fine-tune moves the tied embedding
            actor.get_base_model().model.embed_tokens.weight.normal_(0, 0.5)
    engine.sync(actor)
    plain.sync(actor)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        assert torch.equal(engine.model(input_ids=ids).logits, plain.model(input_ids=ids).logits)
    assert torch.equal(engine.generate(ids, mask, seed=2).response_ids, plain.generate(ids, mask, seed=2).response_ids)
