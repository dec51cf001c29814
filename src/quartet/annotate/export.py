"""People's rankings -> the preference pairs `quartet rm` and `quartet dpo` read.

A ranking of an item's K answers, best group first, gives one pair for every two answers in different groups:
K(K-1)/2 less the pairs inside a tie group, which say nothing about order (InstructGPT, Ouyang et al. 2022 sec. 3.5,
trains on all C(K,2) comparisons of a ranking). A flagged answer is in no pair. A pair of two texts that are the same
once stripped, or with an empty answer, is dropped: the preference reader refuses both.

Each row is {"prompt", "chosen", "rejected", "item", "annotator", "group"}; the readers of quartet.data take the first
three and ignore the rest, so the file feeds `quartet rm` / `quartet dpo` as it is. `group` is the item id: one prompt's
answers (`rm.group_by_prompt` keeps a prompt's pairs in one batch).

Several people on one item: by default every person's pairs are kept (a pair two people agree on counts twice, a pair
they disagree on appears both ways, and Bradley-Terry fits their split); `majority=True` keeps a pair once, and only
the order more than half the item's people gave.

    quartet annotate --out runs/annotate --export runs/annotate/prefs.jsonl [--judge task:positive-review] [--majority]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from quartet.annotate import agreement
from quartet.annotate.store import LOG, load_session
from quartet.atomic import atomic_write_files
from quartet.errors import ConfigError, DataError
from quartet.judges.bounded import JUDGE_TIMEOUT
from quartet.outputs import check_output_file

MARK = "quartet annotate export"
"""the agreement file's `written_by`: it marks the three files as Quartet's, so an export may replace them"""


@dataclass
class ExportCounts:
    judgments: int = 0
    """live rank judgments read (a person's last one per item)"""
    items: int = 0
    """items ranked at least once"""
    skips: int = 0
    """live skips (no pairs)"""
    pairs: int = 0
    """rows written"""
    tied: int = 0
    """answer pairs inside a tie group (with majority: pairs the majority tied), dropped"""
    flagged: int = 0
    """answers flagged as unusable, left out of their ranking"""
    identical: int = 0
    """pairs of two texts that are the same once stripped, dropped"""
    empty: int = 0
    """pairs with an empty answer, dropped"""
    no_majority: int = 0
    """with majority: answer pairs no order or tie won more than half the item's people, dropped"""


def export(items: Sequence, judgments: Sequence, majority: bool = False,
           where: str = "judgments") -> tuple[list[dict], ExportCounts]:
    """(rows, counts) from the items and the live judgments (see the module docstring). `where` names the log in a
    DataError for a judgment of an unknown item or an answer index the item does not have."""
    by_id = {it.id: it for it in items}
    live = agreement.latest_rankings(judgments)
    counts = ExportCounts(judgments=len(live), skips=sum(j.event == "skip" for j in judgments))
    for (item_id, person), j in live.items():
        item = by_id.get(item_id)
        if item is None:
            raise DataError(f"{where}: {person}'s judgment {j.id} names item {item_id}, which is not among the "
                            f"{len(by_id)} items; export with the items the annotation ran on")
        bad = [i for group in j.ranking for i in group if not 0 <= i < len(item.answers)]
        if bad:
            raise DataError(f"{where}: {person}'s judgment {j.id} ranks answer {bad[0]} of item {item_id}, which has "
                            f"{len(item.answers)} answers")
        counts.flagged += len(j.flags)
    counts.items = len({item for item, _ in live})
    rows: list[dict] = []
    if majority:
        _majority(by_id, live, rows, counts)
    else:
        for (item_id, person), j in live.items():
            counts.tied += agreement.tied_pairs(j.ranking)
            for better, worse in agreement.strict_pairs(j.ranking):
                _add(rows, counts, by_id[item_id], better, worse, person)
    counts.pairs = len(rows)
    return rows, counts


def _majority(by_id: dict, live: dict, rows: list[dict], counts: ExportCounts) -> None:
    """One row per answer pair whose order more than half of the item's people gave (a person who flagged one of
    the two answers gave none)."""
    people: dict[str, dict[str, dict]] = {}
    for (item_id, person), j in live.items():
        people.setdefault(item_id, {})[person] = agreement.pair_labels(j.ranking)
    for item_id, labels in people.items():
        n = len(labels)
        for i, k in sorted({pair for lab in labels.values() for pair in lab}):
            votes = {c: sorted(p for p, lab in labels.items() if lab.get((i, k)) == c) for c in agreement.LABELS}
            won = [c for c, who in votes.items() if 2 * len(who) > n]
            if not won:
                counts.no_majority += 1
            elif won[0] == "tie":
                counts.tied += 1
            else:
                better, worse = (i, k) if won[0] == "first" else (k, i)
                _add(rows, counts, by_id[item_id], better, worse, ",".join(votes[won[0]]))


def _add(rows: list[dict], counts: ExportCounts, item, better: int, worse: int, annotator: str) -> None:
    chosen, rejected = item.answers[better], item.answers[worse]
    if not chosen.strip() or not rejected.strip():
        counts.empty += 1
    elif chosen.strip() == rejected.strip():
        counts.identical += 1
    else:
        rows.append({"prompt": item.prompt, "chosen": chosen, "rejected": rejected, "item": item.id,
                     "annotator": annotator, "group": item.id})


# --------------------------------------------------------------------------- the command
def sidecars(output: Path) -> tuple[Path, Path]:
    """prefs.jsonl -> (prefs.summary.md, prefs.agreement.json)"""
    return output.with_name(f"{output.stem}.summary.md"), output.with_name(f"{output.stem}.agreement.json")


def check_outputs(output: Path) -> None:
    """Refuse a folder, a link or a user's file at any of the three paths; they are Quartet's when the agreement file
    beside the pairs says an export wrote it."""
    summary_path, agreement_path = sidecars(output)
    owned = _written_by_export(agreement_path)
    for path, what in ((output, ""), (summary_path, " (its summary)"), (agreement_path, " (its agreement file)")):
        check_output_file(path, owned, f"annotate --export{what}")


def _written_by_export(path: Path) -> bool:
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() and not path.is_symlink() else None
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("written_by") == MARK


def judge_scores(items: Sequence, spec: str, timeout: float | None = JUDGE_TIMEOUT) -> dict[str, list[float]]:
    """Every answer of `items` scored by a reward spec or a reward-model dir (quartet.rollout.scoring.Scorer)."""
    # the Scorer's module loads transformers (seconds): only an export with --judge pays for it
    from quartet.rollout.scoring import Scorer

    scorer = Scorer(spec, timeout=timeout)
    prompts = [it.prompt for it in items for _ in it.answers]
    scores = scorer(prompts, [a for it in items for a in it.answers]).tolist() if prompts else []
    out, start = {}, 0
    for it in items:
        out[it.id] = scores[start : start + len(it.answers)]
        start += len(it.answers)
    return out


def write_export(out_dir: str | Path, output: str | Path, judge: str | None = None, majority: bool = False,
                 judge_timeout: float | None = JUDGE_TIMEOUT) -> ExportCounts:
    """Read an annotation folder, write the pairs, `<stem>.summary.md` and `<stem>.agreement.json` as one."""
    out_dir, output = Path(out_dir), Path(output)
    if output.suffix.lower() != ".jsonl":
        raise ConfigError(f"annotate --export: {output} is not a .jsonl file; the pairs are written as JSONL, which "
                          f"quartet rm and dpo read by that extension")
    check_outputs(output)
    items, judgments = load_session(out_dir)
    rows, counts = export(items, judgments, majority, where=str(out_dir / LOG))
    if not rows:
        raise DataError(f"{out_dir / LOG}: no preference pairs to export ({_counted(counts)}); rank some items first")
    ranked = {item for item, _ in agreement.latest_rankings(judgments)}
    scored = [it for it in items if it.id in ranked]
    scores = judge_scores(scored, judge, judge_timeout) if judge else None
    report = agreement.summary(scored, judgments, scores)
    judge_name = judge or ("the samples' score column" if report["judge"] is not None else None)
    text = _summary(out_dir, output, counts, report, judge_name, majority)
    data = {"written_by": MARK, "folder": str(out_dir), "output": str(output), "majority": majority,
            "judge_spec": judge, "judge_source": None if report["judge"] is None else "spec" if judge else "score",
            "counts": asdict(counts), **report}
    summary_path, agreement_path = sidecars(output)
    atomic_write_files({output: "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                        summary_path: text, agreement_path: json.dumps(data, indent=2) + "\n"})
    print(text)
    return counts


def _counted(c: ExportCounts) -> str:
    return (f"{c.judgments} rankings, {c.skips} skips, {c.tied} tied pairs, {c.flagged} flagged answers, "
            f"{c.identical} identical and {c.empty} empty pairs")


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _summary(out_dir: Path, output: Path, c: ExportCounts, report: dict, judge: str | None, majority: bool) -> str:
    people = report["people"]
    lines = [f"# annotate export: {out_dir}", "",
             "## pairs",
             f"- rankings (a person's last per item): {c.judgments}, on {c.items} items; skips: {c.skips}",
             f"- pairs written: {c.pairs}" + (" (one per answer pair the majority ordered)" if majority
                                             else " (every person's pairs)"),
             f"- dropped: {c.tied} tied, {c.identical} identical texts, {c.empty} with an empty answer"
             + (f", {c.no_majority} without a majority" if majority else ""),
             f"- answers flagged unusable (in no pair): {c.flagged}", "",
             "## agreement between people",
             f"- items ranked by 2+ people: {people['items']} ({', '.join(people['annotators']) or 'none'})"]
    if people["items"]:
        lines += [f"- pairwise agreement: {_fmt(people['agreement'])} over {people['comparisons']} strict comparisons",
                  f"- {people['kappa_kind']} kappa: {_fmt(people['kappa'])} over {people['units']} answer pairs"]
    lines += ["", f"## agreement with the judge: {judge or 'none given (--judge, or a score column)'}"]
    if report["judge"]:
        lines += ["", "| annotator | pairs | agree | 95% CI | judge ties | unscored |", "|---|---|---|---|---|---|"]
        lines += [f"| {a['annotator']} | {a['pairs']} | {_fmt(a['share'])} | "
                  f"[{_fmt(a['ci_low'])}, {_fmt(a['ci_high'])}] | {a['judge_ties']} | {a['unscored']} |"
                  for a in report["judge"]]
    lines += ["", "## output", f"- preference pairs: {output}", f"- next: quartet rm data.path={output}"]
    return "\n".join(lines) + "\n"


def cli(args) -> int:
    """`quartet annotate --out DIR --export FILE [--judge SPEC] [--majority]` (called by quartet.annotate.command)."""
    write_export(args.out, args.export, judge=args.judge, majority=args.majority,
                 judge_timeout=getattr(args, "judge_timeout", JUDGE_TIMEOUT))
    return 0
