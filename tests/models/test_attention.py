"""The attention kernel chosen per forward on CPU (quartet.models.attention): grouped-query attention without
copying each key/value head per query head computes what transformers' eager attention computes."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.llama.modeling_llama import eager_attention_forward

from quartet.models import load_causal_lm
from quartet.models.attention import GROUPED, grouped_eager_attention

GQA = "tiny:llama?hidden=48&layers=2&heads=6&kv_heads=2&vocab=300&seed=5"


class _Module(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len", [1, 9])  # a decoding step, a teacher-forced forward
def test_grouped_attention_is_eager_attention(dtype, q_len):
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, k_len, D = 3, 9, 3, 13, 16
    q = torch.randn(B, H, q_len, D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, k_len, D, generator=g).to(dtype) for _ in range(2))
    mask = torch.zeros(B, 1, q_len, k_len, dtype=dtype)
    mask[0, :, :, :4] = torch.finfo(dtype).min  # left padding of row 0
    mask[:, :, :, -q_len:] += torch.triu(torch.full((q_len, q_len), torch.finfo(dtype).min, dtype=dtype), 1)
    module = _Module(H // Hkv).eval()
    out, weights = grouped_eager_attention(module, q, k, v, mask, scaling=D**-0.5)
    ref_out, ref_weights = eager_attention_forward(module, q, k, v, mask, scaling=D**-0.5)
    assert out.shape == ref_out.shape == (B, q_len, H, D) and out.is_contiguous()
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 0, "rtol": 0}
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(weights, ref_weights, **tol)


def _run(model, ids, mask, kernel: str):
    model.base_model._quartet_eager_attention = kernel
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits
    logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_grouped_query_model_takes_it_with_the_same_logits_and_gradients():
    model, _ = load_causal_lm(GQA)
    assert model.base_model._quartet_eager_attention == GROUPED
    ids = torch.randint(4, 300, (3, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    logits, grads = _run(model, ids, mask, GROUPED)
    ref_logits, ref_grads = _run(copy.deepcopy(model), ids, mask, "eager")
    torch.testing.assert_close(logits, ref_logits, atol=1e-6, rtol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-6, rtol=1e-5)
    with torch.no_grad():  # and decoding with a KV cache samples the same tokens
        kw = {"max_new_tokens": 8, "do_sample": False, "attention_mask": mask}
        out = model.generate(ids, **kw)
        model.base_model._quartet_eager_attention = "eager"
        assert torch.equal(out, model.generate(ids, **kw))


@pytest.mark.parametrize("name", ["tiny:llama?hidden=32&heads=4", "tiny:gpt2?hidden=32&heads=4"])
def test_other_models_keep_their_own_eager_attention(name):
    """One key/value head per query head (nothing to group), or an eager form of the model's own (GPT-2)."""
    model, _ = load_causal_lm(name)
    assert model.base_model._quartet_eager_attention == "eager"
