"""Activation checkpointing (quartet.models.recompute): same gradients, and the layers really run again."""

from __future__ import annotations

import copy

import pytest
import torch

from quartet.models import load_causal_lm
from quartet.models.recompute import enable_activation_checkpointing

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA

TINY = "tiny:llama?hidden=32&layers=2&heads=4&vocab=300&seed=3"


def _grads_and_calls(model, ids, autocast: bool):
    """Gradients of a log-likelihood, and how often layer 0's MLP activation and attention projection ran."""
    calls = {"act": 0, "q": 0}
    layer = model.model.layers[0]
    hooks = [layer.mlp.act_fn.register_forward_hook(lambda *a: calls.__setitem__("act", calls["act"] + 1)),
             layer.self_attn.q_proj.register_forward_hook(lambda *a: calls.__setitem__("q", calls["q"] + 1))]
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids, use_cache=False).logits
    loss = logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).mean()
    loss.backward()
    for h in hooks:
        h.remove()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, calls


@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("autocast", [False, True])
def test_checkpointing_recomputes_and_leaves_the_gradients(mode, autocast):
    base, _ = load_causal_lm(TINY)
    ids = torch.randint(3, 300, (3, 12), generator=torch.Generator().manual_seed(0))
    plain, calls = _grads_and_calls(copy.deepcopy(base), ids, autocast)
    assert calls == {"act": 1, "q": 1}
    model = copy.deepcopy(base)
    assert enable_activation_checkpointing(model, mode)
    grads, calls = _grads_and_calls(model, ids, autocast)
    # both modes run the layer's forward again in the backward; selective takes the projection's output from
    # what it kept (the module hook still fires, the matrix product is not redone: see the next test)
    assert calls["act"] == 2
    for name, g in plain.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_selective_keeps_the_matrix_products():
    """Count aten.mm calls in forward + backward: full redoes each layer's products, selective does not."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMM(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.mm = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.mm += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                                torch.ops.aten.bmm.default)
            return func(*args, **(kwargs or {}))

    base, _ = load_causal_lm(TINY)
    ids = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(1))
    counts = {}
    for mode in ("none", "selective", "full"):
        model = copy.deepcopy(base)
        enable_activation_checkpointing(model, mode)
        with CountMM() as counter:
            _grads_and_calls(model, ids, autocast=False)
        counts[mode] = counter.mm
    assert counts["selective"] == counts["none"] < counts["full"]


def test_unknown_mode_and_a_peft_target(tiny_lm):
    from quartet.config import LoraConfig
    from quartet.models import apply_lora

    with pytest.raises(ValueError, match="mode must be one of"):
        enable_activation_checkpointing(copy.deepcopy(tiny_lm[0]), "some")
    assert not enable_activation_checkpointing(copy.deepcopy(tiny_lm[0]), "none")
    peft = apply_lora(copy.deepcopy(tiny_lm[0]), LoraConfig(enabled=True))
    assert enable_activation_checkpointing(peft, "selective")
    assert peft.get_base_model().model.gradient_checkpointing
