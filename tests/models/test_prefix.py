"""The shared prompt prefix (models/prefix.py): its length, and forwards on it = the full forwards and gradients."""

from __future__ import annotations

import pytest
import torch

import quartet.models.prefix as prefix
from quartet.config import LoraConfig
from quartet.models import apply_lora, load_causal_lm, make_critic
from quartet.models.prefix import (
    MIN_SHARED_TOKENS,
    forward_shared_prefix,
    keep_cache_under_checkpointing,
    kept_columns,
    probe,
    shared_prefix_length,
)
from quartet.models.recompute import enable_activation_checkpointing
from quartet.models.trunk import Trunk
from quartet.rollout.record import position_ids_from_mask

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA

TINY4 = "tiny:llama?hidden=32&layers=4&heads=4&kv_heads=2&vocab=260&seed=1"
N = 10  # the shared tokens of `_batch`


def _batch(rows=4, pads=(3, 0, 1, 2), width=20):
    """Left-padded rows that start with the same N tokens after their pads, then tokens of their own."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 260, (rows, width), generator=g)
    common = torch.randint(3, 260, (N,), generator=g)
    mask = torch.ones_like(ids)
    for i, p in enumerate(pads):
        mask[i, :p] = 0
        ids[i, :p] = 0
        ids[i, p : p + N] = common
    return ids, mask, position_ids_from_mask(mask), torch.tensor(pads)


def _kept(x, pads, n):
    """The columns a shared-prefix forward returns: each row without its prefix columns."""
    B, T = x.shape[:2]
    return x[kept_columns(pads, n, T)].view(B, T - n, *x.shape[2:])


def test_the_length_is_what_every_row_starts_with_after_its_pads():
    ids, mask, _, _ = _batch()
    assert shared_prefix_length(ids[:, :16], mask[:, :16]) == N
    ids[2, 1 + 9] += 1  # row 2 (one pad) differs at its 10th real token
    assert shared_prefix_length(ids[:, :16], mask[:, :16]) == 9
    # each row keeps one prompt token of its own: the shortest real prompt (16 - 3 pads) caps it at 12
    same = torch.full((3, 16), 7)
    same_mask = torch.ones_like(same)
    same_mask[0, :3] = 0
    assert shared_prefix_length(same, same_mask) == 12
    assert shared_prefix_length(same[:1], same_mask[:1]) == 0  # one row: nothing to share
    short = ids[:, :16].clone()
    short[1, MIN_SHARED_TOKENS - 1] += 1  # row 1 (no pads) differs before MIN_SHARED_TOKENS
    assert shared_prefix_length(short, mask[:, :16]) == 0


def _random_lora(model):
    for p in model.parameters():  # LoRA B starts at zero: move it so the adapters change the forward
        if p.requires_grad:
            p.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    return model


@pytest.mark.parametrize("kind", ["full", "lora", "lora-trunk", "recompute"])
def test_the_shared_prefix_forward_gives_the_full_forward_and_its_gradients(kind):
    """`recompute`: a full fine-tune under full activation checkpointing, the layers run again in the backward on
    the read-only cache."""
    ids, mask, pos, pads = _batch()
    model, _ = load_causal_lm(TINY4)
    trunk = None
    if kind == "recompute":
        enable_activation_checkpointing(model, "full")
        assert keep_cache_under_checkpointing(model)
        model.train()
        assert probe(model, training=True)
    if kind.startswith("lora"):
        model = _random_lora(apply_lora(model, LoraConfig(enabled=True, r=4, alpha=8,
                                                          layers_to_transform=[2, 3] if kind == "lora-trunk" else None)))
    if kind == "lora-trunk":
        trunk = Trunk.attach(model)
        assert trunk is not None and trunk.depth == 2
    assert probe(model, trunk=trunk)
    real = _kept(mask, pads, N).bool()

    def run(shared):
        model.zero_grad(set_to_none=True)
        inputs = {"input_ids": ids} if trunk is None else {"inputs_embeds": trunk.states(ids, mask, pos)}
        with trunk.top() if trunk is not None else torch.enable_grad():
            if shared:
                out = forward_shared_prefix(model, N, pads, attention_mask=mask, position_ids=pos, **inputs)
                logits = out.logits
            else:
                logits = _kept(model(**inputs, attention_mask=mask, position_ids=pos, use_cache=False).logits, pads, N)
        logp = logits.float().log_softmax(-1)
        (logp[real] * torch.linspace(-1, 1, logp.shape[-1])).sum().backward()
        return logp[real].detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, want_grads = run(False)
    got, got_grads = run(True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert want_grads.keys() == got_grads.keys() and want_grads
    for name, grad in want_grads.items():  # the prefix's gradient: the sum over the rows that read it
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_a_separate_critic_on_the_shared_prefix_gives_its_values(tmp_path):
    ids, mask, pos, pads = _batch()
    critic = make_critic(TINY4)
    assert probe(critic.backbone, read=lambda out: out.last_hidden_state)
    want = _kept(critic(ids, mask, pos), pads, N)
    got = critic(ids, mask, pos, shared_prefix=(N, pads))
    real = _kept(mask, pads, N).bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)


def test_the_probe_turns_down_a_forward_that_does_not_give_the_full_one(monkeypatch):
    model, _ = load_causal_lm(TINY4)
    with torch.no_grad():  # a random model attends almost uniformly, positions or not: sharpen its attention
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(30)
    assert probe(model)
    real = prefix.forward_shared_prefix

    def restarted(model, n, pads, *, attention_mask, position_ids, **kw):  # the suffix's positions from 0 again
        pos = torch.where(position_ids >= n, position_ids - n, position_ids)
        return real(model, n, pads, attention_mask=attention_mask, position_ids=pos, **kw)

    monkeypatch.setattr(prefix, "forward_shared_prefix", restarted)
    assert not probe(model)

    def unmasked(model, n, pads, *, attention_mask, position_ids, **kw):  # the rows' pads read as tokens
        return real(model, n, pads, attention_mask=torch.ones_like(attention_mask), position_ids=position_ids, **kw)

    monkeypatch.setattr(prefix, "forward_shared_prefix", unmasked)
    assert not probe(model)

    def failing(*a, **k):
        raise TypeError("forward() got an unexpected keyword argument 'cache'")

    monkeypatch.setattr(prefix, "forward_shared_prefix", failing)
    assert not probe(model)
