"""Does the recipe gain on every seed? N whole-pipeline seeds of one config, and the table a user would want.

    .venv/bin/python benchmarks/seeds.py                                   # configs/demo.yaml, seeds 0-4, 2 at a time
    .venv/bin/python benchmarks/seeds.py --config configs/arithmetic.yaml --seeds 0 1 2 --out runs/bench_seeds_arith
    .venv/bin/python benchmarks/seeds.py --smoke --out /tmp/seeds-smoke    # tiny models on tiny-target, ~1 min
    .venv/bin/python benchmarks/seeds.py ... -- ppo.iterations=16 label.num_samples=6   # a lever, on every seed

Seed N sets `<stage>.seed=N` for every training stage the config runs (sft, label, rm, dpo, ppo; the README's
"whole-pipeline seed"); the eval keeps its own seed, so every run is scored on the same held-out prompts and the
baseline's answers are the same draw. Each seed is one `quartet run` process, `--parallel` of them at a time with
`--threads` torch threads each (the default, 2 x 1, fits 24 GiB and two cores; the seconds are then those of a
shared machine: run `--parallel 1 --threads 2` alone for speed numbers).

Per seed, read back from what the run wrote (nothing is recomputed):
- gain: the policy's gold minus the baseline's, paired over prompts, with its 95% bootstrap CI (eval.json);
- findings: the doctor's findings during PPO (ppo/findings.jsonl), and the rules the PPO run was too short to judge;
- RM: the reward model's held-out accuracy (split by prompt) and its calibration, bin by bin: a bin follows
  Bradley-Terry when the model's predicted accuracy lies in the bin's 95% interval: the rm stage's, with prompts as
  the draws, where calibration.json has one (a prompt's pairs share answers: quartet.eval.calibration), else Wilson's
  over its pairs; beside it, the count with a family-wise interval (each of the k bins at 1 - 0.05/k, over its
  effective pairs: a calibrated model passes every bin with probability >= 0.95, where k bins at 95% each pass
  together with ~0.95^k) and the count by Wilson's interval over the pairs;
  raw margins, then margins over the rm stage's temperature ("/T": each half of the held-out prompts over the T
  fitted on the other half, so no pair is judged by a T fitted on it);
- relevance (where the task has an on-task signal): the policy's mean against the baseline's CI: a fall below its lower
  bound is a fall beyond the CI;
- RM against gold: on the baseline's eval answers (eval/samples.jsonl), the share of same-prompt pairs with a gold
  gap over 0.1 that the reward model orders as gold does, among on-topic pairs (both relevance >= 0.2), and the
  RM-gold correlation: what the held-out accuracy, which is mostly the relevance gate on the demo, does not show;
- KL to the baseline, length, and seconds per stage (summary.md).
A seed already run under --out is read again, not rerun (delete its folder to redo). Prints the table (markdown) and
writes it with every number to <out>/seeds.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import NormalDist

import yaml

from quartet.algo.stats import wilson_interval
from quartet.monitor.doctor import unjudged_run

ROOT = Path(__file__).resolve().parents[1]
TRAINING_STAGES = ("sft", "label", "rm", "dpo", "ppo")
TINY = "tiny:llama?hidden=32&layers=1&heads=4&vocab=300"


def smoke_config(out: Path) -> Path:
    """A pipeline of tiny random models on tiny-target: the code path of the real run, in about a minute."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "sft.jsonl").write_text('{"prompt": "ab", "completion": "aa"}\n{"prompt": "cd", "completion": "a1"}\n')
    path = out / "smoke.yaml"
    path.write_text(json.dumps({
        "task": "tiny-target", "tracking": {"report_to": "none"},
        "sft": {"model": TINY, "data": {"path": str(out / "sft.jsonl"), "chat_template": False}, "max_steps": 1,
                "precision": "fp32"},
        "label": {"num_samples": 4, "min_gap": 0.0, "generation": {"max_new_tokens": 6, "batch_size": 32}},
        "rm": {"model": TINY, "max_steps": 2, "precision": "fp32", "normalize_samples": 4},
        "ppo": {"rollout_batch_size": 4, "minibatch_size": 4, "micro_batch_size": 4, "iterations": 2,
                "generation": {"max_new_tokens": 6, "batch_size": 4}, "precision": "fp32"},
        "eval": {"num_prompts": 8, "max_new_tokens": 6},
    }))
    return path


def stages_of(config: Path) -> list[str]:
    """The stages the config runs (the pipeline's default when it names none)."""
    raw = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
    return list(raw.get("stages") or ["sft", "label", "rm", "ppo", "eval"])


def run_seed(config: Path, seed: int, out: Path, stages: list[str], overrides: list[str], threads: int) -> float:
    """`quartet run` for one seed into `out` (its log beside it); the wall seconds, 0 when it was already done."""
    if (out / "summary.md").is_file() and (out / "eval" / "eval.json").is_file():
        return 0.0
    seeds = [f"{stage}.seed={seed}" for stage in stages if stage in TRAINING_STAGES]
    cmd = [sys.executable, "-m", "quartet.cli", "run", str(config), f"output_dir={out}", *seeds, *overrides]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TQDM_DISABLE="1")
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(out.parent / f"{out.name}.log", "w", encoding="utf-8") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    if rc != 0:
        raise SystemExit(f"error: seed {seed} failed (exit {rc}); its log: {out.parent / f'{out.name}.log'}")
    return time.perf_counter() - start


def stage_seconds(out: Path) -> dict[str, float]:
    """Seconds per stage from the run's summary.md ('- ppo: 166 s')."""
    text = (out / "summary.md").read_text(encoding="utf-8")
    part = text.split("## Time per stage", 1)[-1]
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^- (\w+): ([\d.]+) s$", part, re.M)}


def bins_against_bt(table: list[dict]) -> tuple[list[dict], int, int, int, int | None]:
    """(bins with their 95% interval, bins whose Bradley-Terry prediction lies inside it, bins with pairs, bins
    whose prediction lies inside Wilson's interval over the pairs, bins whose prediction lies inside the
    family-wise interval). The interval is the file's (`lo`, `hi`: the rm stage's, with prompts as the draws) where
    it has one, else Wilson's over the bin's pairs.

    Family-wise: each of the k bins with pairs at 1 - 0.05 / k (Bonferroni), Wilson's over the file's
    `effective_pairs` (prompts as the draws), so that a calibrated reward model has every bin inside with
    probability >= 0.95; k bins at 95% each all hold with probability ~0.95^k (0.77 for 5). None where the file
    has no effective pair counts. Printed beside the 95% count, not in its place: which one the issue's bar means
    is its owner's call."""
    used_bins = sum(1 for b in table if int(b["count"]))
    z_family = NormalDist().inv_cdf(1 - 0.05 / (2 * max(used_bins, 1)))
    bins = []
    for b in table:
        n = int(b["count"])
        if not n:  # an empty bin: no accuracy, nothing to compare
            bins.append({**b, "lo": None, "hi": None, "follows_bt": False, "follows_bt_wilson": False,
                         "follows_bt_familywise": False})
            continue
        w_lo, w_hi = wilson_interval(round(b["accuracy"] * n), n)
        lo, hi = (b["lo"], b["hi"]) if b.get("lo") is not None else (w_lo, w_hi)
        row = {**b, "lo": lo, "hi": hi, "wilson": [w_lo, w_hi], "follows_bt": lo <= b["predicted"] <= hi,
               "follows_bt_wilson": w_lo <= b["predicted"] <= w_hi}
        if b.get("effective_pairs"):
            f_lo, f_hi = wilson_interval(b["accuracy"] * b["effective_pairs"], b["effective_pairs"], z_family)
            row |= {"familywise": [f_lo, f_hi], "follows_bt_familywise": f_lo <= b["predicted"] <= f_hi}
        bins.append(row)
    used = [b for b in bins if b["count"]]
    family = (sum(b["follows_bt_familywise"] for b in used) if all("familywise" in b for b in used) and used
              else None)
    return bins, sum(b["follows_bt"] for b in used), len(used), sum(b["follows_bt_wilson"] for b in used), family


def calibration(out: Path) -> dict | None:
    """The reward model's held-out accuracy and its bins against Bradley-Terry, from rm/calibration.json: the raw
    margins', and (runs that fitted one) the margins over the temperature, each half of the held-out prompts over
    the T fitted on the other half."""
    path = out / "rm" / "calibration.json"
    if not path.is_file():
        return None
    held = json.loads(path.read_text(encoding="utf-8"))["eval"]
    bins, follow, used, wilson, family = bins_against_bt(held.get("calibration", []))
    result = {"accuracy": held["accuracy"], "bins": bins, "bins_following_bt": follow, "bins_with_pairs": used,
              "bins_following_bt_wilson": wilson, "bins_following_bt_familywise": family,
              "temperature": held.get("temperature")}
    if held.get("calibration_scaled"):
        bins, follow, used, wilson, family = bins_against_bt(held["calibration_scaled"])
        result["scaled"] = {"bins": bins, "bins_following_bt": follow, "bins_with_pairs": used,
                            "bins_following_bt_wilson": wilson, "bins_following_bt_familywise": family,
                            "fold_temperatures": held.get("fold_temperatures")}
    return result


ON_TOPIC = 0.2
"""relevance both answers of a pair need to count as on-topic in `rm_against_gold` (the demo judge's gate pays
full sentiment from 0.2 up)"""


def rm_against_gold(out: Path, baseline: str, on_topic: float = ON_TOPIC) -> dict | None:
    """How the reward model orders the baseline's eval answers against the gold judge, from eval/samples.jsonl:
    pairs of answers to one prompt whose gold scores differ by more than 0.1, the share the reward model orders
    the same way, over all such pairs and over the on-topic ones (both answers' relevance >= `on_topic`, where the
    task has a relevance signal); and the Pearson correlation of RM and gold over the answers. The held-out
    accuracy is measured against the label judge on the label stage's answers; this is against the gold judge on
    unseen prompts, the answers PPO starts from (issue 40: it found what the held-out number hid)."""
    path = out / "eval" / "samples.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    rows = [r for r in rows if r.get("checkpoint") == baseline and r.get("rm") is not None
            and r.get("gold") is not None]
    if len(rows) < 3:
        return None
    by_prompt: dict = {}
    for r in rows:
        by_prompt.setdefault(r["prompt_index"], []).append(r)
    agree = {"all": [], "on_topic": []}
    for group in by_prompt.values():
        for i, a in enumerate(group):
            for b in group[i + 1 :]:
                if abs(a["gold"] - b["gold"]) <= 0.1:
                    continue
                same = (a["rm"] - b["rm"]) * (a["gold"] - b["gold"]) > 0
                agree["all"].append(same)
                rel = (a.get("relevance"), b.get("relevance"))
                if None not in rel and min(rel) >= on_topic:
                    agree["on_topic"].append(same)
    rm, gold = [r["rm"] for r in rows], [r["gold"] for r in rows]
    return {"pairs": len(agree["all"]), "agree": _share(agree["all"]),
            "on_topic_pairs": len(agree["on_topic"]), "on_topic_agree": _share(agree["on_topic"]),
            "corr": _pearson(rm, gold), "answers": len(rows)}


def _share(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def _pearson(x: list[float], y: list[float]) -> float | None:
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else None


def read_seed(seed: int, out: Path, wall: float) -> dict:
    """One row of the table, from the files the run wrote."""
    ev = json.loads((out / "eval" / "eval.json").read_text(encoding="utf-8"))
    base = ev["baseline"]
    policy = [name for name in ev["checkpoints"] if name != base][-1]
    b, p = ev["checkpoints"][base], ev["checkpoints"][policy]
    findings_path = out / "ppo" / "findings.jsonl"
    findings = []
    if findings_path.is_file():
        findings = [json.loads(line).get("rule", "?") for line in findings_path.read_text().splitlines() if line]
    relevance = None
    if p.get("relevance") and b.get("relevance"):  # null where the eval had no on-task judge
        relevance = {"baseline": b["relevance"], "policy": p["relevance"],
                     "falls_beyond_ci": p["relevance"]["mean"] < b["relevance"]["lo"]}
    diff = p["score_diff"]
    return {
        "seed": seed, "policy": policy,
        "gold_baseline": b["gold"], "gold_policy": p["gold"], "gain": diff,
        "gain_ci_excludes_0": diff["lo"] > 0, "win_rate": p["win_rate"],
        "findings": findings, "too_short": unjudged_run(out / "ppo") if (out / "ppo" / "metrics.jsonl").is_file() else [],
        "rm": calibration(out), "rm_vs_gold": rm_against_gold(out, base), "relevance": relevance,
        "kl": p["kl"]["mean"], "length": p["length"]["mean"], "length_baseline": b["length"]["mean"],
        "stage_seconds": stage_seconds(out), "wall_seconds": wall,
    }


def ci(d: dict) -> str:
    return f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"


def table(rows: list[dict]) -> str:
    """The markdown table, one row per seed, then the counts the recipe is judged by."""
    lines = ["| seed | baseline gold | policy gold | gain [95% CI] | win | findings | RM acc | RM bins ~ BT | "
             "RM orders gold (on-topic pairs), corr | relevance (base -> policy) | KL | length | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rm = r["rm"]
        rm_acc = f"{rm['accuracy']:.3f}" if rm else "-"
        rm_bt = "-"
        if rm:
            rm_bt = f"{rm['bins_following_bt']}/{rm['bins_with_pairs']}"
            if rm.get("scaled"):
                sc = rm["scaled"]
                rm_bt += f", /T {sc['bins_following_bt']}/{sc['bins_with_pairs']} (T {rm['temperature']:.2f})"
        vs = r.get("rm_vs_gold")
        rm_gold = "-"
        if vs:
            on = f"{vs['on_topic_agree']:.2f} ({vs['on_topic_pairs']})" if vs["on_topic_agree"] is not None else "-"
            rm_gold = f"{on}, {vs['corr']:.2f}" if vs["corr"] is not None else on
        rel = "-"
        if r["relevance"]:
            rel = (f"{r['relevance']['baseline']['mean']:.3f} -> {r['relevance']['policy']['mean']:.3f}"
                   + (" (below CI)" if r["relevance"]["falls_beyond_ci"] else ""))
        secs = r["stage_seconds"]
        lines.append(
            f"| {r['seed']} | {r['gold_baseline']['mean']:.3f} | {r['gold_policy']['mean']:.3f} | {ci(r['gain'])} "
            f"| {r['win_rate']:.2f} | {', '.join(r['findings']) or 'none'} | {rm_acc} | {rm_bt} | {rm_gold} | {rel} "
            f"| {r['kl']:.2f} | {r['length_baseline']:.1f} -> {r['length']:.1f} "
            f"| {secs.get('total', sum(secs.values())):.0f} |")
    n = len(rows)
    gains = sum(r["gain_ci_excludes_0"] for r in rows)
    clean = sum(not r["findings"] for r in rows)
    lines += ["", f"- gain's CI excludes 0: {gains}/{n}; no findings: {clean}/{n}"]
    short = sorted({line for r in rows for line in r.get("too_short", [])})
    if short:
        lines.append("- too short for the doctor to judge: " + "; ".join(short))
    rms = [r["rm"] for r in rows if r["rm"]]
    if rms:
        good = sum(rm["accuracy"] >= 0.75 for rm in rms)
        bt = sum(rm["bins_following_bt"] == rm["bins_with_pairs"] for rm in rms)
        line = (f"- RM held-out accuracy >= 0.75: {good}/{len(rms)}; every bin follows Bradley-Terry: "
                f"{bt}/{len(rms)} raw")
        scaled = [rm["scaled"] for rm in rms if rm.get("scaled")]
        if scaled:
            line += (f", {sum(sc['bins_following_bt'] == sc['bins_with_pairs'] for sc in scaled)}/{len(scaled)} "
                     f"over the temperature (each half of the held-out prompts over the other half's T)")
        if all(rm["bins_following_bt_familywise"] is not None for rm in rms):
            fam = sum(rm["bins_following_bt_familywise"] == rm["bins_with_pairs"] for rm in rms)
            line += f"; family-wise (each of k bins at 1 - 0.05/k, prompts as the draws): {fam}/{len(rms)} raw"
            if scaled and all(sc["bins_following_bt_familywise"] is not None for sc in scaled):
                line += (f", {sum(sc['bins_following_bt_familywise'] == sc['bins_with_pairs'] for sc in scaled)}/"
                         f"{len(scaled)} over T")
        if any(b.get("wilson") and b["wilson"] != [b["lo"], b["hi"]] for rm in rms for b in rm["bins"]):
            wilson = sum(rm["bins_following_bt_wilson"] == rm["bins_with_pairs"] for rm in rms)
            line += f"; by Wilson's interval, which counts the pairs as independent: {wilson}/{len(rms)} raw"
            if scaled:
                line += (f", {sum(sc['bins_following_bt_wilson'] == sc['bins_with_pairs'] for sc in scaled)}/"
                         f"{len(scaled)} over T")
        lines.append(line)
    vs = [r["rm_vs_gold"] for r in rows if r.get("rm_vs_gold") and r["rm_vs_gold"]["on_topic_agree"] is not None]
    if vs:
        lines.append(f"- RM orders the baseline's on-topic answers as gold does: mean "
                     f"{sum(v['on_topic_agree'] for v in vs) / len(vs):.3f} over {len(vs)} seed(s)")
    rel = [r for r in rows if r["relevance"]]
    if rel:
        lines.append(f"- relevance not below the baseline's CI: {sum(not r['relevance']['falls_beyond_ci'] for r in rel)}"
                     f"/{len(rel)}")
    mean_gain = sum(r["gain"]["mean"] for r in rows) / max(n, 1)
    lines.append(f"- mean gain {mean_gain:+.3f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_seeds")
    parser.add_argument("--parallel", type=int, default=2, help="seeds run at a time (each a process)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--smoke", action="store_true", help="tiny models on tiny-target: the code path only")
    parser.add_argument("overrides", nargs="*", help="config overrides for every seed (after --), e.g. ppo.iterations=16")
    args = parser.parse_args()
    config = smoke_config(args.out) if args.smoke else args.config.resolve()
    stages = stages_of(config)
    start = time.perf_counter()

    def one(seed: int) -> tuple[int, float]:
        return seed, run_seed(config, seed, args.out / f"seed{seed}", stages, args.overrides, args.threads)

    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        walls = dict(pool.map(one, args.seeds))
    rows = [read_seed(seed, args.out / f"seed{seed}", walls[seed]) for seed in args.seeds]
    text = table(rows)
    machine = "AVX-512 BF16" if "avx512_bf16" in Path("/proc/cpuinfo").read_text() else "AVX2-only or other"
    header = (f"{config.name}, seeds {args.seeds}, overrides {args.overrides or 'none'}; {os.cpu_count()} cores "
              f"({platform.processor() or platform.machine()}, {machine}), {args.parallel} at a time x {args.threads} "
              f"thread(s); wall {time.perf_counter() - start:.0f} s")
    print(header + "\n\n" + text)
    (args.out / "seeds.json").write_text(json.dumps(
        {"config": str(config), "seeds": args.seeds, "overrides": args.overrides, "machine": machine,
         "parallel": args.parallel, "threads": args.threads, "rows": rows, "table": text}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
