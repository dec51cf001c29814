"""Run directories for the report tests: a pipeline (sft, rm, ppo + eval) and a single PPO run."""

from __future__ import annotations

import json
from pathlib import Path

from ppo_streams import broken_run, healthy_run, write_run

HOSTILE = '<script>alert("x")</script> & "quotes"'


def make_ppo_run(run_dir: Path, n: int = 20, rule: str | None = "truncation", gold: bool = True) -> Path:
    records = broken_run(rule, n) if rule else healthy_run(n)
    if not gold:
        for r in records:
            r.pop("objective/gold")
    write_run(run_dir, records)
    samples = [
        {"step": step, "prompt": f"{HOSTILE} prompt {i}", "response": f"answer {i} at step {step}", "score": step / n}
        for step in (1, n)
        for i in range(3)
    ]
    (run_dir / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples) + '{"step": 9, "pro')
    (run_dir / "config.yaml").write_text(f"iterations: {n}\nkl_coef: 0.05\n")
    return run_dir


def make_pipeline(root: Path) -> Path:
    write_run(root / "sft", [{"stage": "sft", "step": i, "sft/loss": 3 / i, "sft/eval_loss": 3.1 / i} for i in range(1, 8)])
    write_run(root / "rm", [{"stage": "rm", "step": i, "rm/loss": 0.7 / i, "rm/accuracy": 0.5 + i / 20} for i in range(1, 8)])
    make_ppo_run(root / "ppo", rule="overoptimization", n=40)
    (root / "eval").mkdir(parents=True, exist_ok=True)
    (root / "eval" / "eval.json").write_text(json.dumps({
        "checkpoints": {
            "sft": {"gold": {"mean": 0.21, "lo": 0.15, "hi": 0.27}, "length": 31.0},
            "ppo": {"gold": {"mean": 0.52, "lo": 0.44, "hi": 0.6}, "length": 33.5, "win_rate": 0.71},
        },
        "baseline": "sft",
        "samples": [{"prompt": HOSTILE, "sft": "a plain answer", "ppo": {"response": "a better answer", "gold": 0.9}}],
    }))
    return root
