"""LoRA wrapping and the Reference: the shared one must be the base model, exactly, with no copy."""

from __future__ import annotations

import copy

import pytest
import torch

from quartet.config import LoraConfig
from quartet.errors import ModelError
from quartet.models import adapter_disabled, apply_lora, count_parameters, load_causal_lm, make_reference

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA

TINY = "tiny:llama?hidden=32&layers=2&heads=4&vocab=300"
OTHER = "tiny:llama?hidden=32&layers=2&heads=4&vocab=300&seed=1"


def _batch(tok):
    enc = tok(["hello there", "a much longer second prompt"], return_tensors="pt", padding=True)
    position_ids = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return enc["input_ids"], enc["attention_mask"], position_ids


def _lora_actor(r=4):
    model, tok = load_causal_lm(TINY)
    base = copy.deepcopy(model)
    actor = apply_lora(model, LoraConfig(enabled=True, r=r, alpha=2 * r))
    with torch.no_grad():  # a trained adapter: B != 0, so the actor differs from its base
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return actor, base, tok


def test_apply_lora_all_linear_trains_only_adapters():
    actor, _, _ = _lora_actor()
    trainable = {n for n, p in actor.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    targets = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n in trainable if "lora_A" in n}
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert actor.peft_config["default"].task_type == "CAUSAL_LM"


def test_apply_lora_bad_target_is_a_model_error():
    model, _ = load_causal_lm(TINY)
    with pytest.raises(ModelError, match="lora.target_modules"):
        apply_lora(model, LoraConfig(target_modules=["no_such_layer"]))


def test_adapter_disabled_is_a_noop_for_plain_models(tiny_lm):
    model, tok = tiny_lm
    ids, mask, _ = _batch(tok)
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask).logits
        with adapter_disabled(model):
            b = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(a, b)


def test_shared_reference_is_the_base_model():
    actor, base, tok = _lora_actor()
    ref = make_reference(actor, None)
    assert ref.shared and ref.model is actor
    ids, mask, pos = _batch(tok)
    actor.train()
    ref_logits = ref.logits(ids, mask, pos)
    assert actor.training  # mode restored
    assert not ref_logits.requires_grad
    with torch.no_grad():
        base_logits = base(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        actor_logits = actor(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    torch.testing.assert_close(ref_logits, base_logits, rtol=0, atol=1e-6)
    assert (actor_logits - base_logits).abs().max() > 1e-3  # the adapter is really on outside the context
    # no second copy: the reference owns no parameters beyond the actor's
    assert {id(p) for p in ref.model.parameters()} == {id(p) for p in actor.parameters()}


def test_naming_the_actors_own_base_still_shares():
    actor, _, _ = _lora_actor()
    assert make_reference(actor, TINY).shared


def test_frozen_copy_for_a_full_finetune_actor():
    actor, tok = load_causal_lm(TINY)
    ref = make_reference(actor, None)
    assert not ref.shared and ref.model is not actor
    assert all(not p.requires_grad for p in ref.model.parameters())
    assert not {id(p) for p in ref.model.parameters()} & {id(p) for p in actor.parameters()}
    ids, mask, pos = _batch(tok)
    before = ref.logits(ids, mask, pos)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(0.1)
    assert torch.equal(before, ref.logits(ids, mask, pos))  # training the actor does not move it
    assert count_parameters(ref.model) == count_parameters(actor)


def test_named_reference_is_loaded_frozen():
    actor, _, _ = _lora_actor()
    ref = make_reference(actor, OTHER)
    assert not ref.shared and all(not p.requires_grad for p in ref.model.parameters())
    assert not ref.model.training


def test_reference_vocab_mismatch_is_an_error():
    actor, _ = load_causal_lm(TINY)
    with pytest.raises(ModelError, match="vocabulary of 512 tokens, the actor has 300"):
        make_reference(actor, "tiny:llama?hidden=32&layers=2&heads=4&vocab=512")


def test_lora_base_held_in_bf16_computes_and_merges_as_the_fp32_base():
    """`precast_lora_base`: under bf16 autocast the actor and its adapter-disabled reference give the same
    logits bit for bit as with fp32 base weights (autocast casts them to the same bf16 values), while the
    merged copy (the saved model) and the engine's merged weights come from the fp32 originals, unchanged."""
    from quartet.models import merged_copy, precast_lora_base
    from quartet.rollout.weights import merged_state_dict

    model, _ = load_causal_lm(TINY)
    actor = apply_lora(model, LoraConfig(enabled=True, r=4, alpha=8))
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    held = copy.deepcopy(actor)
    precast_lora_base(held, torch.bfloat16)
    bases = [m.base_layer.weight for m in held.modules() if hasattr(m, "base_layer")]
    assert bases and all(w.dtype == torch.bfloat16 and not w.requires_grad for w in bases)
    assert all(p.dtype == torch.float32 for n, p in held.named_parameters() if p.requires_grad)
    ids = torch.randint(1, 300, (3, 9))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(held(input_ids=ids).logits, actor(input_ids=ids).logits)
        with adapter_disabled(held), adapter_disabled(actor):
            assert torch.equal(held(input_ids=ids).logits, actor(input_ids=ids).logits)
    # and the adapters' gradients, though the LoRA layers now take their bf16 input without peft's cast to fp32
    assert not any(m.cast_input_dtype_enabled for m in held.modules() if hasattr(m, "base_layer"))
    for model in (held, actor):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids).logits.float().log_softmax(-1).mean().backward()
    grads = {n: p.grad for n, p in actor.named_parameters() if p.requires_grad}
    assert all(torch.equal(p.grad, grads[n]) for n, p in held.named_parameters() if p.requires_grad)
    ours, theirs = merged_copy(held).state_dict(), merged_copy(actor).state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    ours, theirs = merged_state_dict(held), merged_state_dict(actor)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k].float(), theirs[k]) for k in ours)
    assert all(m.base_layer.weight.dtype == torch.bfloat16 for m in held.modules() if hasattr(m, "base_layer"))


def test_adapting_the_top_layers_only_stops_the_backward_below_them():
    """`layers_to_transform`: adapters in the listed decoder layers only (every linear of them, "all-linear"),
    and the backward does not run through the layers below the lowest one."""
    reached = {}
    for layers in (None, [1]):
        model, _ = load_causal_lm(TINY)
        actor = apply_lora(model, LoraConfig(enabled=True, r=4, alpha=8, layers_to_transform=layers))
        adapted = {n.split(".layers.")[1].split(".")[0] for n, p in actor.named_parameters() if p.requires_grad}
        assert adapted == ({"0", "1"} if layers is None else {"1"})
        bottom = actor.get_base_model().model.layers[0]
        reached[str(layers)] = False
        bottom.register_full_backward_hook(lambda *a, key=str(layers): reached.__setitem__(key, True))
        actor(input_ids=torch.tensor([[5, 6, 7]])).logits.sum().backward()
    assert reached == {"None": True, "[1]": False}


@pytest.mark.parametrize("layers, message", [
    ([], "must be a non-empty list"), ([-1], "must be a non-empty list"), ("top", "must be a non-empty list"),
    ([2], "layer 2 does not exist .the model has 2 decoder layers, 0-1."),
])
def test_bad_layers_to_transform(layers, message):
    from quartet.errors import ConfigError

    cfg = LoraConfig(enabled=True, layers_to_transform=layers)
    with pytest.raises((ConfigError, ModelError), match=message):
        cfg.validate("lora")
        apply_lora(load_causal_lm(TINY)[0], cfg)
