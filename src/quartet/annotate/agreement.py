"""How far people agree with each other, and with an AI judge, on the answers they ranked.

Every statistic reads a ranking as labels of answer pairs: for answers i < j of one item, "first" (i ranked in a
better group), "second" (j better) or "tie" (one group). An answer the person flagged is in no pair of theirs.

- Agreement between people, on items two or more of them ranked: the share of (item, pair of people, answer pair)
  comparisons that both ordered strictly and ordered the same way; and a chance-corrected kappa over the three labels:
  Cohen's (1960) when exactly two people ranked the shared items, Fleiss' (1971) when more did (any number per item;
  with a different number of ratings per pair, each pair's agreement uses its own count, which is Fleiss' formula
  when the count is constant).
- Agreement with a judge, per person: the share of the person's strict pairs that the judge's scores order the same
  way, among the pairs the judge orders at all (a judge's tie orders nothing: counted, left out), with a Wilson (1927)
  score interval. The pairs of one ranking are not independent (they share answers), so the interval is narrower
  than it should be when people rank many answers per item; read it as a floor on the uncertainty.

For scale: InstructGPT's labellers agreed with each other 72.6 +- 1.5% of the time (Ouyang et al. 2022, sec. 3.4).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from quartet.algo.stats import wilson_interval

LABELS = ("first", "second", "tie")
"""the label of answer pair (i, j), i < j: i better, j better, or tied"""


def pair_labels(ranking: Sequence[Sequence[int]]) -> dict[tuple[int, int], str]:
    """{(i, j): label} for every pair i < j of the answers a ranking (groups best first) holds."""
    group = {i: g for g, members in enumerate(ranking) for i in members}
    ranked = sorted(group)
    return {(i, j): "tie" if group[i] == group[j] else "first" if group[i] < group[j] else "second"
            for a, i in enumerate(ranked) for j in ranked[a + 1 :]}


def strict_pairs(ranking: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """(better, worse) for every pair of answers in different groups, best group first: K(K-1)/2 less the pairs inside
    a tie group. [[0], [2, 3], [1]] -> (0, 2), (0, 3), (0, 1), (2, 1), (3, 1)."""
    return [(i, j) for g, better in enumerate(ranking) for worse in ranking[g + 1 :] for i in better for j in worse]


def tied_pairs(ranking: Sequence[Sequence[int]]) -> int:
    """Answer pairs inside one group of a ranking: each group of n ties n(n-1)/2 pairs."""
    return sum(len(g) * (len(g) - 1) // 2 for g in ranking)


def latest_rankings(judgments: Iterable) -> dict[tuple[str, str], object]:
    """Each person's last live rank judgment per item, {(item, annotator): judgment}, in log order: a person who
    ranked an item twice (two tabs) counts once, with the ranking they gave last."""
    out: dict[tuple[str, str], object] = {}
    for j in judgments:
        if j.event == "rank":
            out.pop((j.item, j.annotator), None)
            out[(j.item, j.annotator)] = j
    return out


# --------------------------------------------------------------------------- kappa
def cohen_kappa(a: Sequence[str], b: Sequence[str]) -> float | None:
    """Cohen's kappa of two raters' labels of the same units: (p_o - p_e) / (1 - p_e), p_e from each rater's own
    label shares. None when it is undefined (no units, or both raters gave one and the same label throughout)."""
    if len(a) != len(b):
        raise ValueError(f"two raters need labels of the same units, got {len(a)} and {len(b)}")
    n = len(a)
    if not n:
        return None
    p_o = sum(x == y for x, y in zip(a, b)) / n
    p_e = sum((a.count(c) / n) * (b.count(c) / n) for c in set(a) | set(b))
    return None if p_e >= 1.0 else (p_o - p_e) / (1.0 - p_e)


def fleiss_kappa(table: Sequence[Sequence[int]]) -> float | None:
    """Fleiss' kappa of a table with one row per unit and one count per label (how many raters gave it); units with
    fewer than 2 ratings are left out. Each unit's agreement P_i = (sum_c n_ic^2 - n_i) / (n_i (n_i - 1)) uses its
    own n_i; p_c pools every rating. None when undefined (no unit, or one label throughout)."""
    rows = [list(r) for r in table if sum(r) >= 2]
    if not rows:
        return None
    agree = [(sum(c * c for c in r) - sum(r)) / (sum(r) * (sum(r) - 1)) for r in rows]
    total = sum(map(sum, rows))
    p_e = sum((sum(col) / total) ** 2 for col in zip(*rows))
    return None if p_e >= 1.0 else (sum(agree) / len(agree) - p_e) / (1.0 - p_e)


@dataclass
class RaterAgreement:
    items: int
    """items ranked by two or more people"""
    annotators: list[str]
    """the people who ranked those items"""
    comparisons: int
    """(item, pair of people, answer pair) comparisons both people ordered strictly"""
    agreement: float | None
    """share of those comparisons ordered the same way"""
    kappa: float | None
    """chance-corrected agreement on the labels first / second / tie (None: undefined, or nothing to compare)"""
    kappa_kind: str | None
    """cohen (two people), fleiss (more), None (no item ranked by two)"""
    units: int
    """(item, answer pair) units the kappa counts: labelled by two or more people"""


def rater_agreement(judgments: Iterable) -> RaterAgreement:
    """Agreement among people on the items two or more of them ranked (see the module docstring)."""
    by_item: dict[str, dict[str, dict]] = {}
    for (item, person), j in latest_rankings(judgments).items():
        by_item.setdefault(item, {})[person] = pair_labels(j.ranking)
    shared = {item: people for item, people in by_item.items() if len(people) >= 2}
    names = sorted({p for people in shared.values() for p in people})
    same = strict = 0
    units: list[dict[str, str]] = []  # per (item, answer pair): person -> label
    for people in shared.values():
        persons = sorted(people)
        for x, a in enumerate(persons):
            for b in persons[x + 1 :]:
                for pair, la in people[a].items():
                    lb = people[b].get(pair)
                    if la != "tie" and lb not in (None, "tie"):
                        strict += 1
                        same += la == lb
        for pair in sorted({pair for labels in people.values() for pair in labels}):
            votes = {p: labels[pair] for p, labels in people.items() if pair in labels}
            if len(votes) >= 2:
                units.append(votes)
    kappa, kind = None, None
    if len(names) == 2:
        both = [u for u in units if len(u) == 2]
        kappa, kind = cohen_kappa([u[names[0]] for u in both], [u[names[1]] for u in both]), "cohen"
    elif names:
        counts = [[list(u.values()).count(c) for c in LABELS] for u in units]
        kappa, kind = fleiss_kappa(counts), "fleiss"
    return RaterAgreement(len(shared), names, strict, same / strict if strict else None, kappa, kind, len(units))


# --------------------------------------------------------------------------- agreement with a judge
@dataclass
class JudgeAgreement:
    annotator: str
    pairs: int
    """the person's strict pairs the judge orders strictly"""
    agree: int
    """of those, the pairs the judge orders the same way"""
    share: float | None
    """agree / pairs (None without pairs)"""
    ci_low: float
    ci_high: float
    """Wilson 95% interval of share (nan without pairs)"""
    judge_ties: int
    """the person's strict pairs the judge scores equal: left out of share"""
    unscored: int
    """the person's strict pairs with an answer the judge gave no score"""


def judge_agreement(judgments: Iterable, scores: dict[str, Sequence[float | None]]) -> list[JudgeAgreement]:
    """Per person (by name), how often the judge's scores order their strict pairs as they did. `scores`: item id ->
    one score per answer (None: not scored)."""
    tally: dict[str, Counter] = {}
    for (item, person), j in latest_rankings(judgments).items():
        t = tally.setdefault(person, Counter())
        s = scores.get(item)
        for better, worse in strict_pairs(j.ranking):
            hi, lo = (s[better], s[worse]) if s is not None else (None, None)
            if hi is None or lo is None:
                t["unscored"] += 1
            else:
                t["agree" if hi > lo else "disagree" if hi < lo else "ties"] += 1
    out = []
    for person in sorted(tally):
        agree, disagree, ties, unscored = (tally[person][k] for k in ("agree", "disagree", "ties", "unscored"))
        n = agree + disagree
        out.append(JudgeAgreement(person, n, agree, agree / n if n else None, *wilson_interval(agree, n), ties,
                                  unscored))
    return out


def summary(items: Sequence, judgments: Sequence, scores: dict[str, Sequence[float | None]] | None = None) -> dict:
    """Everything above as one JSON-able dict (the server's /api/agreement, the export's agreement file). Without
    `scores`, the judge is the items' own `score` column when any answer has one."""
    if scores is None and any(s is not None for it in items for s in it.scores):
        scores = {it.id: it.scores for it in items}
    ranked = [j for j in judgments if j.event == "rank"]
    return {
        "judgments": len(ranked),
        "annotators": sorted({j.annotator for j in ranked}),
        "people": _finite(asdict(rater_agreement(ranked))),
        "judge": [_finite(asdict(a)) for a in judge_agreement(ranked, scores)] if scores else None,
    }


def _finite(d: dict) -> dict:
    """NaN -> None: JSON has no NaN, and a browser's JSON.parse refuses Python's."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in d.items()}
