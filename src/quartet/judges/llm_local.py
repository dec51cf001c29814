"""An LLM judge run here: any model Quartet loads, read from its next-token log-probs, with no generation.

Each row becomes the judge chat of quartet.judges.pairwise.judge_messages (system = the rubric; user = the prompt
and the answers labelled A and B), rendered with the judge model's own chat template and its assistant generation
prompt, so the next token the model would write is its verdict (a model with no template reads the two messages
as plain text ending in "Verdict:" and a newline; a template that refuses a system message gets the rubric at the
head of the user's). One forward per batch reads it:

- pairwise: log-odds = log p(A) - log p(B). A letter's probability sums every single token the model writes it as
  at that position: "A" and " A" (found by encoding the prompt with each appended, so "▁A" in a SentencePiece
  vocabulary and "ĠA" in a byte-level one are found the same way). After a generation prompt that ends in a newline
  (ChatML, Llama 3) the bare letter is the likely one; after one that does not ("[/INST]") the spaced one.
- pointwise: the rating 1-9 as its expected value, sum_r r p(r) / sum_r p(r), over the ratings the model can
  write, so a model that also puts mass on other tokens is read as the rating it gives when it gives one. The
  scale stops at 9 so that every rating is one token in every vocabulary: "10" is "1" then "0" in many (SmolLM2,
  Llama's), where a server asked for one token would read a 10 as a 1 (quartet.judges.llm_http), and the two
  backends would disagree. Digits are read as written straight after the generation prompt (no leading space).
  A pair is then compared by the difference of its two ratings, so the two orders agree exactly (no position
  bias, by construction).

The model runs in `dtype` ("auto": bf16 where the hardware computes it natively, as the samplers decide,
quartet.models.precision.generation_dtype; else fp32): a judge prompt is long (the rubric, the prompt, two answers)
and its forward is the cost of judging (SmolLM2-135M, one CPU thread with AVX-512 BF16, batches of 8: 0.55 s per
~200-token row in fp32, 0.28 s in bf16). The output layer runs in float32 either way (`Float32Head`), and log-probs are a float32
log-softmax; the dtype is part of the judge's name, so a verdict cache never mixes the two.

Rows are batched by length with left padding and position ids that count real tokens only
(quartet.algo.position_ids_from_mask, the rule every forward here follows), so a row's verdict is the same in any
batch up to float rounding (tests/judges/test_llm_judge.py argues the bound).

Context: a row longer than the model's context is cut, never passed over it: the cut is shared evenly (the longest
parts cut first, to one common length) between the prompt, which keeps its end (its question; a review opening
to continue), and the answers, which keep their beginning (what they say first); each cut part is marked "[...]".
A rubric so long that no room is left is a ConfigError. `truncated` counts the rows cut.
"""

from __future__ import annotations

import torch
from torch import nn

from quartet.algo.positions import position_ids_from_mask
from quartet.batching import by_length
from quartet.errors import ConfigError, ModelError
from quartet.judges.pairwise import PROMPT_VERSION, judge_messages
from quartet.models.loading import context_length, load_causal_lm
from quartet.models.names import resolve_model
from quartet.models.precision import compute_device, generation_dtype, precision_name

CUT = "[...]"
"""marks where a cut part's text was left out, so the judge does not read a cut answer as one that stops there"""
_MEMO_LIMIT = 65536
"""pointwise ratings remembered per judge (the reversed order of a pair asks for the same two again)"""


class LocalLLMJudge:
    """A pairwise judge (quartet.judges.pairwise.PairwiseJudge) on a model loaded by quartet.models.load_causal_lm.

    `model`: any name that loader accepts; `where`: how errors name the setting (`label.judge`); `dtype`: "auto",
    "bf16" or "fp32" (module docstring). The model runs on the GPU when there is one, else on the CPU."""

    def __init__(self, model: str, rubric: str, mode: str = "pairwise", batch_size: int = 16,
                 where: str = "judge", dtype: str = "auto"):
        if mode not in ("pairwise", "pointwise"):
            raise ValueError(f"LocalLLMJudge: mode must be pairwise or pointwise, got {mode!r}")
        if dtype not in ("auto", "bf16", "fp32"):
            raise ValueError(f"LocalLLMJudge: dtype must be auto, bf16 or fp32, got {dtype!r}")
        source = resolve_model(model)
        self.dtype = precision_name(dtype)  # what "auto" is on this hardware: the name says what computed
        self.name = f"llm:{model}|local|{mode}|{self.dtype}|{source.key}|p{PROMPT_VERSION}"
        self.rubric, self.mode, self.batch_size, self.where = rubric, mode, batch_size, f"{where} '{model}'"
        self.model, self.tokenizer = load_causal_lm(model, generation_dtype(dtype))
        self.model.eval().requires_grad_(False)
        head = self.model.get_output_embeddings()
        if type(head) is nn.Linear and head.weight.dtype != torch.float32:
            self.model.set_output_embeddings(Float32Head(head))
        self.model.to(compute_device())
        self.device = next(self.model.parameters()).device
        tok = self.tokenizer
        self.templated = bool(getattr(tok, "chat_template", None))
        self.system_role = self.templated and self._renders_system()
        # plain text gets what the tokenizer itself puts before text (a BOS); a template writes its own
        bare, full = tok("a", add_special_tokens=False)["input_ids"], tok("a")["input_ids"]
        self.prefix = [] if self.templated or full[-len(bare):] != bare else list(full[: len(full) - len(bare)])
        limit = context_length(self.model)
        if limit is None and tok.model_max_length < 10**8:
            limit = tok.model_max_length
        self.truncated = 0
        self._memo: dict[tuple[str, str], float] = {}
        probe = self._text("p", "a", None if mode == "pointwise" else "b")
        if mode == "pairwise":
            self.a_ids, self.b_ids = self._letter_ids(probe, "A"), self._letter_ids(probe, "B")
        else:
            self.digit_ids = self._rating_ids(probe)
        self.budget = limit

    # ------------------------------------------------------------------ the prompt
    def _renders_system(self) -> bool:
        """Whether the chat template takes a system message (Gemma's, for one, raises on it)."""
        try:
            self.tokenizer.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                                               tokenize=False, add_generation_prompt=True)
        except Exception:  # jinja's TemplateError, or what the template's own raise_exception gives
            return False
        return True

    def _text(self, prompt: str, first: str, second: str | None) -> str:
        """The judge prompt of one row, ending where the model writes its verdict."""
        messages = judge_messages(self.rubric, prompt, first, second)
        if not self.templated:
            return f"{messages[0]['content']}\n\n{messages[1]['content']}\n\nVerdict:\n"
        if not self.system_role:  # the rubric heads the user message instead
            messages = [{"role": "user", "content": f"{messages[0]['content']}\n\n{messages[1]['content']}"}]
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja raises TemplateError/TypeError for messages a template rejects
            raise ModelError(f"{self.where}: its chat template failed on the judge prompt "
                             f"({type(e).__name__}: {e})") from None

    def _encode(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        return [self.prefix + list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def _appended(self, probe: str, text: str) -> list[int] | None:
        """The tokens `text` is written as right after `probe`; None when appending it re-tokenises the probe."""
        head, full = self._encode([probe, probe + text])
        return full[len(head):] if full[: len(head)] == head else None

    def _letter_ids(self, probe: str, letter: str) -> list[int]:
        ids = []
        for variant in (letter, " " + letter):
            new = self._appended(probe, variant)
            if new is not None and len(new) == 1 and new[0] not in ids:
                ids.append(new[0])
        if not ids:
            raise ModelError(f"{self.where}: its tokenizer writes the verdict {letter!r} as more than one token after "
                             f"the judge prompt, so it cannot be read from one next-token distribution")
        return ids

    def _rating_ids(self, probe: str) -> list[int]:
        """Token ids of the ratings 1-9."""
        ids = []
        for r in range(1, 10):
            new = self._appended(probe, str(r))
            if new is None or len(new) != 1:
                raise ModelError(f"{self.where}: its tokenizer writes the rating {r} as more than one token after "
                                 f"the judge prompt, so it cannot be read from one next-token distribution")
            ids.append(new[0])
        return ids

    # ------------------------------------------------------------------ fitting a row into the context
    def _rows(self, rows: list[tuple[str, str, str | None]]) -> list[list[int]]:
        """Token ids of each row's judge prompt, cut to fit the context (module docstring)."""
        seqs = self._encode([self._text(*row) for row in rows])
        if self.budget is not None:
            seqs = [ids if len(ids) <= self.budget else self._fit(row, len(ids)) for row, ids in zip(rows, seqs)]
        return seqs

    def _fit(self, row: tuple[str, str, str | None], length: int) -> list[int]:
        parts = [p for p in row if p is not None]
        tokens = [list(ids) for ids in self.tokenizer(parts, add_special_tokens=False)["input_ids"]]
        room = self.budget - (length - sum(map(len, tokens)))  # what the rubric and template leave the parts
        for _ in range(8):  # the marks, and a cut encoded again, can take a few tokens more: cut again
            cap = water_level([len(t) for t in tokens], room)
            if cap < 1:
                break
            decode = self.tokenizer.decode
            cut = [f"{CUT} {decode(tokens[0][-cap:])}" if len(tokens[0]) > cap else parts[0]]
            cut += [f"{decode(ids[:cap])} {CUT}" if len(ids) > cap else part for part, ids in zip(parts[1:], tokens[1:])]
            ids = self._encode([self._text(cut[0], cut[1], cut[2] if len(cut) == 3 else None)])[0]
            if len(ids) <= self.budget:
                self.truncated += 1
                return ids
            room -= len(ids) - self.budget
        raise ConfigError(f"{self.where}: the judge prompt (rubric and chat template) leaves no room for the prompt "
                          f"and answers in the model's context of {self.budget} tokens; shorten "
                          f"the rubric or use a judge model with a longer context")

    # ------------------------------------------------------------------ reading the verdicts
    @torch.no_grad()
    def _forward(self, seqs: list[list[int]], read) -> list[float]:
        """`read(logprobs)` of every row, logprobs (b, V) float32 at the last position; rows batched
        by length, left-padded (here, as quartet.data.left_pad does: the data layer sits above the judges)."""
        out: list[float] = [0.0] * len(seqs)
        pad = self.tokenizer.pad_token_id
        for idx in by_length(seqs, self.batch_size):
            width = max(len(seqs[i]) for i in idx)
            ids = torch.full((len(idx), width), pad, dtype=torch.long)  # (b, T)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, width - len(seqs[i]):] = torch.tensor(seqs[i])
                mask[row, width - len(seqs[i]):] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                                use_cache=False, logits_to_keep=1).logits[:, -1]  # (b, V)
            values = read(torch.log_softmax(logits.float(), dim=-1)).tolist()
            for row, i in enumerate(idx):
                out[i] = values[row]
        return out

    def _log_odds(self, logprobs: torch.Tensor) -> torch.Tensor:
        return torch.logsumexp(logprobs[:, self.a_ids], dim=-1) - torch.logsumexp(logprobs[:, self.b_ids], dim=-1)

    def _expected_rating(self, logprobs: torch.Tensor) -> torch.Tensor:
        logp = logprobs[:, self.digit_ids]  # (b, 9): log p(1) ... log p(9)
        values = torch.arange(1, 10, dtype=logp.dtype, device=logp.device)
        return (torch.softmax(logp, dim=-1) * values).sum(-1)

    def score(self, prompts: list[str], answers: list[str]) -> list[float]:
        """Pointwise mode: each answer's expected rating, in [1, 9]."""
        if self.mode != "pointwise":
            raise ValueError("LocalLLMJudge.score: a pointwise judge's method (this one is pairwise)")
        todo = list(dict.fromkeys((p, a) for p, a in zip(prompts, answers) if (p, a) not in self._memo))
        if todo:
            seqs = self._rows([(p, a, None) for p, a in todo])
            if len(self._memo) + len(todo) > _MEMO_LIMIT:
                self._memo.clear()
            self._memo.update(zip(todo, self._forward(seqs, self._expected_rating)))
        return [self._memo[(p, a)] for p, a in zip(prompts, answers)]

    def compare(self, prompts: list[str], firsts: list[str], seconds: list[str]) -> list[float]:
        """Log-odds that each first answer is the better (pointwise: the difference of the two ratings)."""
        if not len(prompts) == len(firsts) == len(seconds):
            raise ValueError(f"compare: {len(prompts)} prompts, {len(firsts)} firsts, {len(seconds)} seconds")
        if self.mode == "pointwise":
            scores = self.score(list(prompts) * 2, list(firsts) + list(seconds))
            return [a - b for a, b in zip(scores[: len(firsts)], scores[len(firsts):])]
        return self._forward(self._rows(list(zip(prompts, firsts, seconds))), self._log_odds)


class Float32Head(nn.Module):
    """A bf16 (fp16) model's output layer in float32, its input cast up: logits written in bf16 are rounded to 8
    significant bits, so logits near 20 (SmolLM2's) move in steps of 1/8 and so would the verdicts, two answers
    tying exactly where the model prefers one. The weights are the model's own, cast exactly (an untied copy of a
    tied embedding); only the last position of each row goes through it, one V x H product per row."""

    def __init__(self, head: nn.Linear):
        super().__init__()
        self.weight = nn.Parameter(head.weight.detach().float(), requires_grad=False)
        self.bias = None if head.bias is None else nn.Parameter(head.bias.detach().float(), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(hidden.float(), self.weight, self.bias)


def water_level(lengths: list[int], room: int) -> int:
    """The largest cap c with sum(min(length, c)) <= room: every part longer than c is cut to c, the others kept."""
    lo, hi = 0, max(lengths, default=0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(min(n, mid) for n in lengths) <= room:
            lo = mid
        else:
            hi = mid - 1
    return lo


__all__ = ["CUT", "Float32Head", "LocalLLMJudge", "water_level"]
