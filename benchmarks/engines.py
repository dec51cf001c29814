"""Rollout tokens/s and seconds per PPO iteration with the hf and the vllm engine, side by side in one run.

    .venv-vllm/bin/python benchmarks/engines.py                 # SmolLM2-135M-Instruct, 16 prompts x 32 tokens
    .venv-vllm/bin/python benchmarks/engines.py --engines hf    # one of them

Needs .venv-vllm (`make vllm`) for the vllm engine; each engine runs in its own process (its own peak RSS).
Per engine: a PPO trainer is built (LoRA actor, shared critic, as in configs/demo.yaml); its engine is synced
and times `--calls` rollouts of the same 16 prompts (the first is warm-up: vLLM on CPU prepares kernels at each
new batch shape); then PPO iterations run, the first one not counted. Responses stop at EOS as in training, so
tokens/s counts the real response tokens. For vllm it also times the weight sync in memory (reload_weights
from tensors, what the engine does) against the fallback through a bf16 safetensors file, and reports the
trainer/engine log-prob gap that PPO logs (rollout/logprob_diff_mean).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def letters(prompts, responses):
    """A cheap reward: the share of letters in the response."""
    return [sum(c.isalpha() for c in r) / max(len(r), 1) for r in responses]


def run_one(args) -> dict:
    import torch

    from quartet.config import PPOConfig, from_dict
    from quartet.data import left_pad
    from quartet.monitor.metrics import peak_rss_mb
    from quartet.trainers.ppo import PPOTrainer

    out = Path(tempfile.mkdtemp(prefix="quartet-engines-"))
    cfg = from_dict(PPOConfig, {
        "policy": args.model, "reward": "engines:letters",
        "prompts": {"path": args.prompts, "max_prompt_tokens": 64},
        "output_dir": str(out / "ppo"), "iterations": args.iterations + 1,
        "rollout_batch_size": args.batch, "minibatch_size": args.minibatch, "micro_batch_size": args.minibatch,
        "ppo_epochs": args.epochs, "critic": "shared", "lora": {"enabled": True, "r": 16, "alpha": 32},
        "optim": {"lr": 3e-4},
        "generation": {"max_new_tokens": args.new_tokens, "batch_size": args.batch, "temperature": 1.0,
                       "engine": args.engine},
    })
    t = time.perf_counter()
    trainer = PPOTrainer(cfg, progress=False)
    setup_s = time.perf_counter() - t
    exp = trainer.experience
    engine, actor = exp.engine, trainer.roles.actor
    ids, mask = left_pad(exp.prompt_ids[: args.batch], trainer.roles.tokenizer.pad_token_id)

    syncs = []
    for _ in range(3):
        t = time.perf_counter()
        engine.sync(actor)
        syncs.append(time.perf_counter() - t)
    calls = []
    for k in range(args.calls):
        t = time.perf_counter()
        ro = engine.generate(ids, mask, seed=k)
        calls.append((time.perf_counter() - t, float(ro.response_mask.sum()), float(ro.eos.float().mean())))
    steady = calls[1:] or calls
    result = {
        "engine": args.engine, "model": args.model, "setup_s": setup_s,
        "sync_s": statistics.median(syncs),
        "first_rollout_s": calls[0][0],
        "rollout_tokens_per_s": sum(c[1] for c in steady) / sum(c[0] for c in steady),
        "rollout_s": statistics.median(c[0] for c in steady),
        "eos_rate": statistics.mean(c[2] for c in steady),
    }
    if args.engine == "vllm":
        result.update(_file_sync(engine, actor))

    times, gaps, gens = [], [], []
    for it in range(1, cfg.iterations + 1):
        t = time.perf_counter()
        m = trainer.step(it)
        if it > 1:
            times.append(time.perf_counter() - t)
            gens.append(m["timing/generate"])
        if "rollout/logprob_diff_mean" in m:
            gaps.append((m["rollout/logprob_diff_mean"], m["rollout/logprob_diff_max"]))
    result.update({
        "sec_per_iteration": statistics.mean(times), "generate_s_in_iteration": statistics.mean(gens),
        "peak_rss_mb": peak_rss_mb(), "threads": torch.get_num_threads(),
    })
    if gaps:
        result["logprob_diff_mean"] = statistics.mean(g[0] for g in gaps)
        result["logprob_diff_max"] = max(g[1] for g in gaps)
    return result


def _file_sync(engine, actor) -> dict:
    """The fallback to in-memory sync: write the bf16 weights as safetensors, have vLLM reload that file."""
    from safetensors.torch import save_file

    folder = Path(tempfile.mkdtemp(prefix="quartet-engines-sync-"))
    times = []
    try:
        for _ in range(3):
            t = time.perf_counter()
            save_file(dict(engine._weights(actor)), str(folder / "model.safetensors"))
            engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
            engine.llm.reset_prefix_cache()
            times.append(time.perf_counter() - t)
        return {"file_sync_s": statistics.median(times)}
    except Exception as e:  # report, do not hide: the in-memory path is what the engine uses
        return {"file_sync_error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="hf,vllm")
    p.add_argument("--engine", help=argparse.SUPPRESS)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", default="task:positive-review/train")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--minibatch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--calls", type=int, default=3, help="timed rollouts of the same prompts (first = warm-up)")
    p.add_argument("--iterations", type=int, default=2, help="timed PPO iterations (after one warm-up)")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    if args.engine:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return
    rows = []
    for engine in args.engines.split(","):
        cmd = [sys.executable, __file__, "--engine", engine, *sys.argv[1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"{engine}: failed (exit {proc.returncode})\n{(proc.stdout + proc.stderr)[-2000:]}")
            continue
        rows.append(json.loads(line[len("RESULT "):]))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.model}, {args.batch} prompts x {args.new_tokens} new tokens, PPO: LoRA, shared critic, "
          f"{args.epochs} epochs, minibatch {args.minibatch}")
    print(f"{'engine':8} {'tokens/s':>9} {'rollout s':>10} {'1st rollout s':>14} {'s/iteration':>12} "
          f"{'sync s':>7} {'gap mean':>9} {'RSS MB':>7}")
    for r in rows:
        gap = f"{r['logprob_diff_mean']:.4f}" if "logprob_diff_mean" in r else "-"
        print(f"{r['engine']:8} {r['rollout_tokens_per_s']:9.0f} {r['rollout_s']:10.2f} {r['first_rollout_s']:14.1f} "
              f"{r['sec_per_iteration']:12.1f} {r['sync_s']:7.2f} {gap:>9} {r['peak_rss_mb']:7.0f}")


if __name__ == "__main__":
    main()
