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

Learning, one command (`--learn`): the PPO stage of a finished `make demo` run, once per variant (default: engine
hf and engine vllm, everything else the demo's), each from the demo's SFT model and reward model, then one
`quartet eval` of SFT and every variant on the demo's eval prompts and settings, and a table: gold gain over SFT
with its CI (and whether the CIs overlap), relevance, KL, entropy, the critic's explained variance (mean of the
last 4 iterations), the doctor's findings, seconds per iteration and the rollout's share. Finished variants are
reused (--force re-runs them).

    .venv-vllm/bin/python benchmarks/engines.py --learn runs/demo --out runs/engines-learn
    .venv-vllm/bin/python benchmarks/engines.py --learn runs/demo --out runs/engines-learn \
        --variant hf=generation.engine=hf --variant vllm-tis=generation.engine=vllm,tis_cap=2.0
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
        m = trainer.step(it).metrics
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


def learn(args) -> None:
    """--learn: the demo's PPO stage per variant, one eval over all of them, a table (see the docstring)."""
    demo, out = Path(args.learn), Path(args.out)
    config = demo / "ppo" / "config.yaml"
    if not config.is_file() or not (demo / "pipeline.yaml").is_file():
        sys.exit(f"error: --learn {demo}: not a finished `make demo` run (no ppo/config.yaml or pipeline.yaml)")
    import yaml

    pipeline = yaml.safe_load((demo / "pipeline.yaml").read_text())
    ppo = yaml.safe_load(config.read_text())
    variants = dict(v.split("=", 1) for v in (args.variant or ["hf=generation.engine=hf", "vllm=generation.engine=vllm"]))
    quartet = [sys.executable, "-m", "quartet.cli"]
    out.mkdir(parents=True, exist_ok=True)
    wall = {}
    for name, overrides in variants.items():
        run = out / name
        if (run / "model").is_dir() and not args.force:
            print(f"{name}: reusing {run}", flush=True)
            continue
        cmd = [*quartet, "ppo", "-c", str(config), f"output_dir={run}", *overrides.split(","),
               *(["--overwrite"] if run.exists() else [])]
        print("$", " ".join(cmd), flush=True)
        t = time.perf_counter()
        subprocess.run(cmd, check=True)
        wall[name] = time.perf_counter() - t
    ev = pipeline.get("eval", {})
    models = [str(out / name / "model") for name in variants]
    cmd = [*quartet, "eval", ppo["policy"], *models, "--reward-model", ppo["reward"],
           "--prompts", ev.get("prompts") or "task:positive-review/eval", "--num-prompts", str(ev.get("num_prompts", 64)),
           "--max-new-tokens", str(ev.get("max_new_tokens", 48)), "--temperature", str(ev.get("temperature", 0.7)),
           "--seed", str(ev.get("seed", 0)), "--out", str(out / "eval"), "--overwrite"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    result = json.loads((out / "eval" / "eval.json").read_text())["checkpoints"]
    print(f"\nPPO stage of {demo} per variant, then one eval (64 prompts, the demo's settings); "
          f"gold gain = paired difference to SFT with its 95% CI")
    print(f"{'variant':10} {'gold gain [95% CI]':>26} {'relevance':>10} {'KL end':>7} {'KL max':>7} "
          f"{'entropy end':>11} {'EV last 4':>9} {'s/iter':>7} {'generate s':>10} {'gap mean':>9}  findings")
    gains = {}
    for name, model in zip(variants, models):
        r = result[model]
        gains[name] = g = r["score_diff"]
        rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        kl = [m["objective/kl"] for m in rows if "objective/kl" in m]
        it = [m["timing/total"] for m in rows[1:] if "timing/total" in m]
        gen = [m["timing/generate"] for m in rows[1:] if "timing/generate" in m]
        gap = [m["rollout/logprob_diff_mean"] for m in rows if "rollout/logprob_diff_mean" in m]
        ev = [m["value/explained_variance"] for m in rows if "value/explained_variance" in m][-4:]
        findings = out / name / "findings.jsonl"
        rules = [json.loads(line)["rule"] for line in findings.read_text().splitlines()] if findings.is_file() else []
        print(f"{name:10} {g['mean']:+8.3f} [{g['lo']:+.3f}, {g['hi']:+.3f}]{'':1} {r['relevance']['mean']:10.3f} "
              f"{kl[-1]:7.2f} {max(kl):7.2f} {rows[-1].get('policy/entropy', float('nan')):11.2f} "
              f"{statistics.mean(ev) if ev else float('nan'):9.3f} "
              f"{statistics.mean(it) if it else float('nan'):7.1f} {statistics.mean(gen) if gen else float('nan'):10.1f} "
              f"{(f'{statistics.mean(gap):.4f}' if gap else '-'):>9}  {', '.join(rules) or 'none'}")
    sft = result[ppo["policy"]]
    print(f"{'SFT':10} {'':>26} {sft['relevance']['mean']:10.3f}")
    names = list(gains)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            overlap = gains[a]["lo"] <= gains[b]["hi"] and gains[b]["lo"] <= gains[a]["hi"]
            print(f"gold gain CIs of {a} and {b} {'overlap' if overlap else 'do NOT overlap'}")
    import torch

    print(f"threads {torch.get_num_threads()}; wall s per PPO run (this call): "
          + (", ".join(f"{k} {v:.0f}" for k, v in wall.items()) or "all reused"))


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
    p.add_argument("--learn", metavar="DEMO_RUN", help="learning comparison from a finished `make demo` run")
    p.add_argument("--out", default="runs/engines-learn", help="--learn: where the variants and the eval go")
    p.add_argument("--variant", action="append", metavar="NAME=KEY=VALUE[,KEY=VALUE]",
                   help="--learn: a PPO variant as config overrides (repeatable; default hf and vllm)")
    p.add_argument("--force", action="store_true", help="--learn: re-run variants that already finished")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    if args.learn:
        learn(args)
        return
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
