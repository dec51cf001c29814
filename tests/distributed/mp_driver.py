"""Run one step of a stage on the tiny model and save what it computed, for the N-process equivalence tests.

    accelerate launch --cpu --num_processes N tests/distributed/mp_driver.py STAGE OUT.pt [key=value ...]

Sizes are given for the whole batch; each process takes its share (1 process x 16 = 2 processes x 8).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainers"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for builders

TINY = "tiny:llama?hidden=32&layers=1&heads=4&vocab=260&seed=1"
# AdamW in its linear regime (eps 1), so the two runs' weights differ by lr x rounding: tests/equivalence.py
LINEAR_ADAM = "optim.adam_eps=1"


def ppo(out: Path, overrides: list[str]) -> None:

    from builders import tiny_ppo
    from quartet.config import validate
    from quartet.trainers.ppo import PPOTrainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = tiny_ppo(out.parent, f"output_dir={out.parent / 'run'}", "iterations=2", f"rollout_batch_size={16 // world}",
                   f"minibatch_size={8 // world}", f"micro_batch_size={4 // world}",
                   "generation.batch_size=32",  # GenerationConfig's default, at which these runs were compared
                   LINEAR_ADAM, "reward_norm=true", "adaptive_kl=true", *overrides)
    validate(cfg)  # as load_config, and so the CLI, does before the trainer
    trainer = PPOTrainer(cfg, progress=False)
    # the one-process run's starting weights, to check that the steps compared are large against the tolerance
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()} if world == 1 else None
    seen = []
    make = trainer.experience.make
    trainer.experience.make = lambda model, it: seen.append(make(model, it)) or seen[-1]
    metrics = [trainer.step(1).metrics, trainer.step(2).metrics]
    policy = trainer.accelerator.unwrap_model(trainer.model)
    from quartet.trainers.sharding import full_state_dict

    full = full_state_dict(trainer.model)  # None unless sharded (tests/distributed/shard_driver.py); collective
    if trainer.accelerator.is_main_process:
        torch.save({
            "response_ids": [e.rollout.response_ids for e in seen],
            "response_mask": [e.rollout.response_mask for e in seen],
            "advantages": [e.rollout.advantages for e in seen],
            "scores": [e.rollout.scores for e in seen],
            "metrics": [{k: v for k, v in m.items() if not k.startswith(("timing/", "memory/"))} for m in metrics],
            "weights": full if full is not None else {n: p.detach().clone() for n, p in policy.named_parameters()},
            "start": start,
            "shares_prefix": [trainer.plan.actor_shares_prefix, trainer.plan.critic_shares_prefix,
                              trainer.plan.reference_shares_prefix],
        }, out)
    trainer.accelerator.wait_for_everyone()


def _save_weights(out: Path, run: Path, stage: str, model_dir: Path) -> None:
    """Main process: the saved model's tensors and the run's metrics lines."""
    import json

    from safetensors.torch import load_file

    weights = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    torch.save({"weights": weights, "metrics": [{k: v for k, v in r.items() if k.startswith(stage)} for r in lines],
                "steps": [r["step"] for r in lines]}, out)


def _rows(path: Path, rows: list[dict]) -> str:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _supervised(out: Path, overrides: list[str], stage: str, rows: list[dict]) -> None:
    """Two optimizer steps of sft or rm on `rows`, 8 rows x 2 micro-batches per step in all."""
    from quartet.config import RewardConfig, SFTConfig, load_config
    from quartet.trainers.reward import train_reward
    from quartet.trainers.sft import train_sft

    cls, train = {"sft": (SFTConfig, train_sft), "rm": (RewardConfig, train_reward)}[stage]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_config(cls, overrides=[
        f"model={TINY}", f"data.path={_rows(out.parent / 'data.jsonl', rows)}", "data.chat_template=false",
        "eval_fraction=0", f"output_dir={out.parent / 'run'}", "max_steps=2", f"batch_size={8 // world}",
        "grad_accum=2", "optim.lr=1e-2", LINEAR_ADAM, "optim.warmup_steps=0", "precision=fp32", "log_every=1", *overrides])
    result = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        _save_weights(out, result.run_dir, f"{stage}/", result.model_dir)


def sft(out: Path, overrides: list[str]) -> None:
    # completions of different lengths, so per-process token counts differ
    _supervised(out, overrides, "sft", [{"prompt": f"q{i}", "completion": "ab" * (1 + i % 5)} for i in range(32)])


def rm(out: Path, overrides: list[str]) -> None:
    from quartet.trainers import reward

    reward.CHUNK_ROWS = 3  # several forwards before each backward (under DDP too), one chunk with a partial row set
    _supervised(out, overrides, "rm", [{"prompt": f"q{i}", "chosen": "yes " * (1 + i % 3), "rejected": "no"}
                                       for i in range(32)])


if __name__ == "__main__":
    torch.set_num_threads(1)
    stage, out, *overrides = sys.argv[1:]
    {"ppo": ppo, "sft": sft, "rm": rm}[stage](Path(out), overrides)
    from quartet.cli import leave_process_group

    leave_process_group()
