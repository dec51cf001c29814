"""An `llm:<model>` judge in the stages: label ranks each prompt's K answers by their wins over each other, eval
counts a checkpoint's wins against the baseline's answers.

The judge itself (a model loaded here or an OpenAI-compatible server, its rubric, the verdict cache) is
quartet.judges.llm's. Here is what the stages do with it: every pair judged in both orders
(quartet.judges.pairwise.judge_both_orders; llm_judge.orders: agree makes an order-dependent verdict a tie,
average decides by the two orders' mean log-odds), a tally of how often the order decided a verdict (position bias)
and how often neither answer won (ties), and the check preflight makes before any model loads. A pair of identical texts is a tie without asking: no judge can prefer a text to itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from quartet.config import LLMJudgeConfig
from quartet.judges.llm import is_llm_spec, llm_model, load_llm_judge, openai_judge, read_rubric
from quartet.judges.pairwise import Prompt, Verdicts, all_pairs, judge_both_orders, rank_by_wins
from quartet.judges.verdict_cache import CachedJudge
from quartet.models.names import resolve_model
from quartet.tasks import get_task


def task_rubric(prompts_path: str) -> str | None:
    """The rubric of the task whose prompts `prompts_path` (`task:<name>/<split>`) names; None for other prompt sets
    and for a task without one (the judge's generic rubric then applies)."""
    if not prompts_path.startswith("task:"):
        return None
    return get_task(prompts_path[len("task:"):].split("/")[0]).rubric or None


def check_llm_judge(spec: str, cfg: LLMJudgeConfig, where: str) -> None:
    """What `load_llm_judge` would refuse, found without loading a model: the settings, the spec, a rubric file, and
    then a local model's name (resolved, nothing loaded) or the server's URL, key and model (one GET of its model
    list). `where`: the stage's section (`label`, `eval`); errors name `<where>.judge` or `<where>.llm_judge.<key>`."""
    settings = f"{where}.llm_judge"
    cfg.validate(settings)
    model = llm_model(spec, f"{where}.judge")
    rubric = read_rubric(cfg.rubric, None, settings)
    if cfg.resolved_backend == "openai":  # built as load_llm_judge builds it, so the check is the one it makes
        openai_judge(model, cfg, rubric, settings).check()
    else:
        resolve_model(model)


def open_llm_judge(spec: str, cfg: LLMJudgeConfig, prompts_path: str, cache: Path | None,
                   where: str) -> CachedJudge:
    """The stage's judge: its rubric cfg.rubric, else the prompts' task's, else the generic one; its verdicts cached
    in `cache` (None: not cached). Loads the local model, or asks the server for its models once."""
    return load_llm_judge(spec, cfg, task_rubric(prompts_path), cache, where)


@dataclass
class Tally:
    """What a judge decided over a stage's pairs, each judged in both orders."""

    pairs: int = 0
    """pairs judged (pairs of identical texts are not asked, and not counted)"""
    biased: int = 0
    """pairs whose two verdicts both went to the answer shown first, or both to the one shown second"""
    ties: int = 0
    """pairs neither answer won (agree: the orders disagreed, or a verdict inside the tie margin; average: the mean
    log-odds inside it)"""

    def add(self, verdicts: Verdicts) -> None:
        n = len(verdicts.winner)
        self.pairs += n
        self.biased += round(verdicts.position_bias * n)  # a share of n pairs: an integer up to float rounding
        self.ties += sum(w == 0 for w in verdicts.winner)

    @property
    def position_bias(self) -> float | None:
        return self.biased / self.pairs if self.pairs else None

    @property
    def tie_rate(self) -> float | None:
        return self.ties / self.pairs if self.pairs else None


class PairwiseRanker:
    """The label stage's judge for an `llm:` spec, called as a quartet.rollout.scoring.Scorer is: (prompts,
    answers) -> one score per answer, the answers `k` per prompt in order.

    A prompt's distinct non-empty answers are judged in all their pairs, both orders (made one verdict by `rule`,
    llm_judge.orders), and each scores its share of wins (a tie half: quartet.judges.pairwise.rank_by_wins); a repeated answer scores what its first copy does and an
    empty one 0 (no pair can hold them, label's make_pairs leaves them out). All pairs of one call go to the judge
    together; a CachedJudge commits their verdicts a chunk at a time, so a run killed half-way pays again only for
    the chunk it was in."""

    def __init__(self, judge: CachedJudge, k: int, rule: str = "agree"):
        self.judge, self.k, self.rule, self.tally = judge, k, rule, Tally()

    def __call__(self, prompts: list[Prompt], answers: list[str]) -> torch.Tensor:
        starts = range(0, len(answers), self.k)
        groups = [list(dict.fromkeys(a for a in answers[s : s + self.k] if a.strip())) for s in starts]
        rows = [(prompts[s], group[i], group[j]) for s, group in zip(starts, groups) for i, j in all_pairs(len(group))]
        winner: list[int] = []
        if rows:
            asked, firsts, seconds = map(list, zip(*rows))
            verdicts = judge_both_orders(self.judge, asked, firsts, seconds, rule=self.rule)
            self.tally.add(verdicts)
            winner = verdicts.winner
        scores, at = [], 0
        for s, group in zip(starts, groups):
            n = len(all_pairs(len(group)))
            wins = dict(zip(group, rank_by_wins(len(group), winner[at : at + n])))
            at += n
            scores += [wins.get(a, 0.0) for a in answers[s : s + self.k]]
        # float64: win fractions such as 1/3 stay what rank_by_wins gave in the answers file and the pairs
        return torch.tensor(scores, dtype=torch.float64)

    def close(self) -> None:
        """Close the verdict cache (every verdict in it is committed already)."""
        if self.judge.cache is not None:
            self.judge.cache.close()


def judged_wins(judge: CachedJudge, prompts: list[Prompt], a: list[str], b: list[str], tally: Tally,
                rule: str = "agree") -> list[float]:
    """Per row, how a_i did against b_i over both orders, made one verdict by `rule` (llm_judge.orders): 1 a won,
    0 b did, 0.5 a tie (agree: the orders disagreed; average: no lean either way; or the two are the same text, a
    tie not asked). The judged pairs are added to `tally`."""
    asked = [r for r in range(len(a)) if a[r] != b[r]]
    out = [0.5] * len(a)
    if asked:
        verdicts = judge_both_orders(judge, [prompts[r] for r in asked], [a[r] for r in asked],
                                     [b[r] for r in asked], rule=rule)
        tally.add(verdicts)
        for r, w in zip(asked, verdicts.winner):
            out[r] = (1 + w) / 2
    return out


__all__ = ["PairwiseRanker", "Tally", "check_llm_judge", "is_llm_spec", "judged_wins", "open_llm_judge",
           "task_rubric"]
