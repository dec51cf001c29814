"""Pairwise judges: which of two answers to one prompt is better, read in both orders, and K answers ranked by wins.

A pairwise judge (an LLM asked "A or B?", quartet.judges.llm) returns log-odds that the first answer is the better
one. LLM judges prefer a position (Zheng et al. 2023, "Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena",
table 2: GPT-4 kept its verdict under a swap in 65% of pairs, GPT-3.5 in 46%), so every pair is judged in both
orders, and the two verdicts make one by a rule (`ORDERS`):

- agree: a winner only when both orders pick the same answer; a verdict that follows the position instead of the
  answer is a tie. Strict: no pair is decided by where an answer was shown.
- average: the two orders' log-odds averaged, (ab - ba) / 2, as RLAIF does (Lee et al. 2023, "RLAIF: Scaling
  Reinforcement Learning from Human Feedback with AI Feedback", sec. 2.1: two inferences with the candidates
  swapped, their preference distributions averaged). The position's pull is the same in both orders and cancels;
  what is left is the judge's preference between the answers. A judge with a strong position bias (SmolLM2-135M
  answers "A" in both orders for nearly every pair) gives only ties under agree; averaging keeps its residual
  preference, weak as it is.

K answers to a prompt are then ranked by their share of wins over all K(K-1)/2 pairs (ties half), the score the
label stage pairs them by.

The judge prompt (`judge_messages`) is shared by every backend, so one rubric asks one question wherever it runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

Prompt = str | list[dict]
"""a prompt as the stages hold it: its text, or chat messages"""

PROMPT_VERSION = 2
"""version of the judge prompt below; part of every judge's name, so cached verdicts of another wording are never
read back as this one's (2: the pointwise scale 1-9, every rating one token in any vocabulary)"""
ORDERS = ("agree", "average")
"""how the two orders' verdicts make a pair's (module docstring)"""


class PairwiseJudge(Protocol):
    name: str
    """a stable id of the judge: model, backend, mode (the verdict cache's key includes it)"""

    def compare(self, prompts: list[str], firsts: list[str], seconds: list[str]) -> list[float]:
        """Log-odds that `first` is the better answer (> 0 first, < 0 second), one per row, in this order only."""
        ...


@dataclass
class Verdicts:
    """One pair per row, judged as (a, b) and as (b, a)."""

    winner: list[int]
    """+1 a is better, -1 b is better, 0 a tie (agree: the two orders disagree, or a verdict within the tie margin;
    average: the averaged log-odds within it)"""
    ab: list[float]
    """log-odds that a beats b, a shown first"""
    ba: list[float]
    """log-odds that b beats a, b shown first"""
    position_bias: float
    """share of pairs whose two verdicts both went to the same position: the order decided them, not the answers"""
    ties: float
    """share of pairs with winner 0"""


def prompt_text(prompt: Prompt) -> str:
    """A prompt as one text: itself, or a chat's turns as `role: content` lines (the judge reads the conversation)."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def _sign(x: float, margin: float) -> int:
    return 1 if x > margin else -1 if x < -margin else 0


def judge_both_orders(judge: PairwiseJudge, prompts: Sequence[Prompt], a: Sequence[str], b: Sequence[str],
                      tie_margin: float = 0.0, rule: str = "agree") -> Verdicts:
    """Judge each pair (a_i, b_i) once in each order, one `compare` call per order (the judge batches inside).

    A verdict is decided when its |log-odds| > tie_margin. rule agree: a wins when it wins in both orders, b
    likewise; any other outcome is a tie: one order undecided, or both orders picking the same position (position
    bias). rule average: a wins when (ab - ba) / 2 > tie_margin, b when it is < -tie_margin, else a tie. Position
    bias is counted the same way under both rules."""
    if not len(prompts) == len(a) == len(b):
        raise ValueError(f"judge_both_orders: {len(prompts)} prompts, {len(a)} a, {len(b)} b")
    if rule not in ORDERS:
        raise ValueError(f"judge_both_orders: rule must be one of {', '.join(ORDERS)}, got {rule!r}")
    texts = [prompt_text(p) for p in prompts]
    ab = [float(x) for x in judge.compare(texts, list(a), list(b))]
    ba = [float(x) for x in judge.compare(texts, list(b), list(a))]
    winner, biased = [], 0
    for x, y in zip(ab, ba):
        first, second = _sign(x, tie_margin), _sign(y, tie_margin)  # +1: the answer shown first won
        winner.append(_sign((x - y) / 2, tie_margin) if rule == "average" else first if first == -second else 0)
        biased += first != 0 and first == second
    n = max(len(winner), 1)
    return Verdicts(winner, ab, ba, biased / n, sum(w == 0 for w in winner) / n)


def all_pairs(k: int) -> list[tuple[int, int]]:
    """Every pair (i, j), i < j, of k answers, in the order `rank_by_wins` reads verdicts."""
    return list(itertools.combinations(range(k), 2))


def rank_by_wins(k: int, winner: Sequence[int]) -> list[float]:
    """Each of k answers' share of wins over its k - 1 pairs, a tie counting half.

    `winner`: one verdict per pair of `all_pairs(k)`, +1 when the pair's first answer (i) won, -1 when j did.
    A lone answer (k = 1) has no pair and scores 0.5, as if tied."""
    pairs = all_pairs(k)
    if len(winner) != len(pairs):
        raise ValueError(f"rank_by_wins: {k} answers make {len(pairs)} pairs, got {len(winner)} verdicts")
    wins = [0.0] * k
    for (i, j), w in zip(pairs, winner):
        wins[i] += 1.0 if w > 0 else 0.5 if w == 0 else 0.0
        wins[j] += 1.0 if w < 0 else 0.5 if w == 0 else 0.0
    return [w / (k - 1) for w in wins] if k > 1 else [0.5] * k


# --------------------------------------------------------------------------- the judge prompt
SYSTEM = "You judge answers to a prompt by these principles:\n{rubric}"
PAIRWISE = (
    "Which answer is better by the principles?\n\n"
    "Prompt:\n{prompt}\n\n"
    "Answer A:\n{first}\n\n"
    "Answer B:\n{second}\n\n"
    "Reply with one letter: A or B."
)
POINTWISE = (
    "Rate the answer by the principles, from 1 (worst) to 9 (best).\n\n"
    "Prompt:\n{prompt}\n\n"
    "Answer:\n{answer}\n\n"
    "Reply with one digit from 1 to 9."
)


def judge_messages(rubric: str, prompt: str, first: str, second: str | None = None) -> list[dict]:
    """The chat a judge reads: the rubric as the system message; the prompt and the answers labelled A and B (or
    the one answer to rate, `second` None) as the user's."""
    user = (POINTWISE.format(prompt=prompt, answer=first) if second is None
            else PAIRWISE.format(prompt=prompt, first=first, second=second))
    return [{"role": "system", "content": SYSTEM.format(rubric=rubric)}, {"role": "user", "content": user}]


__all__ = ["ORDERS", "PROMPT_VERSION", "PairwiseJudge", "Prompt", "Verdicts", "all_pairs", "judge_both_orders",
           "judge_messages", "prompt_text", "rank_by_wins"]
