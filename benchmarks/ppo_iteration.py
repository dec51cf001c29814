"""Seconds per PPO iteration, rollout tokens/s and peak RSS for a model shape.

    python benchmarks/ppo_iteration.py                    # both tiny llama shapes below
    python benchmarks/ppo_iteration.py --model smollm2-135m-instruct --lora
    python benchmarks/ppo_iteration.py --model 'tiny:llama?hidden=512&layers=8&heads=8&vocab=32000'

Defaults match the comparison setting: batch 16 prompts, 32 new tokens (EOS never stops a response
early, so every row is 32 tokens), 4 PPO epochs, minibatch 8. Each shape runs in its own process so
peak RSS is per shape. The first iteration is warm-up and not counted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = [
    "tiny:llama?hidden=128&layers=4&heads=4&vocab=32000",
    "tiny:llama?hidden=512&layers=8&heads=8&vocab=32000",
]


def never_stop(prompts, responses):
    """A cheap reward: the share of letters in the response."""
    return [sum(c.isalpha() for c in r) / max(len(r), 1) for r in responses]


def run_one(args) -> dict:
    import torch

    from quartet.config import PPOConfig, from_dict
    from quartet.monitor.metrics import peak_rss_mb
    from quartet.trainers.ppo import PPOTrainer

    torch.set_num_threads(args.threads) if args.threads else None
    out = Path(tempfile.mkdtemp(prefix="quartet-bench-"))
    cfg = from_dict(PPOConfig, {
        "policy": args.model,
        "reward": "ppo_iteration:never_stop",
        "prompts": {"path": args.prompts, "max_prompt_tokens": 64},
        "output_dir": str(out / "ppo"),
        "iterations": args.iterations + 1,
        "rollout_batch_size": args.batch,
        "minibatch_size": args.minibatch,
        "micro_batch_size": args.minibatch,
        "ppo_epochs": args.epochs,
        "generation": {"max_new_tokens": args.new_tokens, "batch_size": args.batch, "temperature": 1.0},
        "critic": args.critic,
        "lora": {"enabled": args.lora},
        "precision": args.precision,
    })
    trainer = PPOTrainer(cfg, progress=False)
    if not args.stop_at_eos:  # fixed-length rollouts: the comparison counts exactly batch x new_tokens tokens
        trainer.experience.engine.generation_config.eos_token_id = None
    times, gen_times, tokens = [], [], []
    for it in range(1, cfg.iterations + 1):
        t = time.perf_counter()
        m = trainer.step(it).metrics
        if it > 1:
            times.append(time.perf_counter() - t)
            gen_times.append(m["timing/generate"])
            tokens.append(m["rollout/length_mean"] * args.batch)
    n = len(times)
    return {
        "model": args.model,
        "lora": args.lora,
        "precision": trainer.accelerator.mixed_precision,
        "sec_per_iteration": sum(times) / n,
        "rollout_tokens_per_sec": sum(tokens) / sum(gen_times),
        "generate_sec": sum(gen_times) / n,
        "peak_rss_mb": peak_rss_mb(),
        "params_m": sum(p.numel() for p in trainer.roles.actor.parameters()) / 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model name (default: both tiny shapes, each in its own process)")
    p.add_argument("--prompts", default="task:positive-review/train")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--minibatch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--iterations", type=int, default=3, help="timed iterations (after one warm-up)")
    p.add_argument("--critic", default="shared", choices=["shared", "separate"])
    p.add_argument("--lora", action="store_true")
    p.add_argument("--precision", default="auto")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--stop-at-eos", action="store_true", help="let responses end at EOS (variable length)")
    p.add_argument("--json", action="store_true", help="print one JSON line per shape")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    if args.model:
        result = run_one(args)
        print(json.dumps(result) if args.json else _row(result), flush=True)
        return
    print(f"batch {args.batch} prompts x {args.new_tokens} new tokens, {args.epochs} PPO epochs, "
          f"minibatch {args.minibatch}, critic {args.critic}")
    for shape in SHAPES:
        cmd = [sys.executable, __file__, "--model", shape, *sys.argv[1:]]
        subprocess.run(cmd, check=True)


def _row(r: dict) -> str:
    return (f"{r['model']} ({r['params_m']:.1f}M params, {r['precision']}, lora={r['lora']}): "
            f"{r['sec_per_iteration']:.2f} s/iteration, rollout {r['rollout_tokens_per_sec']:.0f} tokens/s "
            f"({r['generate_sec']:.2f} s generating), peak RSS {r['peak_rss_mb']:.0f} MB")


if __name__ == "__main__":
    main()
