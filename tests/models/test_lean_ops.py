"""Lean decoder-layer ops (quartet.models.lean_ops): the same forwards, the same gradients up to rounding, less
kept for the backward, and only where the module computes what they compute."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from quartet.models import load_causal_lm
from quartet.models.lean_ops import _RMSNorm, _SiluMul, apply_lean_ops
from quartet.models.recompute import enable_activation_checkpointing

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA

TINY = "tiny:llama?hidden=32&layers=2&heads=4&vocab=300&seed=3"


def _run(model, ids, autocast: bool):
    """Logits and the gradients of a log-likelihood."""
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids, use_cache=False).logits
    loss = logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).mean()
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("autocast", [False, True])
def test_same_logits_and_gradients(autocast):
    base, _ = load_causal_lm(TINY)
    ids = torch.randint(3, 300, (3, 12), generator=torch.Generator().manual_seed(0))
    logits0, grads0 = _run(copy.deepcopy(base), ids, autocast)
    model = copy.deepcopy(base)
    assert apply_lean_ops(model) == 2 * 3  # per layer: two norms and the MLP
    assert apply_lean_ops(model) == 0  # idempotent
    logits1, grads1 = _run(model, ids, autocast)
    assert torch.equal(logits1, logits0)  # bit for bit
    if not autocast:
        for name, g in grads0.items():
            torch.testing.assert_close(grads1[name], g, rtol=1e-5, atol=1e-6, msg=name)
        return
    # under bf16 autocast both are the fp32 gradient plus bf16 rounding: the lean one no further from it
    _, exact = _run(copy.deepcopy(base), ids, autocast=False)
    for name, g in exact.items():
        eager, lean = ((grads[name] - g).norm() / g.norm() for grads in (grads0, grads1))
        assert eager < 0.02 and lean < 1.5 * eager + 1e-4, (name, float(eager), float(lean))


def test_rms_norm_backward_is_the_closed_form():
    """Against autograd through the textbook formula in float64."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 16, generator=g, dtype=torch.float32, requires_grad=True)
    w = (1 + 0.1 * torch.randn(16, generator=g)).requires_grad_()
    up = torch.randn(2, 5, 16, generator=g)
    (_RMSNorm.apply(x, w, 1e-6, None) * up).sum().backward()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (w64 * x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * up.double()).sum().backward()
    torch.testing.assert_close(x.grad, x64.grad.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, w64.grad.float(), rtol=1e-5, atol=1e-6)


def test_silu_mul_gradients_are_autograds_bit_for_bit():
    g = torch.Generator().manual_seed(2)
    gate, up, dy = (torch.randn(4, 7, 24, generator=g).bfloat16() for _ in range(3))
    a, b = gate.clone().requires_grad_(), up.clone().requires_grad_()
    (torch.nn.functional.silu(a) * b).backward(dy)
    c, d = gate.clone().requires_grad_(), up.clone().requires_grad_()
    _SiluMul.apply(c, d).backward(dy)
    assert torch.equal(c.grad, a.grad) and torch.equal(d.grad, b.grad)


def _saved_bytes(model, ids) -> int:
    """Bytes autograd keeps for the backward of one training forward under bf16 autocast (each storage once)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return sum(seen.values())


def test_keeps_less_for_the_backward():
    base, _ = load_causal_lm("tiny:llama?hidden=64&layers=2&heads=4&vocab=300&seed=3")  # MLP width 172
    ids = torch.randint(3, 300, (16, 16), generator=torch.Generator().manual_seed(0))
    plain = _saved_bytes(copy.deepcopy(base), ids)
    model = copy.deepcopy(base)
    apply_lean_ops(model)
    lean = _saved_bytes(model, ids)
    # per token and layer: each norm's normalised fp32 copy (2 x 64 x 4 B), two of the three bf16 casts q/k/v
    # read (2 x 64 x 2 B), one of the two gate/up read (64 x 2 B), SiLU(gate) in bf16 (172 x 2 B)
    per_token_layer = 2 * 64 * 4 + 2 * 64 * 2 + 64 * 2 + 172 * 2
    assert plain - lean >= 16 * 16 * 2 * per_token_layer, (plain, lean)


def test_with_checkpointing_and_lora():
    from quartet.config import LoraConfig
    from quartet.models import apply_lora, precast_lora_base

    base, _ = load_causal_lm(TINY)
    ids = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(3))
    _, grads0 = _run(copy.deepcopy(base), ids, autocast=False)
    for mode in ("selective", "full"):
        model = copy.deepcopy(base)
        apply_lean_ops(model)
        enable_activation_checkpointing(model, mode)
        _, grads = _run(model, ids, autocast=False)
        for name, g in grads0.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=f"{mode} {name}")
    # a LoRA actor whose base linears are held in bf16: the MLP is probed under autocast and replaced
    lora = apply_lora(copy.deepcopy(base), LoraConfig(enabled=True, r=4, alpha=8))
    precast_lora_base(lora, torch.bfloat16)
    assert apply_lean_ops(lora) == 2 * 3


class _GemmaNorm(nn.Module):
    """An RMSNorm of another form: scales by (1 + weight)."""

    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(width))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        xf = x.float()
        return ((1 + self.weight) * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))).to(x.dtype)


def test_leaves_modules_of_another_form():
    model, _ = load_causal_lm(TINY)
    layer = model.model.layers[0]
    layer.input_layernorm = _GemmaNorm(32)
    layer.mlp.act_fn = nn.GELU()
    assert apply_lean_ops(model) == 4  # layer 1's three, and layer 0's post-attention norm
    assert not getattr(layer.input_layernorm, "_quartet_lean", False)
    assert not getattr(layer.mlp, "_quartet_lean", False)
    assert layer.post_attention_layernorm._quartet_lean

