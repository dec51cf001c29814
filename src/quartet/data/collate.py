"""Token ids for the three things a model reads: prompts to continue, demonstrations, scored conversations.

- :func:`encode_prompts`: rendered prompts -> ids, long ones truncated from the left or dropped;
  left truncation cuts the *text* of the last user turn and keeps the chat template around it, so
  the model still sees a well-formed chat ending in the generation prompt.
- :func:`encode_sft`: (prompt, completion) -> ids + labels; labels are -100 on the prompt, and the
  completion ends with the end-of-turn / EOS token the policy must learn to emit.
- :func:`encode_pairs`: (prompt, response) -> ids as a reward model reads them, cut from the left so
  the end of the response (where the score is read) always survives.
- :func:`left_pad` / :func:`right_pad`: ragged lists -> (B, L) id and mask tensors.

Prompt and completion are tokenized separately and concatenated, so the prompt ids of an SFT row
are exactly the ids the policy is later prompted with (see :func:`quartet.data.templates.split_conversation`).
Nothing is cut or dropped silently: every call that does logs a WARNING with the counts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

import torch

from quartet.data.schemas import Prompt
from quartet.data.templates import (
    as_messages,
    render_conversation,
    render_prompt,
    split_conversation,
    uses_template,
)
from quartet.errors import DataError, ModelError

log = logging.getLogger("quartet")

IGNORE_INDEX = -100
"""label of tokens that carry no loss (the prompt part of an SFT row); torch's cross_entropy default"""

_SENTINEL = "\ue000quartet-content\ue000"  # private-use characters no template rewrites


@dataclass
class EncodedPrompts:
    input_ids: list[list[int]]
    """token ids of each kept prompt (chat template applied), at most max_prompt_tokens long"""
    texts: list[str]
    """the rendered text of each kept prompt (after truncation)"""
    kept: list[int]
    """index into the input prompts of each kept row"""
    num_truncated: int = 0
    num_dropped: int = 0


class EncodedSFT(list):
    """A list of ``(input_ids, labels)`` pairs that also says how many rows were cut or dropped."""

    def __init__(self, rows=(), kept=(), num_truncated: int = 0, num_dropped: int = 0):
        super().__init__(rows)
        self.kept: list[int] = list(kept)
        self.num_truncated = num_truncated
        self.num_dropped = num_dropped


@dataclass
class _Specials:
    """Ids a tokenizer adds around plain text by itself (BOS, or [CLS] ... [SEP] for BERT)."""

    prefix: list[int] = field(default_factory=list)
    suffix: list[int] = field(default_factory=list)


# --------------------------------------------------------------------------- prompts
def encode_prompts(
    tokenizer,
    prompts: list[Prompt],
    max_prompt_tokens: int,
    truncation: Literal["left", "drop"] = "left",
    chat_template: bool = True,
    where: str = "prompts",
) -> EncodedPrompts:
    """Render and tokenize prompts for generation; ``where`` names the source in messages.

    Items may be :data:`Prompt` values or objects with a ``.prompt`` (e.g. ``PromptExample``).
    Raises DataError when every prompt is dropped, or when a prompt's template alone leaves no room
    for its text under left truncation.
    """
    if truncation not in ("left", "drop"):
        raise DataError(f"{where}: truncation must be 'left' or 'drop', got {truncation!r}")
    if max_prompt_tokens < 1:
        raise DataError(f"{where}: max_prompt_tokens must be > 0, got {max_prompt_tokens}")
    prompts = [getattr(p, "prompt", p) for p in prompts]
    templated = uses_template(tokenizer, chat_template)
    prefix = [] if templated else _specials(tokenizer).prefix
    texts = [render_prompt(tokenizer, p, chat_template) for p in prompts]
    all_ids = [prefix + ids for ids in _encode(tokenizer, texts)]

    out = EncodedPrompts([], [], [])
    longest = 0
    for i, (prompt, text, ids) in enumerate(zip(prompts, texts, all_ids)):
        if len(ids) > max_prompt_tokens:
            longest = max(longest, len(ids))
            if truncation == "drop":
                out.num_dropped += 1
                continue
            ids, text = _truncate_prompt(tokenizer, prompt, ids, max_prompt_tokens, chat_template, prefix,
                                         f"{where} #{i + 1}")
            out.num_truncated += 1
        out.input_ids.append(ids)
        out.texts.append(text)
        out.kept.append(i)

    if prompts and not out.kept:
        raise DataError(
            f"{where}: all {len(prompts)} prompts are longer than max_prompt_tokens={max_prompt_tokens} "
            f"(longest {longest} tokens) and truncation is 'drop'; raise max_prompt_tokens or use truncation: left"
        )
    if out.num_truncated or out.num_dropped:
        action = "truncated from the left" if truncation == "left" else "dropped"
        log.warning(
            "%s: %d of %d prompts were longer than max_prompt_tokens=%d (longest %d tokens) and were %s",
            where, out.num_truncated + out.num_dropped, len(prompts), max_prompt_tokens, longest, action,
        )
    return out


def _truncate_prompt(tokenizer, prompt: Prompt, ids: list[int], budget: int, chat_template: bool,
                     prefix: list[int], where: str) -> tuple[list[int], str]:
    """Keep the template around the last user turn and cut that turn's text from the left."""
    parts = _around_content(tokenizer, prompt, chat_template)
    if parts is None:  # a template that rewrites the content: fall back to the last tokens
        ids = ids[-budget:]
        return ids, tokenizer.decode(ids)
    pre, content, post = parts
    pre_ids, content_ids, post_ids = _encode(tokenizer, [pre, content, post])
    pre_ids = prefix + pre_ids
    room = budget - len(pre_ids) - len(post_ids)
    if room < 1:
        raise DataError(
            f"{where}: the chat template and earlier turns take {len(pre_ids) + len(post_ids)} tokens, which "
            f"leaves no room for the prompt text within max_prompt_tokens={budget}; raise max_prompt_tokens"
        )
    kept = content_ids[-room:]
    return pre_ids + kept + post_ids, pre + tokenizer.decode(kept) + post


def _around_content(tokenizer, prompt: Prompt, chat_template: bool) -> tuple[str, str, str] | None:
    """Rendered prompt split as (text before, content of the last user turn, text after), or None."""
    if isinstance(prompt, str):
        content, probe = prompt, _SENTINEL
    else:
        msgs = as_messages(prompt)
        users = [j for j, m in enumerate(msgs) if m["role"] == "user"]
        if not users:
            return None
        j = users[-1]
        content = msgs[j]["content"]
        probe = [dict(m, content=_SENTINEL) if k == j else m for k, m in enumerate(msgs)]
    text = render_prompt(tokenizer, probe, chat_template)
    if text.count(_SENTINEL) != 1:
        return None
    pre, post = text.split(_SENTINEL)
    if pre + content + post != render_prompt(tokenizer, prompt, chat_template):
        return None
    return pre, content, post


# --------------------------------------------------------------------------- SFT
def encode_sft(tokenizer, examples, max_seq_len: int, chat_template: bool = True) -> EncodedSFT:
    """``(input_ids, labels)`` per example: labels are -100 on the prompt and the completion ids after.

    Examples need ``.prompt`` and ``.completion`` (``SFTExample``). The completion ends with the
    tokenizer's EOS (with a chat template: the template's end-of-turn, text after it is dropped).
    Rows longer than ``max_seq_len`` lose the end of their completion; rows whose prompt leaves no
    completion token are dropped. Both are counted on the result and logged.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ModelError("tokenizer has no eos_token; SFT needs one to teach the model where answers end")
    templated = uses_template(tokenizer, chat_template)
    prefix = [] if templated else _specials(tokenizer).prefix
    heads, rests = zip(*[split_conversation(tokenizer, ex.prompt, ex.completion, chat_template)
                         for ex in examples]) if examples else ((), ())
    head_ids = _encode(tokenizer, list(heads))
    rest_ids = _encode(tokenizer, list(rests))

    out = EncodedSFT()
    for i, (p_ids, c_ids) in enumerate(zip(head_ids, rest_ids)):
        p_ids = prefix + p_ids
        c_ids = _end_at_eos(c_ids, eos)
        if len(p_ids) + len(c_ids) > max_seq_len:
            room = max_seq_len - len(p_ids)
            if room < 1:
                out.num_dropped += 1
                continue
            c_ids = c_ids[:room]
            out.num_truncated += 1
        out.append((p_ids + c_ids, [IGNORE_INDEX] * len(p_ids) + c_ids))
        out.kept.append(i)

    if examples and not out:
        raise DataError(
            f"SFT data: every one of the {len(examples)} prompts fills max_seq_len={max_seq_len} by itself, "
            f"leaving no completion token to train on; raise max_seq_len"
        )
    if out.num_truncated or out.num_dropped:
        log.warning(
            "SFT data: %d of %d rows were longer than max_seq_len=%d: %d had their completion cut at the end, "
            "%d were dropped (the prompt alone fills max_seq_len)",
            out.num_truncated + out.num_dropped, len(examples), max_seq_len, out.num_truncated, out.num_dropped,
        )
    return out


def _end_at_eos(ids: list[int], eos: int) -> list[int]:
    """Cut after the last EOS (a template's trailing newline is never generated), or append one."""
    for j in range(len(ids) - 1, -1, -1):
        if ids[j] == eos:
            return ids[: j + 1]
    return ids + [eos]


# --------------------------------------------------------------------------- reward-model input
def encode_pairs(tokenizer, prompts: list[Prompt], responses: list[str], max_seq_len: int,
                 chat_template: bool = True) -> list[list[int]]:
    """Ids of each (prompt, response) conversation as a reward model reads it, cut from the left.

    The text is :func:`~quartet.data.templates.render_conversation`; the tokenizer's own special
    tokens (e.g. BERT's [CLS] ... [SEP]) are added when there is no chat template, and kept when cutting.
    """
    if len(prompts) != len(responses):
        raise DataError(f"encode_pairs: {len(prompts)} prompts but {len(responses)} responses")
    templated = uses_template(tokenizer, chat_template)
    specials = _Specials() if templated else _specials(tokenizer)
    room = max_seq_len - len(specials.prefix) - len(specials.suffix)
    if room < 1:
        raise DataError(f"max_seq_len={max_seq_len} leaves no room for text after the tokenizer's special tokens")
    texts = [render_conversation(tokenizer, p, r, chat_template) for p, r in zip(prompts, responses)]
    out, cut = [], 0
    for ids in _encode(tokenizer, texts):
        if len(ids) > room:
            ids = ids[-room:]
            cut += 1
        out.append(specials.prefix + ids + specials.suffix)
    if cut:
        log.warning("reward model input: %d of %d conversations were longer than max_seq_len=%d and lost their "
                    "first tokens", cut, len(texts), max_seq_len)
    return out


# --------------------------------------------------------------------------- padding
def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), both (B, P) long; real tokens flush right, mask 1 on them (prompts for generation)."""
    return _pad(seqs, pad_id, left=True)


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), both (B, T) long; real tokens flush left (training rows; pad labels with -100)."""
    return _pad(seqs, pad_id, left=False)


def _pad(seqs: list[list[int]], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if not s:
            continue
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols] = torch.as_tensor(s, dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


# --------------------------------------------------------------------------- tokenizer helpers
def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens added (templates write their own)."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def _specials(tokenizer) -> _Specials:
    """What the tokenizer adds around plain text by itself: found by encoding one word both ways."""
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return _Specials(list(full[:start]), list(full[start + len(bare) :]))
    return _Specials()
