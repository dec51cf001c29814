"""`quartet run`: the whole InstructGPT pipeline from one YAML file.

    SFT -> label (AI feedback) -> reward model -> PPO -> evaluation -> report

Each stage writes into `<output_dir>/<stage>/`; a stage whose output already exists is reused (pass
`--force` to redo it). Stage outputs are wired to the next stage's inputs unless the config names
them explicitly, so a config only says what differs from the defaults.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

from quartet.atomic import atomic_write_text
from quartet.config import (
    LabelConfig,
    PPOConfig,
    RewardConfig,
    SFTConfig,
    apply_overrides,
    from_dict,
    read_yaml,
    save_config,
    validate,
)
from quartet.errors import ConfigError


@dataclass
class EvalStageConfig:
    prompts: str = ""
    """eval prompts; default: the task's eval split"""
    num_prompts: int | None = 64
    """use the first N eval prompts"""
    max_new_tokens: int = 48
    temperature: float = 0.7
    """sampling temperature of the evaluation (fixed seed, same for every checkpoint)"""
    seed: int = 0
    batch_size: int = 16
    """prompts decoded together (CPU decoding is memory-bound: a larger batch costs little more per step)"""


@dataclass
class PipelineConfig:
    output_dir: str = "runs/pipeline"
    """every stage writes into a subdirectory of this"""
    task: str = "positive-review"
    """built-in task: its prompts, SFT demonstrations and gold judge fill what the stages leave unset"""
    stages: list = field(default_factory=lambda: ["sft", "label", "rm", "ppo", "eval"])
    """which stages run; a stage left out must have its output named explicitly where it is used"""
    sft: SFTConfig = field(default_factory=SFTConfig)
    label: LabelConfig = field(default_factory=LabelConfig)
    rm: RewardConfig = field(default_factory=RewardConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    eval: EvalStageConfig = field(default_factory=EvalStageConfig)

    def validate(self, where: str = "pipeline") -> None:
        unknown = [s for s in self.stages if s not in STAGE_ORDER]
        if unknown:
            raise ConfigError(f"{where}.stages: unknown stage '{unknown[0]}' (stages: {', '.join(STAGE_ORDER)})")


STAGE_ORDER = ("sft", "label", "rm", "ppo", "eval")


def wire(cfg: PipelineConfig, explicit: dict) -> PipelineConfig:
    """Fill each stage's inputs from the previous stage's outputs, unless the YAML set them."""
    out = Path(cfg.output_dir)
    task = cfg.task

    def unset(stage: str, *keys: str) -> bool:
        node = explicit.get(stage) or {}
        for k in keys[:-1]:
            node = node.get(k) or {}
        return keys[-1] not in node

    base_policy = cfg.sft.model
    policy = str(out / "sft" / "model") if "sft" in cfg.stages else base_policy
    if unset("sft", "data", "path"):
        cfg.sft.data.path = f"task:{task}/sft"
    if unset("sft", "output_dir"):
        cfg.sft.output_dir = str(out / "sft")
    if unset("label", "policy"):
        cfg.label.policy = policy
    if unset("label", "prompts", "path"):
        cfg.label.prompts.path = f"task:{task}/train"
    if unset("label", "judge"):
        cfg.label.judge = f"task:{task}"
    if unset("label", "output"):
        cfg.label.output = str(out / "label" / "preferences.jsonl")
    if unset("rm", "data", "path"):
        cfg.rm.data.path = cfg.label.output
    if unset("rm", "output_dir"):
        cfg.rm.output_dir = str(out / "rm")
    if unset("rm", "normalize_policy"):
        cfg.rm.normalize_policy = policy
    if unset("rm", "normalize_prompts") and cfg.rm.normalize_prompts is None:
        cfg.rm.normalize_prompts = dataclasses.replace(cfg.label.prompts)
    if unset("ppo", "policy"):
        cfg.ppo.policy = policy
    if unset("ppo", "reward"):
        cfg.ppo.reward = str(out / "rm" / "model") if "rm" in cfg.stages else f"task:{task}"
    if unset("ppo", "gold") and cfg.ppo.reward != f"task:{task}":
        cfg.ppo.gold = f"task:{task}"
    if unset("ppo", "prompts", "path"):
        cfg.ppo.prompts.path = f"task:{task}/train"
    if unset("ppo", "output_dir"):
        cfg.ppo.output_dir = str(out / "ppo")
    if not cfg.eval.prompts:
        cfg.eval.prompts = f"task:{task}/eval"
    return cfg


def load_pipeline(path: str, overrides: list[str] | None = None) -> PipelineConfig:
    data = apply_overrides(read_yaml(path), overrides or [])
    cfg = from_dict(PipelineConfig, data)
    cfg = wire(cfg, data)
    validate(cfg)
    return cfg


def _done(path: Path) -> bool:
    return (path / "config.json").is_file() if path.suffix == "" else path.is_file()


def run_pipeline(cfg: PipelineConfig, force: bool = False) -> dict:
    """Run the configured stages in order; returns {stage: seconds} (0.0 for reused stages)."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "pipeline.yaml")
    times: dict[str, float] = {}
    for stage in STAGE_ORDER:
        if stage not in cfg.stages:
            continue
        t = time.perf_counter()
        print(f"\n== {stage} ==", flush=True)
        ran = _run_stage(stage, cfg, force)
        times[stage] = time.perf_counter() - t if ran else 0.0
        if not ran:
            print(f"{stage}: output exists, reused (pass --force to redo)")
    return times


def _run_stage(stage: str, cfg: PipelineConfig, force: bool) -> bool:
    out = Path(cfg.output_dir)
    if stage == "sft":
        if _done(Path(cfg.sft.output_dir) / "model") and not force:
            return False
        from quartet.trainers.sft import train_sft

        train_sft(cfg.sft)
    elif stage == "label":
        if _done(Path(cfg.label.output)) and not force:
            return False
        from quartet.trainers.label import label

        label(cfg.label)
    elif stage == "rm":
        if _done(Path(cfg.rm.output_dir) / "model") and not force:
            return False
        from quartet.trainers.reward import train_reward

        train_reward(cfg.rm)
    elif stage == "ppo":
        if _done(Path(cfg.ppo.output_dir) / "model") and not force:
            return False
        from quartet.trainers.ppo import train_ppo

        ppo_dir = Path(cfg.ppo.output_dir)
        if force and ppo_dir.exists():
            import shutil

            shutil.rmtree(ppo_dir)
        train_ppo(cfg.ppo, resume=(ppo_dir / "checkpoints").is_dir())
    elif stage == "eval":
        _evaluate(cfg, out)
    return True


def _evaluate(cfg: PipelineConfig, out: Path) -> None:
    from quartet.eval.evaluate import evaluate, format_samples, format_table

    baseline = cfg.ppo.policy
    ppo_model = str(Path(cfg.ppo.output_dir) / "model")
    reward_model = cfg.ppo.reward if Path(cfg.ppo.reward).is_dir() else None
    result = evaluate(
        [baseline, ppo_model],
        prompts=cfg.eval.prompts,
        num_prompts=cfg.eval.num_prompts,
        reward_model=reward_model,
        reference=cfg.ppo.reference or baseline,
        baseline=baseline,
        max_new_tokens=cfg.eval.max_new_tokens,
        temperature=cfg.eval.temperature,
        seed=cfg.eval.seed,
        batch_size=cfg.eval.batch_size,
        out=out / "eval",
    )
    names = {baseline: "SFT", ppo_model: "PPO"}
    text = "\n".join([
        "# Quartet pipeline summary", "",
        f"task `{cfg.task}`, policy `{cfg.sft.model}`; evaluation on {cfg.eval.prompts} "
        f"(temperature {cfg.eval.temperature}, seed {cfg.eval.seed}); SFT = `{baseline}`, PPO = `{ppo_model}`", "",
        format_table(result, names=names), "",
        "## Samples", "", format_samples(result, k=3, names=names), "",
    ])
    atomic_write_text(out / "summary.md", text)


def cli(args) -> int:
    cfg = load_pipeline(args.config, args.overrides)
    start = time.perf_counter()
    times = run_pipeline(cfg, force=args.force)
    out = Path(cfg.output_dir)
    from quartet.monitor.report import write_report

    report = write_report(out)
    total = time.perf_counter() - start
    lines = [f"{stage}: {sec:.0f} s" for stage, sec in times.items()] + [f"total: {total:.0f} s"]
    timing = "\n".join(["", "## Time per stage", "", *(f"- {line}" for line in lines), ""])
    summary = out / "summary.md"
    if summary.is_file():
        atomic_write_text(summary, summary.read_text(encoding="utf-8") + timing)
        print("\n" + summary.read_text(encoding="utf-8"))
    print(f"report: {report}")
    return 0
