"""An evaluation's bad cases: the prompts the next round of feedback should spend its labels on.

InstructGPT collected its comparisons again on the improved policy; the cheapest place to start the next round is
where this one failed. From one evaluation's per-response scores (``samples.jsonl``'s records), per prompt (the mean
of its samples: prompts are the independent draws), three rankings, worst first:

    low_score     the evaluated policy's lowest judge scores (gold; the reward model's when there is no gold judge)
    rm_disagrees  where the reward model and the gold judge disagree most on the policy's answers: the gap between
                  the prompt's percentile rank under each (ranks, since the two scales are unrelated); a positive
                  gap is an answer the reward model likes more than the judge does, the kind PPO learns to exploit
    regression    the policy's judge score minus the baseline's on the same prompt, drawn with the same seeds (a
                  paired difference), most negative first

The rows take the reasons in turn (the worst of each, then the next of each), each prompt once, up to ``n``. A row
is a prompts-file row (``quartet label prompts.path=...`` reads its `prompt`; the other keys say why it is there):
``{"prompt", "reason", "prompt_index", "checkpoint", "responses", "gold", "rm", "score" | "rank_gap" | "diff"}``.
"""

from __future__ import annotations

from collections import defaultdict, deque

REASONS = ("low_score", "rm_disagrees", "regression")
TIE_EPS = 1e-9
"""a regression smaller than this is none"""


def pick_bad_cases(records: list[dict], policy: str, baseline: str, n: int) -> list[dict]:
    """Up to `n` bad-case rows from eval records (``{"checkpoint", "prompt_index", "prompt", "response", "gold"?,
    "rm"?}``) of checkpoint `policy`, compared with `baseline` (the same name: no regressions)."""
    mine = _per_prompt(records, policy)
    if not mine or n <= 0:
        return []
    first = next(iter(mine.values()))
    judge = "gold" if "gold" in first else "rm" if "rm" in first else None
    ranked: dict[str, list[tuple[int, dict]]] = {}
    if judge is not None:
        ranked["low_score"] = [(i, {"score": p[judge]}) for i, p in sorted(mine.items(), key=lambda t: t[1][judge])]
    if judge == "gold" and "rm" in first:
        gaps = _rank_gaps(mine)
        order = sorted((i for i in gaps if gaps[i] != 0), key=lambda i: -abs(gaps[i]))
        ranked["rm_disagrees"] = [(i, {"rank_gap": gaps[i]}) for i in order]
    theirs = _per_prompt(records, baseline) if baseline != policy and judge is not None else {}
    if theirs:
        diffs = {i: p[judge] - theirs[i][judge] for i, p in mine.items() if i in theirs}
        order = sorted((i for i in diffs if diffs[i] < -TIE_EPS), key=lambda i: diffs[i])
        ranked["regression"] = [(i, {"diff": diffs[i]}) for i in order]

    queues = {reason: deque(ranked[reason]) for reason in REASONS if reason in ranked}  # worst first
    rows, taken = [], set()
    while len(rows) < n and any(queues.values()):
        for reason, queue in queues.items():
            while queue and queue[0][0] in taken:  # picked already, for another reason
                queue.popleft()
            if queue and len(rows) < n:
                i, detail = queue.popleft()
                taken.add(i)
                p = mine[i]
                rows.append({"prompt": p["prompt"], "reason": reason, "prompt_index": i, "checkpoint": policy,
                             "responses": p["responses"], **{k: p[k] for k in ("gold", "rm") if k in p}, **detail})
    return rows


def _per_prompt(records: list[dict], checkpoint: str) -> dict[int, dict]:
    """prompt index -> {"prompt", "responses", and the mean over its samples of each score present}, in order."""
    rows: dict[int, list[dict]] = defaultdict(list)
    for rec in records:
        if rec["checkpoint"] == checkpoint:
            rows[rec["prompt_index"]].append(rec)
    out = {}
    for i in sorted(rows):
        recs = sorted(rows[i], key=lambda r: r.get("sample", 0))
        p = {"prompt": recs[0]["prompt"], "responses": [r["response"] for r in recs]}
        for key in ("gold", "rm"):
            if all(r.get(key) is not None for r in recs):
                p[key] = sum(r[key] for r in recs) / len(recs)
        out[i] = p
    return out


def _rank_gaps(prompts: dict[int, dict]) -> dict[int, float]:
    """prompt index -> percentile rank under rm minus percentile rank under gold, each in [0, 1]."""
    index = list(prompts)
    rm = percentile_ranks([prompts[i]["rm"] for i in index])
    gold = percentile_ranks([prompts[i]["gold"] for i in index])
    return {i: r - g for i, r, g in zip(index, rm, gold)}


def percentile_ranks(values: list[float]) -> list[float]:
    """Each value's rank among `values` scaled to [0, 1] (0 the lowest), tied values sharing their mean rank."""
    if len(values) < 2:
        return [0.5] * len(values)
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in range(start, end + 1):
            ranks[order[k]] = (start + end) / 2
        start = end + 1
    return [r / (len(values) - 1) for r in ranks]
