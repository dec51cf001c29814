"""Tiny random models for tests and smoke runs: ``tiny:<arch>?hidden=64&layers=2&heads=4&vocab=512&seed=0``.

The weights are drawn from the architecture's own initialiser under ``seed``, so the same spec gives
the same model on every machine. The tokenizer is built locally with the ``tokenizers`` library:
byte-level (every string encodes, nothing is unknown) plus four specials and a ChatML-style chat
template, so the chat-template path of the real models is exercised by the tiny ones too.
"""

from __future__ import annotations

from urllib.parse import parse_qsl

import torch
import transformers  # its own lazy module: the classes below load when first used, not with quartet.models
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from quartet.errors import ModelError

PAD, EOT, IM_START, IM_END = "<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = [PAD, EOT, IM_START, IM_END]
NUM_BYTE_TOKENS = 256
MIN_VOCAB = NUM_BYTE_TOKENS + len(SPECIALS)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

DEFAULTS = {"hidden": 64, "layers": 2, "heads": 4, "vocab": 512, "ctx": 512, "seed": 0, "kv_heads": 0}
"""spec keys: hidden size H, layers, attention heads, vocab size V (>= 260), context length, init seed, key/value
heads (llama only; 0: one per attention head, fewer: grouped-query attention as in SmolLM2 and Llama 3)"""

# spec key -> config field, per architecture
ARCHS = {
    "llama": {
        "hidden": "hidden_size",
        "layers": "num_hidden_layers",
        "heads": "num_attention_heads",
        "vocab": "vocab_size",
        "ctx": "max_position_embeddings",
    },
    "gpt2": {"hidden": "n_embd", "layers": "n_layer", "heads": "n_head", "vocab": "vocab_size", "ctx": "n_positions"},
}


def parse_tiny_spec(name: str) -> tuple[str, dict[str, int]]:
    """``tiny:llama?hidden=32`` -> ("llama", {hidden: 32, layers: 2, ...}); one-line ModelError on anything bad."""
    body = name[len("tiny:") :]
    arch, _, query = body.partition("?")
    if arch not in ARCHS:
        raise ModelError(f"model '{name}': unknown tiny architecture '{arch}' (known: {', '.join(ARCHS)})")
    params = dict(DEFAULTS)
    for key, raw in parse_qsl(query, keep_blank_values=True):
        if key not in DEFAULTS:
            raise ModelError(f"model '{name}': unknown tiny key '{key}' (known: {', '.join(DEFAULTS)})")
        try:
            value = int(raw)
        except ValueError:
            raise ModelError(f"model '{name}': tiny key '{key}' must be an integer, got '{raw}'") from None
        if value < 0 or (value == 0 and key not in ("seed", "kv_heads")):
            raise ModelError(f"model '{name}': tiny key '{key}' must be > 0, got {value}")
        params[key] = value
    if params["hidden"] % params["heads"]:
        raise ModelError(f"model '{name}': hidden={params['hidden']} is not divisible by heads={params['heads']}")
    if params["kv_heads"] and (arch != "llama" or params["heads"] % params["kv_heads"]):
        raise ModelError(f"model '{name}': kv_heads={params['kv_heads']} must divide heads={params['heads']} "
                         f"(llama only)")
    if params["vocab"] < MIN_VOCAB:
        raise ModelError(f"model '{name}': vocab must be >= {MIN_VOCAB} (256 bytes + 4 specials), got {params['vocab']}")
    return arch, params


def build_tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Byte-level tokenizer, ids 0-3 = <pad>, <|endoftext|>, <|im_start|>, <|im_end|> (= EOS), 4-259 = bytes."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=IM_END,  # the assistant turn ends with <|im_end|>, so generation stops there
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[EOT, IM_START],
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "left"
    return tok


def build_tiny(
    name: str, dtype: torch.dtype = torch.float32
) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerFast]:
    """Random-init causal LM + byte tokenizer from a ``tiny:`` spec; deterministic by its seed, and the same
    model in every dtype: initialised in float32, then cast (transformers versions differ in whether an init in
    bf16 draws the same numbers: 5.17 does not, so a bf16 tiny model there was another model)."""
    arch, p = parse_tiny_spec(name)
    tok = build_tiny_tokenizer()
    fields = {ARCHS[arch][k]: p[k] for k in ("hidden", "layers", "heads", "vocab", "ctx")}
    if arch == "llama":
        fields["intermediate_size"] = 4 * p["hidden"]
        fields["tie_word_embeddings"] = False
        fields["num_key_value_heads"] = p["kv_heads"] or p["heads"]
    config = transformers.AutoConfig.for_model(
        arch,
        **fields,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.convert_tokens_to_ids(IM_START),
    )
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(p["seed"])
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(dtype), tok
