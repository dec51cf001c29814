"""Stage 2, AI feedback: sample K answers per prompt, let a judge score them, keep the clear pairs.

Beside the pairs, every answer goes to `<output stem>.samples.jsonl` with its score: what the judge saw, and draws
from the policy that the reward model's normalisation can use instead of sampling again (`rm.normalize_responses`).

InstructGPT had labellers rank K answers; here a judge (any reward function, e.g. a task's gold
judge) scores them instead. Pairing: the best against the worst answer of each prompt, or every pair
whose score gap exceeds `min_gap`. Pairs at most `min_gap` apart are ties: dropped and counted, as are
empty and duplicate answers (a preference file cannot hold them). Human-labelled preference files skip
this stage and go straight to `quartet rm`; `judge: none` only samples, writing the answers file (score null) for
people to rank in `quartet annotate`.

An `llm:<model>` judge (AI feedback from a language model under a rubric, quartet.rollout.judging) ranks each
prompt's K answers instead of scoring them one by one: all K(K-1)/2 pairs, each judged in both orders (made one
verdict as llm_judge.orders says), each answer scored by its share of wins (ties half), then paired by the same rules. Its verdicts go to a cache beside the pairs
(`<stem>.verdicts.sqlite`) as they come, so a run killed half-way and run again (the same seed samples the same
answers) pays only for the verdicts it had not got.

    quartet label policy=runs/sft/model prompts.path=task:positive-review/train num_samples=4
    quartet label ... judge=llm:smollm2-135m-instruct
"""

from __future__ import annotations

import itertools
import json
import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from quartet.atomic import atomic_write_files
from quartet.config import LabelConfig, config_text, load_config, load_yaml, validate
from quartet.config.stages import NO_JUDGE
from quartet.data import encode_prompts, left_pad, load_prompts
from quartet.errors import ConfigError, DataError
from quartet.judges.llm import cache_file
from quartet.models import load_causal_lm
from quartet.models.loading import check_context
from quartet.monitor import Progress
from quartet.monitor.tracking import open_trackers
from quartet.outputs import check_output_file, run_lock
from quartet.preflight import check_names
from quartet.rollout.engine import make_engine
from quartet.rollout.judging import PairwiseRanker, is_llm_spec, open_llm_judge
from quartet.rollout.scoring import Scorer
from quartet.trainers import loop

log = logging.getLogger("quartet")


@dataclass
class LabelCounts:
    prompts: int = 0
    samples: int = 0
    pairs: int = 0
    ties: int = 0
    """candidate pairs whose score gap was <= min_gap (best-worst: prompts whose best ~ worst)"""
    empty: int = 0
    """empty answers, left out before pairing"""
    duplicates: int = 0
    """answers identical to another answer of the same prompt, left out before pairing"""
    too_few: int = 0
    """prompts with fewer than two distinct non-empty answers"""


@dataclass
class LabelResult:
    output: Path
    counts: LabelCounts
    score_mean: float | None
    """mean judge score over every sampled answer (None with `judge: none`)"""
    gap_mean: float | None
    """mean chosen - rejected score over the kept pairs (None with `judge: none`)"""
    seconds: float
    summary: Path = field(default=None)
    judge_stats: dict = field(default_factory=dict)
    """an `llm:` judge's tally as the trackers log it (label/judge_pairs, label/position_bias, label/judge_ties,
    label/judge_calls, label/cache_hits); empty for any other judge"""


def label(cfg: LabelConfig, overwrite: bool = False) -> LabelResult:
    """Sample, judge, pair and write. `overwrite` (the CLI's --overwrite) allows nothing more: the stage replaces
    only files it wrote, and refuses any other file at one of its paths (check_outputs)."""
    validate(cfg)
    output = Path(cfg.output)
    check_outputs(output, verdicts_path(cfg))
    with run_lock(output, "label.output"):
        return _label(cfg, output)


def check_outputs(output: Path, verdicts: Path | None = None) -> None:
    """Refuse to write any of the stage's files (the pairs, the answers, the config, the summary) over a folder, a
    link, or a file Quartet did not write. They are Quartet's when the config beside the pairs is a label
    stage's config: a user's file at one of these paths is never replaced. `verdicts`: an `llm:` judge's verdict
    cache (verdicts_path), refused here as a folder or a link; a file there is kept and added to only when it is a
    verdict cache, which the cache checks itself (quartet.judges.verdict_cache), before any model loads: the cache a
    run killed half-way left, before its config was written, is how the rerun pays only for the rest."""
    owned = _is_label_config(_sidecar(output, "config.yaml"))
    for path, what in _files(output):
        check_output_file(path, owned, f"label.output{what}")
    if verdicts is not None:
        check_output_file(verdicts, True, "label.llm_judge.cache")


def verdicts_path(cfg: LabelConfig) -> Path | None:
    """The verdict cache of an `llm:` judge: "auto" = `<output stem>.verdicts.sqlite` beside the pairs, else the
    path set; None for another judge or with `llm_judge.cache: null`."""
    if not is_llm_spec(cfg.judge) or cfg.llm_judge.cache is None:
        return None
    if cfg.llm_judge.cache == "auto":
        return _sidecar(Path(cfg.output), "verdicts.sqlite")
    return cache_file(cfg.llm_judge.cache, Path(cfg.output).parent)


def _files(output: Path) -> list[tuple[Path, str]]:
    """Every file the stage writes, and how an error names it."""
    return [(output, ""), (samples_path(output), " (its answers file)"),
            (_sidecar(output, "config.yaml"), " (its config)"), (_sidecar(output, "summary.md"), " (its summary)")]


def _is_label_config(path: Path) -> bool:
    try:
        data = load_yaml(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and {"policy", "prompts", "judge", "output"} <= set(data)


def samples_path(output: str | Path) -> Path:
    """Where the label stage writing `output` puts every answer it sampled, with its score."""
    return _sidecar(Path(output), "samples.jsonl")


def _label(cfg: LabelConfig, output: Path) -> LabelResult:
    loop.seed_everything(cfg.seed)
    timer = loop.Timer()
    # 1. inputs first, so a bad name, file or judge fails before any model loads
    check_names("label", cfg)
    examples = load_prompts(cfg.prompts)
    # reward model (any tokenizer) or reward function; none: people judge the answers later (`quartet annotate`)
    judge = None if cfg.judge == NO_JUDGE else _judge(cfg)
    model, tok = load_causal_lm(cfg.policy, torch.float32)
    model.to(loop.compute_device())
    encoded = encode_prompts(tok, examples, cfg.prompts.max_prompt_tokens, cfg.prompts.truncation,
                             cfg.prompts.chat_template, where=cfg.prompts.path)
    check_context(model, encoded.input_ids, cfg.generation.max_new_tokens, f"label.policy '{cfg.policy}'",
                  "lower prompts.max_prompt_tokens or generation.max_new_tokens")
    prompts = [examples[i].prompt for i in encoded.kept]
    engine = make_engine(model, tok, cfg.generation, loop.generation_dtype("auto"))
    del model  # the engine holds its own low-precision copy

    # 2. sample K answers per prompt and score them, a batch of prompts at a time
    counts = LabelCounts(prompts=len(prompts))
    rows, all_scores, samples = [], [], []
    per_call = max(1, cfg.generation.batch_size // cfg.num_samples)  # prompts per generate call
    bar = Progress(len(prompts), "label", keys={"label/pairs": "pairs", "label/ties": "ties"}, every=per_call)
    for start in range(0, len(prompts), per_call):
        chunk = list(range(start, min(start + per_call, len(prompts))))
        ids, mask = left_pad([encoded.input_ids[i] for i in chunk], tok.pad_token_id)
        rollout = engine.generate(ids, mask, seed=cfg.seed + start, num_samples=cfg.num_samples)
        answers = rollout.responses
        asked = [prompts[i] for i in chunk for _ in range(cfg.num_samples)]
        scores = judge(asked, answers).tolist() if judge is not None else [None] * len(answers)
        all_scores += scores
        for j, i in enumerate(chunk):
            k = slice(j * cfg.num_samples, (j + 1) * cfg.num_samples)
            samples += [{"prompt": prompts[i], "completion": answer, "score": score, "sample": n}
                        for n, (answer, score) in enumerate(zip(answers[k], scores[k]))]
            if judge is None:
                continue
            for chosen, rejected, cs, rs in make_pairs(answers[k], scores[k], cfg.pairing, cfg.min_gap, counts):
                rows.append({"prompt": prompts[i], "chosen": chosen, "rejected": rejected,
                             "chosen_score": cs, "rejected_score": rs})
        counts.pairs = len(rows)
        bar.update(len(chunk), {"label/pairs": counts.pairs, "label/ties": counts.ties}, n=len(chunk))
    bar.close()
    if isinstance(judge, PairwiseRanker):
        judge.close()  # every verdict is committed; the cache's file is left whole, its write-ahead log folded in
    counts.samples = len(all_scores)
    if judge is None:
        return _write_answers_only(cfg, output, samples, LabelResult(output, counts, None, None, timer.seconds))
    if not rows:
        raise DataError(
            f"label: no pairs from {counts.prompts} prompts ({counts.ties} ties at min_gap={cfg.min_gap}, "
            f"{counts.empty} empty answers); lower min_gap or raise num_samples / temperature"
        )

    # 3. the config (it marks the files beside it as Quartet's, so a run killed while renaming them can be run
    #    again), every answer, the summary, then the pairs (they mark the stage done): written as one
    #    (atomic_write_files), so a full disk leaves none of them
    gaps = [r["chosen_score"] - r["rejected_score"] for r in rows]
    result = LabelResult(output, counts, statistics.fmean(all_scores), statistics.fmean(gaps), timer.seconds,
                         summary=_sidecar(output, "summary.md"), judge_stats=_judge_stats(judge))
    summary = loop.format_summary(
        f"label: {cfg.policy} judged by {cfg.judge}",
        {
            "sampling": _sampling(cfg, result) | {"judge score mean": result.score_mean,
                                                  "time": f"{result.seconds:.1f} s"},
            "pairs": {
                "rule": f"{cfg.pairing}, gap > {cfg.min_gap}",
                "kept": counts.pairs,
                "dropped as ties (gap <= min_gap)": counts.ties,
                "empty / duplicate answers left out": f"{counts.empty} / {counts.duplicates}",
                "prompts with < 2 distinct answers": counts.too_few,
                "mean chosen - rejected score": result.gap_mean,
            },
            **_judge_section(cfg, result),
            "output": {"preference pairs": output, "every answer with its score": samples_path(output),
                       "next": f"quartet rm data.path={output}"},
        },
    )
    atomic_write_files({_sidecar(output, "config.yaml"): config_text(cfg), samples_path(output): _jsonl(samples),
                        result.summary: summary, output: _jsonl(rows)})
    _report(cfg, result)
    print(summary)
    return result


def _judge(cfg: LabelConfig) -> Scorer | PairwiseRanker:
    """A reward model (any tokenizer) or reward function scoring each answer; or, for `llm:<model>`, a language
    model ranking each prompt's K answers by their wins over each other (quartet.rollout.judging), its verdicts
    cached beside the pairs. Built before the policy loads: a wrong server URL, key or model stops the stage first."""
    if is_llm_spec(cfg.judge):
        llm = open_llm_judge(cfg.judge, cfg.llm_judge, cfg.prompts.path, verdicts_path(cfg), "label")
        return PairwiseRanker(llm, cfg.num_samples, cfg.llm_judge.orders)
    return Scorer(cfg.judge, timeout=cfg.judge_timeout)


def _judge_stats(judge) -> dict:
    """An `llm:` judge's tally as the trackers log it: the share of judged pairs the order decided (position bias)
    and that neither answer won in both orders (ties), the verdicts paid for and those read back."""
    if not isinstance(judge, PairwiseRanker):
        return {}
    return {"label/judge_pairs": judge.tally.pairs, "label/position_bias": judge.tally.position_bias,
            "label/judge_ties": judge.tally.tie_rate, "label/judge_calls": judge.judge.calls,
            "label/cache_hits": judge.judge.hits}


def _judge_section(cfg: LabelConfig, result: LabelResult) -> dict:
    """The summary's section on an `llm:` judge (none for another judge)."""
    stats = result.judge_stats
    if not stats:
        return {}
    return {"llm judge": {
        "pairs of answers judged, each in both orders": stats["label/judge_pairs"],
        "position bias (share of pairs the order decided)": stats["label/position_bias"],
        "two orders made one verdict by (llm_judge.orders)": cfg.llm_judge.orders,
        "ties (share of pairs neither answer won)": stats["label/judge_ties"],
        "verdicts asked / read from the cache": f"{stats['label/judge_calls']} / {stats['label/cache_hits']}",
        "verdict cache": verdicts_path(cfg) or "none",
    }}


def _write_answers_only(cfg: LabelConfig, output: Path, samples: list[dict], result: LabelResult) -> LabelResult:
    """`judge: none`: the config, every answer (score null) and the summary, written as one; no pairs. A pairs file
    an earlier judged run left at `output` (Quartet's: check_outputs refused any other) is removed once the answers
    are in place: it came from other draws, and it would mark this output as a judged one."""
    answers = samples_path(output)
    result.summary = _sidecar(output, "summary.md")
    summary = loop.format_summary(
        f"label: {cfg.policy}, answers only (judge: none)",
        {
            "sampling": _sampling(cfg, result) | {"time": f"{result.seconds:.1f} s"},
            "output": {"every answer (score null)": answers, "preference pairs": "none: people rank the answers",
                       "next": f"quartet annotate {answers} --out {output.parent / 'annotate'}"},
        },
    )
    atomic_write_files({_sidecar(output, "config.yaml"): config_text(cfg), answers: _jsonl(samples),
                        result.summary: summary})
    output.unlink(missing_ok=True)
    _report(cfg, result)
    print(summary)
    return result


def _sampling(cfg: LabelConfig, result: LabelResult) -> dict:
    """The summary's sampling section, judged or not."""
    gen = cfg.generation
    return {"prompts": result.counts.prompts,
            "answers (K per prompt)": f"{result.counts.samples} ({cfg.num_samples})",
            "temperature / top_p / max_new_tokens": f"{gen.temperature} / {gen.top_p} / {gen.max_new_tokens}"}


def make_pairs(answers: list[str], scores: list[float], pairing: str, min_gap: float, counts: LabelCounts):
    """(chosen, rejected, chosen_score, rejected_score) tuples from one prompt's K scored answers."""
    seen, cands = set(), []
    for answer, score in zip(answers, scores):
        if not answer.strip():
            counts.empty += 1
        elif answer in seen:
            counts.duplicates += 1
        else:
            seen.add(answer)
            cands.append((score, answer))
    if len(cands) < 2:
        counts.too_few += 1
        return []
    cands.sort(key=lambda c: -c[0])  # best first; sort is stable, so equal scores keep sampling order
    if pairing == "best-worst":
        candidates = [(cands[0], cands[-1])]
    else:
        candidates = list(itertools.combinations(cands, 2))
    pairs = []
    for (hi, hi_text), (lo, lo_text) in candidates:
        if hi - lo <= min_gap:
            counts.ties += 1
            continue
        pairs.append((hi_text, lo_text, hi, lo))
    return pairs


def _report(cfg: LabelConfig, result: LabelResult) -> None:
    """Label has no curve to log: its counts go to the trackers of `cfg.tracking` once, as step 0. The pairs
    are written by then, so a tracker that cannot start costs a warning, not the stage."""
    try:
        trackers = open_trackers(cfg.tracking, "label", params=cfg)
    except ConfigError as e:
        log.warning("warning: %s", e)
        return
    c = result.counts
    stats = {"label/prompts": c.prompts, "label/samples": c.samples, "label/pairs": c.pairs,
             "label/ties": c.ties, "label/empty": c.empty, "label/duplicates": c.duplicates,
             "label/score_mean": result.score_mean, "label/gap_mean": result.gap_mean,
             "timing/total": result.seconds, **result.judge_stats}
    trackers.log({k: v for k, v in stats.items() if v is not None}, 0)  # None: not judged (judge: none)
    trackers.finish()


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def _sidecar(output: Path, suffix: str) -> Path:
    """runs/label/preferences.jsonl -> runs/label/preferences.<suffix>"""
    return output.with_name(f"{output.stem}.{suffix}")


def cli(args) -> int:
    label(load_config(LabelConfig, args.config, args.overrides), overwrite=args.overwrite)
    return 0
