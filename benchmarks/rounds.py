"""Do rounds of feedback pay? The round-2 reward model against the round-1 one on answers of the round-2 policy.

    .venv/bin/python benchmarks/rounds.py [--out runs/bench_rounds]        # the demo's recipe, ~15 min on 2 cores
    .venv/bin/python benchmarks/rounds.py --smoke --out /tmp/rounds-smoke  # tiny models on tiny-target, ~1 min

1. `quartet run configs/demo.yaml rounds=2 stages=[sft,label,rm,ppo]` (SmolLM2-135M-Instruct, positive-review, the
   demo's judge, MiniLM reward models; fewer label prompts and the same 13 PPO iterations, to fit the time): round 1
   is the demo's pipeline; round 2 labels answers of round 1's PPO policy, trains a new reward model on both rounds'
   pairs and runs PPO from SFT again with it.
2. Held out: the round-2 policy answers `eval` prompts (films never seen in train), K per prompt, and the label
   judge (the gold the reward models learn) orders every pair of them more than min_gap apart.
3. Each reward model's accuracy on those pairs (a tie counts half), with a 95% bootstrap CI over prompts (a prompt's
   pairs share its answers: prompts are the independent draws), and the paired difference round 2 - round 1 on the
   same resamples. The round-1 model never saw this policy's answers; the round-2 model saw them on other prompts.

Everything is written under --out and reused when run again (the pipeline's own rule; delete --out to redo).
Prints one JSON object, also written to <out>/rounds.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from quartet.config import LabelConfig, from_dict
from quartet.data import render_conversation
from quartet.models import load_reward_model
from quartet.monitor.metrics import read_metrics
from quartet.pipeline import load_pipeline, round_config, run_pipeline
from quartet.trainers.label import label

ROOT = Path(__file__).resolve().parents[1]
TINY = "tiny:llama?hidden=32&layers=1&heads=4&vocab=300"


def smoke_config(out: Path) -> Path:
    """A pipeline of tiny random models on tiny-target: the code path of the real run, in about a minute."""
    (out / "sft.jsonl").write_text('{"prompt": "ab", "completion": "aa"}\n{"prompt": "cd", "completion": "a1"}\n')
    path = out / "smoke.yaml"
    path.write_text(json.dumps({
        "task": "tiny-target", "tracking": {"report_to": "none"},
        "sft": {"model": TINY, "data": {"path": str(out / "sft.jsonl"), "chat_template": False}, "max_steps": 1,
                "precision": "fp32"},
        "label": {"num_samples": 4, "min_gap": 0.0, "generation": {"max_new_tokens": 6, "batch_size": 32}},
        "rm": {"model": TINY, "max_steps": 2, "precision": "fp32", "normalize_samples": 4},
        "ppo": {"rollout_batch_size": 4, "minibatch_size": 4, "micro_batch_size": 4,
                "generation": {"max_new_tokens": 6, "batch_size": 4}, "precision": "fp32"},
    }))
    return path


def accuracy_ci(correct: list[list[float]], other: list[list[float]] | None = None, n_boot: int = 2000,
                alpha: float = 0.05, seed: int = 0) -> tuple[float, float, float]:
    """Share of pairs ranked right (pooled over prompts; `correct[i]`: prompt i's pairs, 1 right, 0.5 tied, 0 wrong)
    and its percentile-bootstrap CI, resampling prompts with their pairs. With `other` (the same pairs judged by
    another model), the same for the paired difference correct - other, on the same resamples."""
    hits = np.array([sum(c) for c in correct], dtype=float)
    if other is not None:
        hits -= np.array([sum(c) for c in other], dtype=float)
    counts = np.array([len(c) for c in correct], dtype=float)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(correct), size=(n_boot, len(correct)))
    boots = hits[draws].sum(1) / counts[draws].sum(1)
    lo, hi = np.quantile(boots, [alpha / 2, 1 - alpha / 2])
    return float(hits.sum() / counts.sum()), float(lo), float(hi)


def ranked_right(rm, rows: list[dict], max_length: int, chat_template: bool) -> list[list[float]]:
    """Per prompt (file order), 1 / 0.5 / 0 for each of its pairs: the reward model scores chosen above / equal to /
    below rejected."""
    texts = [render_conversation(rm.tokenizer, r["prompt"], r[side], chat_template)
             for r in rows for side in ("chosen", "rejected")]
    scores = rm.score_texts(texts, batch_size=16, max_length=max_length)
    by_prompt: dict[str, list[float]] = {}
    for i, r in enumerate(rows):
        chosen, rejected = scores[2 * i], scores[2 * i + 1]
        by_prompt.setdefault(json.dumps(r["prompt"]), []).append(
            1.0 if chosen > rejected else 0.5 if chosen == rejected else 0.0)
    return list(by_prompt.values())


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench_rounds")
    ap.add_argument("--label-prompts", type=int, help="train prompts each round labels (default 96; the demo: 128)")
    ap.add_argument("--ppo-iterations", type=int, help="PPO iterations per round (default the demo's 13)")
    ap.add_argument("--heldout-prompts", type=int, help="eval prompts the round-2 policy answers (default 64)")
    ap.add_argument("--seed", type=int, default=1234, help="the held-out answers' sampling seed")
    ap.add_argument("--smoke", action="store_true", help="tiny random models on tiny-target: proves the code path")
    args = ap.parse_args()
    for name, real, smoke in (("label_prompts", 96, 16), ("ppo_iterations", 13, 2), ("heldout_prompts", 64, 8)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else real)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = smoke_config(out) if args.smoke else ROOT / "configs" / "demo.yaml"
    overrides = [f"output_dir={out / 'pipeline'}", "rounds=2", "stages=[sft,label,rm,ppo]",
                 f"label.prompts.limit={args.label_prompts}", f"ppo.iterations={args.ppo_iterations}"]
    cfg = load_pipeline(str(config), overrides)
    t = time.perf_counter()
    stage_s = run_pipeline(cfg)
    pipeline_s = time.perf_counter() - t

    # 2. held-out pairs of the round-2 policy's answers, ordered by the label judge
    second = round_config(cfg, 2)
    t = time.perf_counter()
    heldout = label(from_dict(LabelConfig, {
        "policy": str(Path(second.ppo.output_dir) / "model"), "judge": cfg.label.judge,
        "prompts": {"path": f"task:{cfg.task}/eval", "limit": args.heldout_prompts},
        "num_samples": cfg.label.num_samples, "generation": dataclasses.asdict(cfg.label.generation),
        "pairing": "all-pairs", "min_gap": cfg.label.min_gap, "seed": args.seed,
        "output": str(out / "heldout" / "preferences.jsonl"), "tracking": {"report_to": "none"},
    }))
    rows = [json.loads(line) for line in heldout.output.read_text().splitlines()]
    heldout_s = time.perf_counter() - t

    # 3. each round's reward model on them
    t = time.perf_counter()
    right, models = {}, {}
    for k in (1, 2):
        rm_dir = Path(round_config(cfg, k).rm.output_dir)
        rm = load_reward_model(str(rm_dir / "model"), trained=True)
        right[k] = ranked_right(rm, rows, cfg.rm.max_seq_len, cfg.rm.data.chat_template)
        own = [m["rm/eval_accuracy"] for m in read_metrics(rm_dir, warn=False) if "rm/eval_accuracy" in m]
        models[k] = {"trained_on_pairs": sum(1 for _ in open(round_config(cfg, k).rm.data.path, encoding="utf-8")),
                     "own_heldout_accuracy": round(own[-1], 3) if own else None}
        del rm
    score_s = time.perf_counter() - t

    def ci(values):
        return {"mean": round(values[0], 3), "lo": round(values[1], 3), "hi": round(values[2], 3)}

    result = {
        "question": "accuracy against the label judge on held-out pairs of the round-2 policy's answers",
        "heldout": {"prompts": heldout.counts.prompts, "answers": heldout.counts.samples, "pairs": len(rows),
                    "ties_dropped": heldout.counts.ties, "judge": cfg.label.judge},
        "rm_round_1": {**models[1], "accuracy": ci(accuracy_ci(right[1]))},
        "rm_round_2": {**models[2], "accuracy": ci(accuracy_ci(right[2]))},
        "round_2_minus_round_1": ci(accuracy_ci(right[2], right[1])),
        "settings": {"config": str(config), "overrides": overrides, "heldout_seed": args.seed},
        "timings_s": {**{k: round(v, 1) for k, v in stage_s.items()}, "pipeline": round(pipeline_s, 1),
                      "heldout_label": round(heldout_s, 1), "scoring": round(score_s, 1)},
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    text = json.dumps(result, indent=2)
    (out / "rounds.json").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
