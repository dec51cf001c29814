"""How good is a small LLM as a pairwise judge? SmolLM2-135M-Instruct judging positive-review answers whose gold
(VADER, the task's judge) is known; a reward model trained on its labels against one trained on the gold's; its
judged win rate of the demo's PPO model beside the gold gain.

    .venv/bin/python benchmarks/llm_judge.py [--train-prompts 48] [--demo runs/demo] [--out runs/bench_llm_judge]

1. `quartet label` with the gold judge (all pairs > min_gap apart) on `train` prompts and, held out, `eval`
   prompts: pairs whose better answer is known.
2. The LLM judges every train gold pair in both orders under each variant (rubric: the task's or the generic
   one; mode: pairwise or pointwise): agreement with gold with the better answer shown first, shown second, and
   both orders together under each rule (`agree`: a winner only when both orders pick it; `average`: the two
   orders' log-odds averaged, RLAIF's rule); the position-bias and tie rates. Wilson 95% intervals.
3. `quartet label` with the LLM judge on the same prompts and seed (the same answers, the verdicts read back from
   step 2's cache) for each label variant, then `quartet rm` (MiniLM) on its pairs and on the gold's: held-out
   accuracy against the gold pairs of step 1 (Wilson 95%).
4. `quartet eval` of a demo run's SFT and PPO models with `--judge llm:...`: the judged win rate beside the gold
   gain (skipped without --demo).

Prints one JSON object (also written to <out>/llm_judge.json) with the numbers, timings, machine and command.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from quartet.algo.stats import wilson_interval
from quartet.config import LabelConfig, LLMJudgeConfig, RewardConfig, from_dict
from quartet.eval.evaluate import evaluate
from quartet.eval.stats import bootstrap_ci
from quartet.judges.llm import DEFAULT_RUBRIC
from quartet.judges.pairwise import judge_both_orders
from quartet.rollout.judging import open_llm_judge
from quartet.trainers.label import label
from quartet.trainers.reward import train_reward

POLICY = "smollm2-135m-instruct"
PROMPTS = "task:positive-review"


def wilson(k: float, n: int) -> dict:
    """Share k/n with its Wilson score interval (quartet.annotate.agreement.wilson_interval)."""
    if n == 0:
        return {"share": None, "lo": None, "hi": None, "n": 0}
    lo, hi = wilson_interval(k, n)
    return {"share": round(k / n, 3), "lo": round(lo, 3), "hi": round(hi, 3), "n": n}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def cpu_kind() -> str:
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return "AVX-512 BF16" if "avx512_bf16" in flags else "AVX2-only" if "avx2" in flags else "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--judge", default=POLICY, help="the judge model (llm:<judge>), local backend")
    ap.add_argument("--train-prompts", type=int, default=48)
    ap.add_argument("--eval-prompts", type=int, default=16, help="eval prompts labelled for held-out gold pairs")
    ap.add_argument("--num-samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--min-gap", type=float, default=0.1)
    ap.add_argument("--rm-epochs", type=float, default=4.0)
    ap.add_argument("--demo", default=None, help="a finished demo run dir (sft/model, ppo/model) for step 4")
    ap.add_argument("--eval-num-prompts", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="runs/bench_llm_judge")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = f"llm:{args.judge}"
    gen = {"max_new_tokens": args.max_new_tokens, "temperature": 1.0, "batch_size": 64}
    timings, report = {}, {}

    # 1. gold pairs
    t = time.perf_counter()
    gold = {}
    for split, n, seed in (("train", args.train_prompts, 0), ("eval", args.eval_prompts, 1)):
        cfg = from_dict(LabelConfig, {
            "policy": POLICY, "judge": PROMPTS, "num_samples": args.num_samples,
            "prompts": {"path": f"{PROMPTS}/{split}", "limit": n}, "generation": gen,
            "pairing": "all-pairs", "min_gap": args.min_gap, "output": str(out / f"gold_{split}.jsonl"), "seed": seed,
        })
        gold[split] = label(cfg, overwrite=True).output
    timings["gold_label_s"] = time.perf_counter() - t
    pairs = read_jsonl(gold["train"])
    report["gold_pairs"] = {"train": len(pairs), "eval": len(read_jsonl(gold["eval"]))}

    # 2. agreement with gold, per variant; verdicts cached in one file (the variants differ in the judge's name or
    #    rubric, so none reads another's)
    cache = out / "verdicts.sqlite"
    prompts = [r["prompt"] for r in pairs]
    chosen, rejected = [r["chosen"] for r in pairs], [r["rejected"] for r in pairs]
    variants = {
        "pairwise, task rubric": {"mode": "pairwise"},
        "pairwise, generic rubric": {"mode": "pairwise", "rubric": DEFAULT_RUBRIC},
        "pointwise, task rubric": {"mode": "pointwise"},
    }
    report["agreement"] = {}
    for name, settings in variants.items():
        t = time.perf_counter()
        judge = open_llm_judge(spec, LLMJudgeConfig(**settings, cache=str(cache)), f"{PROMPTS}/train", cache,
                               "bench")
        v = judge_both_orders(judge, prompts, chosen, rejected)  # a = gold's better answer
        n = len(pairs)
        averaged = [(x - y) / 2 for x, y in zip(v.ab, v.ba)]
        report["agreement"][name] = {
            "better shown first (A)": wilson(sum(x > 0 for x in v.ab), n),
            "better shown second (B)": wilson(sum(y < 0 for y in v.ba), n),
            "both orders, agree rule: right": wilson(sum(w > 0 for w in v.winner), n),
            "both orders, agree rule: wrong": wilson(sum(w < 0 for w in v.winner), n),
            "both orders, average rule": wilson(sum(a > 0 for a in averaged), n),
            "position_bias": round(v.position_bias, 3),
            "ties (agree rule)": round(v.ties, 3),
            "says A (both orders)": round(sum((x > 0) + (y > 0) for x, y in zip(v.ab, v.ba)) / (2 * n), 3),
            "judge calls / cache hits": f"{judge.calls} / {judge.hits}",
            "seconds": round(time.perf_counter() - t, 1),
        }
        judge.cache.close()
        print(name, json.dumps(report["agreement"][name]), file=sys.stderr, flush=True)

    # 3. reward models on the judge's labels and on the gold's
    t = time.perf_counter()
    label_variants = {"gold (VADER)": gold["train"]}
    for name, settings in {"llm pairwise, average rule": {"mode": "pairwise", "orders": "average"},
                           "llm pointwise": {"mode": "pointwise"}}.items():
        cfg = from_dict(LabelConfig, {
            "policy": POLICY, "judge": spec, "num_samples": args.num_samples,
            "prompts": {"path": f"{PROMPTS}/train", "limit": args.train_prompts}, "generation": gen,
            "pairing": "all-pairs", "min_gap": args.min_gap, "seed": 0,
            "output": str(out / f"llm_{settings['mode']}_{settings.get('orders', 'agree')}.jsonl"),
            "llm_judge": {**settings, "cache": str(cache)},
        })
        label_variants[name] = label(cfg, overwrite=True).output
    timings["llm_label_s"] = time.perf_counter() - t
    t = time.perf_counter()
    gold_order = {(r["prompt"], r["chosen"], r["rejected"]) for r in pairs}
    gold_of = gold_order | {(r["prompt"], r["rejected"], r["chosen"]) for r in pairs}
    report["reward_models"] = {}
    for name, path in label_variants.items():
        rows = read_jsonl(path)
        same = sum((r["prompt"], r["chosen"], r["rejected"]) in gold_order for r in rows)
        both = sum((r["prompt"], r["chosen"], r["rejected"]) in gold_of for r in rows)
        result = train_reward(from_dict(RewardConfig, {
            "model": "minilm", "data": {"path": str(path)}, "eval_data": {"path": str(gold["eval"])},
            "output_dir": str(out / f"rm_{path.stem}"), "epochs": args.rm_epochs, "batch_size": 16,
            "max_seq_len": 256, "optim": {"lr": 1e-4, "warmup_steps": 5}, "eval_every": 1000,
        }), overwrite=True)
        n_eval = report["gold_pairs"]["eval"]
        report["reward_models"][name] = {
            "train pairs": len(rows),
            "pairs gold orders the same way (of those gold kept)": f"{same} / {both}",
            "held-out accuracy vs gold": wilson(round(result.eval.accuracy * n_eval), n_eval),
        }
    timings["rm_s"] = time.perf_counter() - t

    # 4. the judged win rate of a demo's PPO model against its SFT model, beside the gold gain
    if args.demo:
        t = time.perf_counter()
        demo = Path(args.demo)
        sft, ppo = str(demo / "sft" / "model"), str(demo / "ppo" / "model")
        result = evaluate([sft, ppo], prompts=f"{PROMPTS}/eval", num_prompts=args.eval_num_prompts,
                          max_new_tokens=48, temperature=0.7, batch_size=64, judge=spec,
                          llm_judge={"mode": "pairwise", "cache": str(cache)})
        m = result.checkpoints[ppo]
        report["eval"] = {"checkpoints": f"{ppo} vs {sft}", "prompts": len(result.samples),
                          "gold gain (paired)": m["score_diff"], "gold win rate vs SFT": m["win_rate"],
                          "pairwise, agree rule": {"judge win rate": m["judge_win_rate"],
                                                   "position bias": m["judge_position_bias"],
                                                   "ties": m["judge_ties"]}}
        # the same samples judged under the other rules (one sample per prompt: rows are prompts)
        rows = [r for r in result.samples if r[ppo] != r[sft]]
        for name, settings in {"pairwise, average rule": {"mode": "pairwise"},
                               "pointwise": {"mode": "pointwise"}}.items():
            judge = open_llm_judge(spec, LLMJudgeConfig(**settings, cache=str(cache)), f"{PROMPTS}/eval", cache,
                                   "bench")
            v = judge_both_orders(judge, [r["prompt"] for r in rows], [r[ppo] for r in rows], [r[sft] for r in rows])
            wins = [1.0 if (x - y) / 2 > 0 else 0.0 if (x - y) / 2 < 0 else 0.5 for x, y in zip(v.ab, v.ba)]
            if name == "pointwise":  # the agree rule, as eval counts it
                wins = [(1 + w) / 2 for w in v.winner]
            wins += [0.5] * (len(result.samples) - len(rows))  # identical responses: ties
            mean, lo, hi = bootstrap_ci(wins, n_boot=2000, alpha=0.05, seed=0)
            report["eval"][name] = {"judge win rate": {"mean": mean, "lo": lo, "hi": hi},
                                    "position bias": round(v.position_bias, 3)}
            judge.cache.close()
        timings["eval_s"] = time.perf_counter() - t

    report["timings_s"] = {k: round(v, 1) for k, v in timings.items()}
    report["machine"] = {"cpu": cpu_kind(), "processor": platform.processor() or platform.machine(),
                         "torch_threads": torch.get_num_threads()}
    report["command"] = " ".join([Path(sys.executable).name, *sys.argv])
    text = json.dumps(report, indent=2, default=str)
    (out / "llm_judge.json").write_text(text + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
