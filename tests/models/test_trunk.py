"""The frozen trunk (models/trunk.py): which layers it holds, trunk + top = the full forward and its gradients."""

from __future__ import annotations

import pytest
import torch

from quartet.config import LoraConfig
from quartet.models import apply_lora, load_causal_lm, precast_lora_base
from quartet.models.trunk import Trunk, frozen_depth

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA

TINY4 = "tiny:llama?hidden=32&layers=4&heads=4&kv_heads=2&vocab=260&seed=1"


def _actor(layers):
    model, _ = load_causal_lm(TINY4)
    return apply_lora(model, LoraConfig(enabled=True, r=4, alpha=8, layers_to_transform=layers))


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 260, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


def test_depth_is_the_frozen_unadapted_bottom():
    assert frozen_depth(_actor([2, 3])) == 2
    assert frozen_depth(_actor([1, 3])) == 1
    assert frozen_depth(_actor(None)) == 0  # every layer adapted
    assert frozen_depth(load_causal_lm(TINY4)[0]) == 0  # full fine-tune: the embedding trains
    frozen_adapter = _actor([3])
    for p in frozen_adapter.parameters():
        p.requires_grad_(False)
    assert frozen_depth(frozen_adapter) == 3  # an adapter frozen or not is not part of the trunk
    assert Trunk.attach(_actor(None)) is None


def _loss(actor, ids, mask, pos, trunk=None):
    if trunk is None:
        out = actor(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
    else:
        states = trunk.states(ids, mask, pos)
        with trunk.top():
            out = actor(inputs_embeds=states, attention_mask=mask, position_ids=pos, use_cache=False)
    logits = out.logits.float()
    return logits, logits.log_softmax(-1)[mask.bool()].mean()


def test_trunk_and_top_give_the_full_forward_and_its_gradients():
    ids, mask, pos = _batch()
    actor = _actor([2, 3])
    for p in actor.parameters():  # LoRA B starts at zero: move it so the adapters change the forward
        if p.requires_grad:
            p.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    trunk = Trunk.attach(actor)
    assert trunk is not None and trunk.depth == 2
    assert len(actor.get_base_model().model.layers) == 4  # the model's own layers are back after the probe
    full, loss = _loss(actor, ids, mask, pos)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in actor.named_parameters() if p.requires_grad}
    actor.zero_grad(set_to_none=True)
    top, loss_top = _loss(actor, ids, mask, pos, trunk)
    loss_top.backward()
    real = mask.bool()
    assert torch.equal(full[real], top[real])
    assert all(torch.equal(grads[n], p.grad) for n, p in actor.named_parameters() if p.requires_grad)
    with actor.disable_adapter():  # the reference shares the trunk: its bottom layers are the actor's
        ref_full, _ = _loss(actor, ids, mask, pos)
        ref_top, _ = _loss(actor, ids, mask, pos, trunk)
    assert torch.equal(ref_full[real], ref_top[real])
    assert not torch.equal(ref_full[real], full[real])


def test_trunk_under_bf16_autocast_with_a_precast_base():
    ids, mask, pos = _batch()
    actor = _actor([3])
    precast_lora_base(actor, torch.bfloat16)
    trunk = Trunk.attach(actor, torch.bfloat16)
    assert trunk is not None
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        full, _ = _loss(actor, ids, mask, pos)
        top, _ = _loss(actor, ids, mask, pos, trunk)
    assert torch.equal(full[mask.bool()], top[mask.bool()])


def test_a_backbone_that_transforms_inputs_embeds_gets_no_trunk():
    """As Gemma's scales them: the trunk's output would be transformed again, so the probe refuses it."""
    actor = _actor([2, 3])
    backbone = actor.get_base_model().model

    def scale(module, args, kwargs):
        if kwargs.get("inputs_embeds") is not None:
            kwargs["inputs_embeds"] = kwargs["inputs_embeds"] * 2.0
        return args, kwargs

    backbone.register_forward_pre_hook(scale, with_kwargs=True)
    assert frozen_depth(actor) == 2
    assert Trunk.attach(actor) is None


def test_shared_depth_counts_the_bottom_layers_two_models_hold_value_for_value():
    import copy

    from quartet.models.trunk import shared_depth

    a, _ = load_causal_lm(TINY4)
    assert shared_depth(a, copy.deepcopy(a)) == 3  # one layer is always left on top
    b = copy.deepcopy(a)
    with torch.no_grad():
        b.model.layers[2].mlp.up_proj.weight[0, 0] += 1e-3
    assert shared_depth(a, b) == 2
    with torch.no_grad():
        b.model.embed_tokens.weight[5, 0] += 1e-3
    assert shared_depth(a, b) == 0
    assert shared_depth(a, load_causal_lm(TINY4.replace("layers=4", "layers=3"))[0]) == 0


def test_eval_kl_through_the_shared_trunk_is_the_full_forwards_bit_for_bit(monkeypatch):
    """A checkpoint merged from adapters on layers 2-3 and its start share layers 0-1: evaluation's log-probs and
    full KL are those of two full forwards."""
    from quartet.eval import evaluate as ev
    from quartet.models import merged_copy

    actor = _actor([2, 3])
    for p in actor.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    checkpoint, start = merged_copy(actor), load_causal_lm(TINY4)[0]
    trunks = Trunk.shared(checkpoint, start)
    assert trunks is not None and trunks[0].depth == trunks[1].depth == 2
    ids, mask, _ = _batch()
    responses = torch.randint(3, 260, (3, 5), generator=torch.Generator().manual_seed(7))
    response_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]]).float()
    calls = []
    real = Trunk.states
    monkeypatch.setattr(Trunk, "states", lambda self, ids, *a: calls.append(ids.shape) or real(self, ids, *a))
    with torch.no_grad():
        shared = ev.sequence_logprobs(checkpoint, start, ids, mask, responses, response_mask, 0.7, batch_size=2)
        assert [c[0] for c in calls] == [2, 2, 2, 1]  # a probe per model, then one per chunk (2 + 1 rows) for both
        monkeypatch.setattr(Trunk, "shared", classmethod(lambda cls, a, b: None))
        full = ev.sequence_logprobs(checkpoint, start, ids, mask, responses, response_mask, 0.7, batch_size=2)
    for got, want in zip(shared, full):
        assert torch.equal(got, want)
    assert full[2].sum() > 0  # the adapters moved the checkpoint: a KL to measure


def test_shared_trunk_needs_the_other_top_to_give_its_full_forward_on_these_states():
    """Equal weights, another norm epsilon in a bottom layer (not in the weights): the layers are counted as
    shared, but the second model's top on the first's states is not its full forward, so no shared trunk."""
    import copy

    from quartet.models.trunk import shared_depth

    a, _ = load_causal_lm(TINY4)
    b = copy.deepcopy(a)
    b.model.layers[0].input_layernorm.variance_epsilon = 0.5
    assert shared_depth(a, b) == 3
    assert Trunk.shared(a, b) is None
    assert Trunk.shared(a, copy.deepcopy(a)) is not None
