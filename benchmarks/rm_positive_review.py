"""Does a MiniLM reward model learn the positive-review gold judge from AI-feedback pairs?

    .venv/bin/python benchmarks/rm_positive_review.py [--train-prompts 48] [--out runs/bench_rm]

1. `quartet label`: SmolLM2-135M-Instruct samples K answers per `train` prompt (and, for a held-out
   set, per `eval` prompt: films never seen in train); VADER (the gold judge) scores them; all pairs
   more than `min_gap` apart are kept, ties are dropped and counted.
2. `quartet rm`: MiniLM (BERT encoder + fresh head) trained with Bradley-Terry on the train pairs;
   accuracy on the held-out eval pairs.
3. Fresh answers to other `eval` prompts (new seed): Spearman correlation of RM score vs gold.

Prints one JSON object with the numbers and timings. No scipy: ranks are computed with numpy.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from quartet.config import DataConfig, GenerationConfig, LabelConfig, RewardConfig, from_dict
from quartet.data import encode_prompts, left_pad, load_prompts, render_conversation
from quartet.models import load_causal_lm, load_reward_model
from quartet.rollout.engine import HFEngine
from quartet.rollout.rewards import load_reward_fn
from quartet.trainers.label import label
from quartet.trainers.reward import train_reward

POLICY = "smollm2-135m-instruct"


def rankdata(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties get their average rank (as scipy.stats.rankdata's default)."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x))
    sorted_x = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and sorted_x[j + 1] == sorted_x[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a, b) -> float:
    ra, rb = rankdata(np.asarray(a, float)), rankdata(np.asarray(b, float))
    return float(np.corrcoef(ra, rb)[0, 1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train-prompts", type=int, default=48)
    ap.add_argument("--eval-prompts", type=int, default=16, help="eval prompts labelled for held-out pairs")
    ap.add_argument("--fresh", type=int, default=32, help="other eval prompts answered (twice) fresh for Spearman")
    ap.add_argument("--num-samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--min-gap", type=float, default=0.1)
    ap.add_argument("--epochs", type=float, default=4.0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared CPU)")
    ap.add_argument("--out", default="runs/bench_rm")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    gen = {"max_new_tokens": args.max_new_tokens, "temperature": 1.0, "batch_size": 64}
    timings = {}

    t = time.perf_counter()
    labelled = {}
    for split, n, seed in (("train", args.train_prompts, 0), ("eval", args.eval_prompts, 1)):
        cfg = from_dict(LabelConfig, {
            "policy": POLICY, "judge": "task:positive-review", "num_samples": args.num_samples,
            "prompts": {"path": f"task:positive-review/{split}", "limit": n},
            "generation": gen, "pairing": "all-pairs", "min_gap": args.min_gap,
            "output": str(out / f"{split}_prefs.jsonl"), "seed": seed,
        })
        labelled[split] = label(cfg)
        rows = [json.loads(line) for line in labelled[split].output.read_text().splitlines()]
        assert all(r["chosen_score"] > r["rejected_score"] for r in rows), "a kept pair is not ordered"
    timings["label_s"] = time.perf_counter() - t

    t = time.perf_counter()
    rm_cfg = from_dict(RewardConfig, {
        "model": "minilm",
        "data": {"path": str(labelled["train"].output)},
        "eval_data": {"path": str(labelled["eval"].output)},
        "output_dir": str(out / "rm"),
        "epochs": args.epochs,
        "batch_size": 16,
        "max_seq_len": 256,
        "optim": {"lr": args.lr, "warmup_steps": 5},
        "eval_every": 1000,
    })
    rm_result = train_reward(rm_cfg)
    timings["rm_train_s"] = time.perf_counter() - t

    # fresh answers to eval prompts the RM never saw as pairs
    t = time.perf_counter()
    prompts_cfg = DataConfig(path="task:positive-review/eval")
    prompts = [ex.prompt for ex in load_prompts(prompts_cfg)][args.eval_prompts : args.eval_prompts + args.fresh]
    policy, tok = load_causal_lm(POLICY)
    enc = encode_prompts(tok, prompts, prompts_cfg.max_prompt_tokens)
    engine = HFEngine(policy, tok, GenerationConfig(**gen), dtype=torch.bfloat16)
    ids, mask = left_pad(enc.input_ids * 2, tok.pad_token_id)  # two answers per prompt
    responses = engine.generate(ids, mask, seed=123).responses
    prompts = [prompts[i] for i in enc.kept] * 2
    gold = load_reward_fn("task:positive-review")(prompts, responses)
    rm = load_reward_model(str(rm_result.model_dir))
    rm_scores = rm.score_texts([render_conversation(rm.tokenizer, p, r) for p, r in zip(prompts, responses)])
    timings["fresh_s"] = time.perf_counter() - t

    ev = rm_result.eval
    print(json.dumps({
        "label": {split: {"prompts": r.counts.prompts, "pairs": r.counts.pairs, "ties_dropped": r.counts.ties,
                          "gold_mean": round(r.score_mean, 3), "gap_mean": round(r.gap_mean, 3)}
                  for split, r in labelled.items()},
        "rm": {"train_pairs": labelled["train"].counts.pairs, "steps": rm_result.steps,
               "heldout_accuracy": round(ev.accuracy, 3), "heldout_accuracy_start": round(rm_result.first_eval.accuracy, 3),
               "heldout_margin": round(ev.margin, 3),
               "calibration": [{k: b[k] for k in ("margin", "count", "accuracy")} for b in ev.calibration]},
        "fresh": {"answers": len(responses), "spearman_rm_vs_gold": round(spearman(rm_scores, gold), 3),
                  "rm_mean": round(float(np.mean(rm_scores)), 3), "rm_std": round(float(np.std(rm_scores)), 3)},
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "torch_threads": torch.get_num_threads(),
    }, indent=2))


if __name__ == "__main__":
    main()
