"""Reward model: padding-invariant scores, normalisation, and a save that plain transformers reloads."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from quartet.config import LoraConfig
from quartet.data import render_conversation
from quartet.errors import ModelError
from quartet.models import RewardModel, ScalarHead, apply_lora, load_reward_model, save_reward_model
from quartet.models.attention import fit_attention_to_shape

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA

TINY = "tiny:llama?hidden=32&layers=2&heads=4&vocab=300"
TEXTS = ["short one<|im_end|>", "a somewhat longer response text<|im_end|>", "mid length"]


def _padded(tok, texts, side):
    tok.padding_side = side
    return tok(texts, return_tensors="pt", padding=True)


@pytest.mark.parametrize("name", [TINY, "tiny:gpt2?hidden=32&layers=2&heads=4&vocab=300"])
def test_left_and_right_padding_give_the_same_scores(name):
    rm = load_reward_model(name)
    assert isinstance(rm, RewardModel) and rm.causal
    assert rm.model.config.pad_token_id != rm.tokenizer.eos_token_id
    left, right = _padded(rm.tokenizer, TEXTS, "left"), _padded(rm.tokenizer, TEXTS, "right")
    with torch.no_grad():
        a = rm(left["input_ids"], left["attention_mask"])
        b = rm(right["input_ids"], right["attention_mask"])
        alone = torch.cat(
            [
                rm(
                    **{
                        k: v
                        for k, v in rm.tokenizer([t], return_tensors="pt").items()
                        if k in ("input_ids", "attention_mask")
                    }
                )
                for t in TEXTS
            ]
        )
    assert a.shape == (3,)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a, alone, rtol=1e-5, atol=1e-5)


def test_score_texts_normalises_and_batches():
    rm = load_reward_model(TINY)
    raw = rm.score_texts(TEXTS, batch_size=2)
    assert len(raw) == 3 and all(isinstance(s, float) and math.isfinite(s) for s in raw)
    rm.set_normalization(mean=1.5, std=2.0)
    norm = rm.score_texts(TEXTS, batch_size=32)
    assert norm == pytest.approx([(r - 1.5) / 2.0 for r in raw], abs=1e-5)
    # batched by length (TEXTS are not in length order), each score comes back in its text's place
    assert norm == pytest.approx([rm.score_texts([t])[0] for t in TEXTS], abs=1e-5)
    assert rm.score_texts([]) == []
    with pytest.raises(ModelError, match="std > 0"):
        rm.set_normalization(0.0, 0.0)


def test_truncation_keeps_the_end():
    rm = load_reward_model(TINY)
    long = "x" * 100 + "the end"
    enc = rm.tokenizer([long], truncation=True, max_length=10)
    assert rm.tokenizer.decode(enc["input_ids"][0]).endswith("the end")
    assert rm.score_texts([long], max_length=10) == pytest.approx(rm.score_texts([long[-10:]]), abs=1e-5)


def test_save_reward_model_reloads_with_plain_transformers(tmp_path):
    rm = load_reward_model(TINY)
    rm.set_normalization(0.25, 3.0)
    rm.set_temperature(1.5)
    out = save_reward_model(rm, tmp_path / "rm")
    meta = json.loads((out / "quartet_reward.json").read_text())
    assert meta == {"mean": 0.25, "std": 3.0, "temperature": 1.5, "backbone": TINY}
    plain = AutoModelForSequenceClassification.from_pretrained(out)
    fit_attention_to_shape(plain)  # the kernel our loader picks (models/attention.py): same arithmetic
    enc = _padded(rm.tokenizer, TEXTS, "right")
    with torch.no_grad():
        ours = rm.raw_scores(enc["input_ids"], enc["attention_mask"])
        theirs = plain(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits.squeeze(-1)
    assert torch.equal(ours, theirs)
    again = load_reward_model(str(out))
    assert again.score_texts(TEXTS) == pytest.approx(rm.score_texts(TEXTS), abs=1e-6)
    assert float(again.mean) == 0.25 and float(again.std) == 3.0 and again.temperature == 1.5
    assert again.tokenizer.truncation_side == "left"
    # P(a > b) from normalised scores: the raw margin std * (s_a - s_b) = 3 * 0.5 over T = 1.5 -> sigmoid(1)
    p = again.preference_probability(torch.tensor([0.5, 0.0]), torch.tensor([0.0, 0.0]))
    torch.testing.assert_close(p, torch.tensor([1 / (1 + math.exp(-1.0)), 0.5]))
    with pytest.raises(ModelError, match="T > 0"):
        again.set_temperature(0.0)
    # a record written before temperatures were fitted reads T = 1; a bad one is one error naming the file
    (out / "quartet_reward.json").write_text(json.dumps({"mean": 0.25, "std": 3.0, "backbone": TINY}))
    assert load_reward_model(str(out)).temperature == 1.0
    (out / "quartet_reward.json").write_text(json.dumps({"mean": 0.25, "std": 3.0, "temperature": -1}))
    with pytest.raises(ModelError, match="quartet_reward.json: reward temperature"):
        load_reward_model(str(out))


def test_lora_reward_model_is_saved_merged(tmp_path):
    rm = load_reward_model(TINY)
    rm.model = apply_lora(rm.model, LoraConfig(r=2, alpha=4), task_type="SEQ_CLS")
    with torch.no_grad():
        for name, p in rm.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    out = save_reward_model(rm, tmp_path / "rm")
    plain = AutoModelForSequenceClassification.from_pretrained(out)
    fit_attention_to_shape(plain)  # the kernel our loader picks (models/attention.py): same arithmetic
    enc = _padded(rm.tokenizer, TEXTS, "right")
    with torch.no_grad():
        ours = rm.raw_scores(enc["input_ids"], enc["attention_mask"])
        theirs = plain(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits.squeeze(-1)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_encoder_backbone_reads_the_first_token_whatever_the_padding(tiny_bert_dir):
    rm = load_reward_model(tiny_bert_dir)
    assert not rm.causal and rm.tokenizer.padding_side == "right"
    assert all(m.p == 0.0 for m in rm.modules() if isinstance(m, torch.nn.Dropout))
    left, right = _padded(rm.tokenizer, TEXTS, "left"), _padded(rm.tokenizer, TEXTS, "right")
    with torch.no_grad():
        torch.testing.assert_close(rm(**left), rm(**right), rtol=1e-5, atol=1e-5)


def test_scalar_head_shape_and_init():
    torch.manual_seed(0)
    head = ScalarHead(399)
    assert head(torch.zeros(2, 5, 399)).shape == (2, 5)
    assert torch.count_nonzero(head.summary.bias) == 0
    assert head.summary.weight.std().item() == pytest.approx(1 / 20, rel=0.2)


def test_texts_longer_than_the_context_are_cut_to_it_from_the_left():
    """A learned-position backbone (GPT-2, 16 positions) scores a 100-character text as its last 16 tokens."""
    rm = load_reward_model("tiny:gpt2?hidden=32&layers=1&heads=4&vocab=300&ctx=16")
    tail = "y" * 16
    long, cut = rm.score_texts(["x" * 100 + tail, tail])
    assert math.isfinite(long) and long == pytest.approx(cut, abs=1e-5)


def test_scoring_refuses_a_model_with_no_trained_head(tmp_path):
    from quartet.models import load_causal_lm, save_model

    save_model(*load_causal_lm(TINY), tmp_path / "lm")
    for name in (str(tmp_path / "lm"), TINY):
        with pytest.raises(ModelError, match="no trained reward head"):
            load_reward_model(name, trained=True)
    saved = save_reward_model(load_reward_model(TINY), tmp_path / "rm")
    assert load_reward_model(str(saved), trained=True).backbone == TINY


def test_scorer_autocast_runs_the_matmuls_in_bf16_from_bf16_linears_and_keeps_the_rest_fp32(tmp_path):
    from quartet.rollout.scoring import Scorer

    torch.manual_seed(0)
    rm = load_reward_model(TINY)
    rm.set_normalization(0.25, 3.0)
    out = str(save_reward_model(rm, tmp_path / "rm"))
    prompts = ["Say something."] * len(TEXTS)
    full, low = Scorer(out), Scorer(out, autocast=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in low.reward_model.named_parameters()}
    assert {d for n, d in dtypes.items() if n.endswith("proj.weight") or "score" in n} == {torch.bfloat16}
    assert {d for n, d in dtypes.items() if "embed" in n or "norm" in n} == {torch.float32}
    assert low.reward_model.mean.dtype == torch.float32
    x, y = full(prompts, TEXTS), low(prompts, TEXTS)
    assert y.dtype == torch.float32 and not torch.equal(x, y)  # the bf16 matmuls ran
    assert torch.allclose(x, y, atol=0.05 * float(x.abs().max()) + 1e-3)
    device = next(full.reward_model.parameters()).device.type  # the GPU where there is one (Scorer places it)
    with torch.autocast(device, dtype=torch.bfloat16):  # what the fp32 model gives under the same autocast
        expected = full.reward_model.score_texts([render_conversation(full.reward_model.tokenizer, p, t)
                                                  for p, t in zip(prompts, TEXTS)])
    torch.testing.assert_close(y, torch.as_tensor(expected, dtype=torch.float32), rtol=0, atol=1e-6)
