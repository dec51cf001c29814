"""PPO, GRPO, RLOO, REINFORCE++ and DPO under the same wall-clock budget, from the same SFT model, preference
labels and reward model, evaluated against SFT with `quartet eval` (issues 10 and 16).

    # full size: positive-review, SmolLM2-135M-Instruct on CPU; reuses runs/demo's sft/, label/ and rm/ (made
    # there with configs/demo.yaml's stages when missing), 240 s of training per method
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/algorithms.py --base runs/demo --out runs/algorithms --budget 240
    # tiny (seconds): tiny:llama models on tiny-target, its own SFT/label/RM in OUT/base
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/algorithms.py --tiny --out /tmp/algorithms

What each method is (all from the SFT model, LoRA r=16 like the demo, the demo's ppo section otherwise:
lr 3e-4 with 4 warmup steps, beta 0.05, 48 new tokens at temperature 1, minibatch 8):
- ppo: the demo's PPO (critic + GAE, shared value head, its rollout batch of prompts x 1 response per iteration,
  2 epochs: 32 prompts since issue 40, 16 when the table below was measured).
- grpo, rloo: the `quartet grpo` / `quartet rloo` presets (quartet.trainers.ppo.PRESETS) on top of those
  settings; reinforce_pp (and any other estimator name, e.g. dr_grpo, reinforce_pp_baseline, remax): the demo
  settings with `advantage: <name>`. Critic-free, G = --group (4) responses per prompt and PPO's prompts / G
  prompts per iteration, so an iteration samples as many responses as PPO's.
- dpo: `train_dpo` with the demo's dpo section (beta 0.1, lr 2e-4, batch 8) on the label stage's pairs;
  kl_samples 0 (eval measures KL).

The RL methods train against the reward model (VADER, the gold judge, is logged as objective/gold but never
optimised; the per-iteration relevance monitor of the pipeline is off so the budget goes to training). The
budget: each RL run is driven by `PPOTrainer.step(i)` in this script's loop and stops after the first
iteration whose end passes --budget seconds of training (the sum of step times: rollout, scoring,
update); `iterations` is set to --max-iterations (the cap the linear LR decay runs to, so the LR barely
decays within the budget). DPO has no step hook, so its steps are set from a measured rate: a 3-step probe
run, then max_steps = budget / (probe seconds per step). Seconds exclude model loading (and DPO's one pass of
reference log-probs). Each trained actor is saved merged with `quartet.models.save_model`.

Evaluation is one `quartet.eval.evaluate` call over SFT and every method (the pipeline eval stage's prompts,
seed, temperature and token limit; --eval-prompts prompts): gold gain = the paired-bootstrap mean
difference of the gold score against SFT with its 95% CI, KL = full-vocabulary KL to SFT per sequence,
length in tokens, distinct-2 over response tokens, relevance = the task's on-task judge. Writes
OUT/<method>/ (metrics.jsonl, model/), OUT/eval/ (eval.json, samples.jsonl), OUT/algorithms.json and
OUT/algorithms.md (the table), and prints the table. A method that fails is reported with its error in the
table and the others go on.

Measured (2026-11-23, one seed, OMP_NUM_THREADS=1, 2-core AMD EPYC with AVX-512 BF16 shared with other jobs,
load average 2.5-4.0; the first command above with --budget 240; the README section "Algorithms compared on
CPU" says more):

| method | iterations / steps | seconds | gold | gold gain vs SFT [95% CI] | KL to SFT | length | distinct-2 | relevance |
|---|---|---|---|---|---|---|---|---|
| SFT | - | - | 0.124 | - | 0.00 | 26.1 | 0.783 | 0.404 |
| ppo | 5 iterations | 285 | 0.579 | +0.455 [+0.309, +0.609] | 3.96 | 30.9 | 0.696 | 0.396 |
| grpo | 7 iterations | 255 | 0.562 | +0.438 [+0.289, +0.577] | 7.34 | 44.3 | 0.669 | 0.454 |
| rloo | 9 iterations | 270 | 0.661 | +0.537 [+0.388, +0.688] | 16.05 | 45.7 | 0.654 | 0.461 |
| reinforce_pp | 6 iterations | 269 | 0.854 | +0.729 [+0.594, +0.857] | 17.05 | 47.4 | 0.569 | 0.326 |
| dpo | 11 steps | 153 | 0.289 | +0.165 [+0.004, +0.319] | 0.76 | 31.4 | 0.741 | 0.457 |

DPO used 153 of its 240 s: the probe's 21.7 s/step (more load, first-step overhead) overestimated the run's
14.0. The tiny setting takes about 25 s in all (OMP_NUM_THREADS=1; a smoke test, the tiny RM teaches nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("ppo", "grpo", "rloo", "reinforce_pp", "dpo")
MARKER = "algorithms.json"
"""written into OUT at the end; an OUT that holds it (or does not exist) may be refilled"""

TINY_MODEL = "tiny:llama?hidden=32&layers=1&heads=4&vocab=260&seed=1"
TINY_PIPELINE = {
    "task": "tiny-target",
    "tracking": {"report_to": "none"},
    "sft": {"model": TINY_MODEL, "max_steps": 4, "batch_size": 8, "precision": "fp32", "eval_fraction": 0.2,
            "lora": {"enabled": True, "r": 8, "alpha": 16}, "optim": {"lr": 3e-3}},
    "label": {"num_samples": 4, "prompts": {"limit": 48, "max_prompt_tokens": 32}, "min_gap": 0.0,
              "generation": {"max_new_tokens": 12, "batch_size": 64}},
    "rm": {"model": TINY_MODEL.replace("seed=1", "seed=2"), "epochs": 2, "batch_size": 8, "precision": "fp32",
           "normalize_samples": 16},
    "ppo": {"rollout_batch_size": 16, "minibatch_size": 8, "micro_batch_size": 8, "ppo_epochs": 2,
            "prompts": {"max_prompt_tokens": 32}, "generation": {"max_new_tokens": 12, "batch_size": 16},
            "critic": "shared", "lora": {"enabled": True, "r": 8, "alpha": 16}, "optim": {"lr": 3e-3, "warmup_steps": 2},
            "kl_coef": 0.05, "precision": "fp32"},
    "dpo": {"beta": 0.1, "batch_size": 8, "max_seq_len": 64, "lora": {"enabled": True, "r": 8, "alpha": 16},
            "optim": {"lr": 3e-3, "warmup_steps": 2}, "precision": "fp32", "log_every": 2, "eval_every": 8},
    "eval": {"num_prompts": 16, "max_new_tokens": 12, "batch_size": 16},
}
"""the tiny setting: every stage on random byte-level models, tiny-target's prompts and judge"""


# --------------------------------------------------------------------------- inputs: SFT, labels, RM
def tiny_sft_data(path: Path) -> Path:
    """Demonstrations for the tiny SFT stage (tiny-target ships none): each prompt answered by its own
    letters reversed, an on-task answer that earns nothing from the gold judge."""
    from quartet.config import DataConfig
    from quartet.data import load_prompts

    prompts = [e.prompt for e in load_prompts(DataConfig(path="task:tiny-target/train"))][:64]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p, "completion": p[::-1]}) + "\n" for p in prompts))
    return path


def pipeline_config(args):
    """The pipeline config whose sft/label/rm outputs live in --base, wired as `quartet run` wires them."""
    from quartet.pipeline import load_pipeline

    overrides = [f"output_dir={args.base}", "stages=[sft,label,rm]"]
    if not args.tiny:
        return load_pipeline(str(args.config), overrides)
    out = Path(args.out)  # not in --base: `quartet run` refuses a folder holding files it did not write
    tree = json.loads(json.dumps(TINY_PIPELINE))
    tree["sft"]["data"] = {"path": str(tiny_sft_data(out / "tiny_sft.jsonl")), "chat_template": False}
    path = out / "tiny_pipeline.yaml"
    path.write_text(json.dumps(tree, indent=1))  # JSON is YAML
    return load_pipeline(str(path), overrides)


def ensure_base(cfg) -> dict:
    """Run the sft/label/rm stages whose outputs --base lacks (a present output is reused); {stage: seconds}."""
    from quartet.pipeline import run_pipeline

    have = {"sft": Path(cfg.sft.output_dir) / "model" / "config.json", "label": Path(cfg.label.output),
            "rm": Path(cfg.rm.output_dir) / "model" / "config.json"}
    missing = [s for s, p in have.items() if not p.is_file()]
    if not missing:
        print(f"reusing {cfg.output_dir}: sft/model, label/, rm/model", flush=True)
        return {}
    print(f"{cfg.output_dir} lacks {', '.join(missing)}: running those stages", flush=True)
    return run_pipeline(cfg)


# --------------------------------------------------------------------------- the RL methods
def rl_config(cfg, method: str, group: int, out: Path, max_iterations: int):
    """PPOConfig of one RL method: the pipeline's ppo section (the demo's settings), then the method's changes."""
    from quartet.config import PPOConfig, from_dict, to_dict
    from quartet.trainers.ppo import PRESETS

    tree = to_dict(cfg.ppo)
    tree.update(output_dir=str(out / method), iterations=max_iterations, save_every=0, monitor_judges={},
                tracking={"report_to": "none"})
    if method != "ppo":
        sequences = cfg.ppo.sequences_per_iteration
        tree.update(advantage=method, critic=None, samples_per_prompt=group,
                    rollout_batch_size=max(1, sequences // group))
        tree.update({k: v for k, v in PRESETS.get(method, {}).items() if k != "output_dir"})
        tree["samples_per_prompt"] = group  # --group wins over a preset's G
    return from_dict(PPOConfig, tree, "ppo")


def train_rl(pcfg, budget: float) -> dict:
    """Iterations until the summed step time passes `budget`; the actor saved to output_dir/model."""
    from quartet.models import save_model
    from quartet.monitor.metrics import MetricsLogger
    from quartet.trainers.ppo import PPOTrainer

    t_setup = time.perf_counter()
    trainer = PPOTrainer(pcfg, progress=False)
    setup = time.perf_counter() - t_setup
    elapsed, iteration, metrics = 0.0, 0, {}
    with trainer._lock, MetricsLogger(trainer.run_dir, "ppo", tracking=pcfg.tracking, params=pcfg) as logger:
        while elapsed < budget and iteration < pcfg.iterations:
            iteration += 1
            t = time.perf_counter()
            metrics = trainer.step(iteration).metrics
            elapsed += time.perf_counter() - t
            logger.log(iteration, metrics)
            print(f"  {pcfg.advantage} it {iteration}: {elapsed:.0f}s score {metrics['objective/score']:.3f} "
                  f"gold {metrics.get('objective/gold', math.nan):.3f} kl {metrics['objective/kl']:.2f} "
                  f"len {metrics['rollout/length_mean']:.0f}", flush=True)
        actor = trainer.accelerator.unwrap_model(trainer.model).actor
        save_model(actor, trainer.roles.tokenizer, trainer.run_dir / "model")
    return {"steps": iteration, "unit": "iterations", "seconds": elapsed, "setup_seconds": setup,
            "model": str(trainer.run_dir / "model"), "last": {k: metrics.get(k) for k in (
                "objective/score", "objective/gold", "objective/kl", "rollout/length_mean")}}


# --------------------------------------------------------------------------- DPO
def dpo_config(cfg, out: Path, **changes):
    from quartet.config import DPOConfig, from_dict, to_dict

    tree = to_dict(cfg.dpo)
    tree.update(kl_samples=0, tracking={"report_to": "none"}, **changes)
    return from_dict(DPOConfig, tree, "dpo")


def train_dpo_budget(cfg, budget: float, out: Path, probe_steps: int = 3) -> dict:
    """A probe of `probe_steps` steps measures seconds per step; the run then takes budget / that many steps."""
    from quartet.trainers.dpo import train_dpo

    probe = train_dpo(dpo_config(cfg, out, output_dir=str(out / "dpo-probe"), max_steps=probe_steps,
                                 eval_every=probe_steps), overwrite=True)
    rate = probe.seconds / probe.steps
    steps = max(1, int(budget / rate))
    print(f"  dpo probe: {probe.steps} steps in {probe.seconds:.1f}s -> {steps} steps for {budget:.0f}s", flush=True)
    shutil.rmtree(out / "dpo-probe", ignore_errors=True)
    t = time.perf_counter()
    result = train_dpo(dpo_config(cfg, out, output_dir=str(out / "dpo"), max_steps=steps), overwrite=True)
    return {"steps": result.steps, "unit": "steps", "seconds": result.seconds,
            "setup_seconds": time.perf_counter() - t - result.seconds, "model": str(result.model_dir),
            "last": {"dpo/loss": result.train_loss,
                     "rewards/eval_accuracy": result.eval.accuracy if result.eval is not None else None}}


# --------------------------------------------------------------------------- the table
def _ci(m) -> str:
    if not isinstance(m, dict):
        return "-"
    return f"{m['mean']:+.3f} [{m['lo']:+.3f}, {m['hi']:+.3f}]"


def _num(v, fmt: str = ".3f") -> str:
    if isinstance(v, dict):
        v = v["mean"]
    return "-" if v is None else format(v, fmt)


def make_table(runs: dict, checkpoints: dict, sft: str) -> str:
    """One markdown row per method (SFT first): steps, seconds, gold gain vs SFT, KL, length, distinct-2, relevance."""
    has_rel = any(isinstance(m.get("relevance"), dict) for m in checkpoints.values())
    head = ["method", "iterations / steps", "seconds", "gold", "gold gain vs SFT [95% CI]", "KL to SFT",
            "length", "distinct-2"] + (["relevance"] if has_rel else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def row(name, run, m):
        cells = [name, f"{run['steps']} {run['unit']}" if run else "-", f"{run['seconds']:.0f}" if run else "-",
                 _num(m.get("gold")), _ci(m.get("score_diff")) if run else "-", _num(m.get("kl_full"), ".2f"),
                 _num(m.get("length"), ".1f"), _num(m.get("distinct_2"))] + ([_num(m.get("relevance"))] if has_rel else [])
        return "| " + " | ".join(cells) + " |"

    lines.append(row("SFT", None, checkpoints[sft]))
    for method, run in runs.items():
        if "error" in run:
            lines.append(f"| {method} | failed: {run['error']} |" + " |" * (len(head) - 2))
        else:
            lines.append(row(method, run, checkpoints[run["model"]]))
    return "\n".join(lines)


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"), help="pipeline config (default: the demo)")
    p.add_argument("--base", default=None, help="pipeline dir holding sft/, label/, rm/ (made there when missing); "
                   "default: runs/demo, or OUT/base with --tiny")
    p.add_argument("--out", default="runs/algorithms")
    p.add_argument("--budget", type=float, default=None, help="training seconds per method (default 240, tiny 3)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated: ppo, dpo, or any advantage estimator (grpo, rloo, reinforce_pp, dr_grpo, ...)")
    p.add_argument("--group", type=int, default=4, help="G: responses per prompt of the critic-free methods")
    p.add_argument("--eval-prompts", type=int, default=None, help="default: the config's eval.num_prompts")
    p.add_argument("--max-iterations", type=int, default=1000, help="RL iteration cap (the LR schedule's length)")
    p.add_argument("--tiny", action="store_true", help="tiny models on tiny-target: a smoke test in seconds")
    args = p.parse_args(argv)

    import torch

    from quartet.algo import ESTIMATORS
    from quartet.eval.evaluate import evaluate

    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not (out / MARKER).is_file() and not (out / "base").is_dir():
        print(f"error: --out {out} exists and is not an output of this script; choose another", file=sys.stderr)
        return 2
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in ("ppo", "dpo", *ESTIMATORS)]
    if unknown or not methods:
        print(f"error: --methods: unknown method {unknown[0] if unknown else '(none)'} "
              f"(ppo, dpo, {', '.join(sorted(ESTIMATORS))})", file=sys.stderr)
        return 2
    args.base = args.base or str(out / "base" if args.tiny else "runs/demo")
    budget = args.budget if args.budget is not None else (3.0 if args.tiny else 240.0)
    out.mkdir(parents=True, exist_ok=True)
    for m in [*methods, "dpo-probe", "eval"]:
        shutil.rmtree(out / m, ignore_errors=True)  # an earlier run of this script

    cfg = pipeline_config(args)
    base_times = ensure_base(cfg)
    sft, rm = str(Path(cfg.sft.output_dir) / "model"), str(Path(cfg.rm.output_dir) / "model")

    runs: dict[str, dict] = {}
    for method in methods:
        print(f"\n== {method} ({budget:.0f}s) ==", flush=True)
        load = os.getloadavg()[0]  # other work on the machine slows a method down within its budget
        try:
            if method == "dpo":
                runs[method] = train_dpo_budget(cfg, budget, out)
            else:
                runs[method] = train_rl(rl_config(cfg, method, args.group, out, args.max_iterations), budget)
        except Exception as e:  # a failing method is a bug to report; the others still run
            traceback.print_exc()
            runs[method] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
        runs[method]["load_at_start"] = load

    print("\n== eval ==", flush=True)
    t = time.perf_counter()
    models = [r["model"] for r in runs.values() if "model" in r]
    ev = cfg.eval
    result = evaluate(
        [sft, *models], prompts=ev.prompts, num_prompts=args.eval_prompts or ev.num_prompts, reward_model=rm,
        reference=sft, baseline=sft, max_new_tokens=ev.max_new_tokens, temperature=ev.temperature, seed=ev.seed,
        batch_size=ev.batch_size, out=out / "eval", overwrite=True,
    )
    eval_seconds = time.perf_counter() - t
    table = make_table(runs, result.checkpoints, sft)
    s = result.settings
    note = (f"{s['num_prompts']} prompts of {s['prompts']}, temperature {s['temperature']}, seed {s['seed']}, "
            f"{s['max_new_tokens']} new tokens; budget {budget:.0f}s of training per method; torch "
            f"{torch.__version__}, {torch.get_num_threads()} threads; eval {eval_seconds:.0f}s")
    text = table + "\n\n" + note + "\n"
    (out / "algorithms.md").write_text(text)
    (out / MARKER).write_text(json.dumps({
        "budget": budget, "base": args.base, "base_stage_seconds": base_times, "group": args.group,
        "runs": runs, "eval": {k: result.checkpoints[v] for k, v in
                               [("sft", sft), *((m, r["model"]) for m, r in runs.items() if "model" in r)]},
        "settings": s, "eval_seconds": eval_seconds, "argv": sys.argv,
    }, indent=1, default=str))
    print("\n" + text)
    return 1 if any("error" in r for r in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
