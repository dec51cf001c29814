"""Reward over-optimisation made visible: PPO against a proxy reward with a small beta, long enough to pass the
gold judge's peak; gold and proxy against sqrt(KL to the reference), the shape of Gao et al. (2022): the proxy
keeps rising with distance from the reference, the gold score rises, peaks and falls.

    # full size: the demo's SFT model against its reward model (the proxy); gold is the task's on-task judge
    # (VADER gated by relevance, what the reward model's labels paid for), VADER and relevance logged beside it
    .venv/bin/python benchmarks/overoptimization.py --out runs/overopt --policy runs/demo/sft/model \\
        --proxy runs/demo/rm/model --gold task:positive-review/on-task --prompts task:positive-review/train \\
        --kl-coef 0.002 --iterations 80 --set lora.enabled=true --set lora.r=16 --set lora.alpha=32 \\
        --set optim.lr=3e-4 --set critic=shared --set rollout_batch_size=16 --set minibatch_size=8 \\
        --set micro_batch_size=8 --set generation.max_new_tokens=48 \\
        --set 'monitor_judges={relevance: task:positive-review/relevance, vader: task:positive-review}'
    # tiny (seconds): a random byte model on tiny-target, whose proxy also pays for capital letters A-D
    .venv/bin/python benchmarks/overoptimization.py --out /tmp/overopt --tiny

Writes OUT/ppo (a PPO run whose metrics.jsonl logs objective/gold and objective/kl every iteration) and its
report (OUT/ppo/report.html, whose curves include the gold-and-proxy-vs-sqrt(KL) plot), copies that plot to
OUT/overoptimization.png and prints a JSON summary: gold and proxy at the start, at the gold peak (with its
sqrt(KL)) and at the end, and whether the run went past the peak.

Measured, full size (2-core AMD EPYC with AVX-512 BF16, bf16 autocast, 2 threads, nothing else running,
2026-11-24; `make demo`'s SFT model and reward model): 80 iterations in 45 min (~34 s each). The proxy rose
from -0.09 to 2.25 all the way; on-task gold rose from -0.40 to a peak of 0.44 (mean of 8 iterations) at
sqrt(KL) 5.1 (iterations 13-20, KL ~26 nats) and fell to 0.12 at sqrt(KL) 7.7 (`past_peak: true`), while VADER
alone kept rising to 0.95-0.97 and relevance, 0.36 on average over the first 20 iterations, averaged 0.26 over
the last 40: the answers converge on one positive template about a romantic comedy, whatever film the prompt
opens ("This romantic comedy is perfect for bedtime stories and romantic evenings perfect for evenings,
perfect for evenings!" for a fantasy film). The doctor saw it in order: `kl_blowup` (iteration 11),
`overoptimization` (27: gold 0.56 below its peak while the score rose), `reward_hacking_repetition` (36),
`off_task_drift` (49: relevance 0.35 -> 0.26) and `entropy_collapse` (80). The same run with VADER as gold
(the same trajectory: the gold judge is never optimised; stopped at iteration 50) shows no peak: VADER gold
0.23 -> 0.95-0.97 from iteration 22 on, flat, while the template took over: VADER cannot see the drift.
Tiny (OMP_NUM_THREADS=1, same CPU, seed 0): 60 iterations in 6 s; gold 0.058 -> 0.167 at sqrt(KL) 3.5 -> 0.016
at 6.8, while the proxy rose 0.07 -> 0.87 -> 1.92. Any PPOConfig field can be set with
--set key=value (e.g. --set generation.max_new_tokens=32). Run with OMP_NUM_THREADS=1 on a shared CPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPURIOUS = frozenset("ABCD")
"""characters the tiny proxy pays twice as much as the gold judge's own, which it pays nothing for"""


def spurious_proxy(prompts: list[str], responses: list[str]) -> list[float]:
    """The tiny setting's proxy: tiny-target's gold (share of 'a' and digits) plus 2x the share of A-D.

    Like a reward model that learned the gold signal and a feature that merely co-occurred with it: near the
    reference both kinds of character are rare and the proxy tracks gold; pushed hard, the policy moves its
    mass to A-D, where the proxy pays more and gold pays nothing.
    """
    from quartet.tasks.tiny_target import TARGET_CHARS

    out = []
    for r in responses:
        n = max(len(r), 1)
        out.append(sum(c in TARGET_CHARS for c in r) / n + 2.0 * sum(c in SPURIOUS for c in r) / n)
    return out


TINY = {
    "policy": "tiny:llama?hidden=32&layers=1&heads=4&vocab=260&seed=1",
    "reward": "overoptimization:spurious_proxy",
    "gold": "task:tiny-target",
    "prompts": {"path": "task:tiny-target/train", "max_prompt_tokens": 32},
    "iterations": 60,
    "kl_coef": 0.01,
    "rollout_batch_size": 32,
    "minibatch_size": 16,
    "micro_batch_size": 16,
    "ppo_epochs": 2,
    "generation": {"max_new_tokens": 12, "batch_size": 32},
    "optim": {"lr": 3e-3},
    "precision": "fp32",
    "critic": "shared",
}


def summarise(records: list[dict]) -> dict:
    """Gold and proxy at the start, at the gold peak (the middle of the best mean of k = max(1, n/10)
    neighbouring points, with that mean and its mean sqrt(KL), where the report's plot marks the peak) and at
    the end, with sqrt(KL) at each; `past_peak`: the final k-point gold mean is below the peak by more than a
    quarter of the gain up to it."""
    from quartet.monitor.report import overoptimization_points

    points = overoptimization_points(records)
    if points is None:
        raise SystemExit("error: the run logged no objective/gold and objective/kl")
    xs, proxy, gold, proxy_key = points
    n = len(gold)
    k = max(1, n // 10)
    means = [sum(gold[i : i + k]) / k for i in range(n - k + 1)]
    peak = max(range(len(means)), key=means.__getitem__)
    mid = peak + k // 2

    def at(i):
        return {"sqrt_kl": round(xs[i], 4), "gold": round(gold[i], 4), "proxy": round(proxy[i], 4)}

    gain, fall = means[peak] - means[0], means[peak] - means[-1]
    return {
        "proxy_key": proxy_key, "points": n, "smoothing_k": k,
        "start": at(0), "gold_peak": at(mid) | {"gold_mean_k": round(means[peak], 4),
                                              "sqrt_kl_mean_k": round(sum(xs[peak : peak + k]) / k, 4)}, "end": at(n - 1),
        "gold_gain_to_peak": round(gain, 4), "gold_fall_after_peak": round(fall, 4),
        "proxy_rise_after_peak": round(sum(proxy[-k:]) / k - sum(proxy[peak : peak + k]) / k, 4),
        "past_peak": bool(gain > 0 and fall > 0.25 * gain),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory (OUT/ppo is the PPO run)")
    ap.add_argument("--tiny", action="store_true", help="the tiny setting (seconds on a CPU)")
    ap.add_argument("--policy", help="starting policy (e.g. the SFT model)")
    ap.add_argument("--proxy", help="the reward PPO optimises: a reward-model dir or any reward spec")
    ap.add_argument("--gold", help="the judge the proxy stands for, logged as objective/gold (never optimised)")
    ap.add_argument("--prompts", help="prompt set, e.g. task:positive-review/train")
    ap.add_argument("--kl-coef", type=float, help="beta; small, so the policy can travel past the gold peak")
    ap.add_argument("--iterations", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any PPOConfig field")
    args = ap.parse_args(argv)

    from quartet.config import PPOConfig, apply_overrides, from_dict, validate
    from quartet.monitor.metrics import read_metrics
    from quartet.monitor.report import write_report
    from quartet.trainers.ppo import PPOTrainer

    if str(HERE) not in sys.path:  # so the reward spec overoptimization:spurious_proxy imports this file
        sys.path.insert(0, str(HERE))
    base = dict(TINY) if args.tiny else {"iterations": 150, "kl_coef": 0.002}
    given = {"policy": args.policy, "reward": args.proxy, "gold": args.gold, "kl_coef": args.kl_coef,
             "iterations": args.iterations}
    base.update({k: v for k, v in given.items() if v is not None})
    if args.prompts:
        base["prompts"] = {**base.get("prompts", {}), "path": args.prompts}
    missing = [k for k in ("policy", "reward", "gold") if not base.get(k)]
    if missing:
        ap.error(f"give --tiny, or --{' --'.join('proxy' if m == 'reward' else m for m in missing)}")
    out = Path(args.out)
    base |= {"output_dir": str(out / "ppo"), "seed": args.seed}
    cfg = from_dict(PPOConfig, apply_overrides(base, args.set))
    validate(cfg)

    t0 = time.perf_counter()
    result = PPOTrainer(cfg, progress=sys.stderr.isatty()).train()
    seconds = time.perf_counter() - t0
    write_report(result.run_dir)
    plot = result.run_dir / "plots" / "ppo-overoptimization.png"
    shutil.copyfile(plot, out / "overoptimization.png")
    summary = {"seconds": round(seconds, 1), "iterations": result.iterations, "kl_coef": cfg.kl_coef,
               **summarise(read_metrics(result.run_dir)), "plot": str(out / "overoptimization.png"),
               "report": str(result.run_dir / "report.html")}
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
