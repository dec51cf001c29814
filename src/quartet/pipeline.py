"""`quartet run`: the whole InstructGPT pipeline from one YAML file.

    SFT -> label (AI feedback) -> reward model -> PPO -> evaluation -> report
    SFT -> label (AI feedback) -> DPO -> evaluation -> report     (stages: [sft, label, dpo, eval])
    SFT -> label -> RM -> PPO -> label -> RM -> PPO ... -> evaluation -> report     (rounds: N)

Each stage writes into `<output_dir>/<stage>/` (round k >= 2's into `<output_dir>/rounds/<k>/<stage>/`); a stage whose output already exists is reused (pass
`--force` to redo it). Stage outputs are wired to the next stage's inputs unless the config names
them explicitly, so a config only says what differs from the defaults.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from quartet.algo.estimators import get_estimator
from quartet.atomic import atomic_write_text
from quartet.config import (
    DPOConfig,
    EvalConfig,
    LabelConfig,
    PPOConfig,
    RewardConfig,
    SFTConfig,
    TrackingConfig,
    apply_overrides,
    from_dict,
    positive,
    read_yaml,
    save_config,
    validate,
)
from quartet.config.stages import NO_JUDGE
from quartet.errors import ConfigError
from quartet.eval.evaluate import evaluate, format_breakdown, format_samples, format_table, format_tax
from quartet.models.card import add_eval
from quartet.monitor.metrics import read_metrics
from quartet.monitor.report import write_report
from quartet.monitor.rules import check_rule_names
from quartet.monitor.tracking import PipelineTracking
from quartet.outputs import check_output_dir, write_marker
from quartet.preflight import check_inputs as check_stage_inputs
from quartet.preflight import stage_inputs
from quartet.tasks import get_task, list_tasks
from quartet.trainers.checkpoint import list_checkpoints
from quartet.trainers.dpo import train_dpo
from quartet.trainers.label import check_outputs as check_label_outputs
from quartet.trainers.label import label as run_label
from quartet.trainers.label import samples_path, verdicts_path
from quartet.trainers.ppo import train_ppo
from quartet.trainers.reward import train_reward
from quartet.trainers.sft import train_sft


@dataclass
class PipelineConfig:
    output_dir: str = "runs/pipeline"
    """every stage writes into a subdirectory of this"""
    task: str = "positive-review"
    """built-in task: its prompts, SFT demonstrations and gold judge fill what the stages leave unset"""
    stages: list = field(default_factory=lambda: ["sft", "label", "rm", "ppo", "eval"])
    """which stages run; a stage left out must have its output named explicitly where it is used.
    `dpo` replaces `rm` + `ppo` (or runs beside them); eval compares every policy stage that ran with SFT"""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """the sft stage's settings (`quartet sft`'s); its data and output_dir follow task and output_dir"""
    label: LabelConfig = field(default_factory=LabelConfig)
    """the label stage's settings (`quartet label`'s); its policy is the SFT model"""
    rm: RewardConfig = field(default_factory=RewardConfig)
    """the reward-model stage's settings (`quartet rm`'s); it trains on the label stage's pairs"""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """the ppo stage's settings, at `quartet ppo`'s defaults: for GRPO or RLOO set the fields of their preset
    (`quartet config grpo` shows them)"""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """the dpo stage's settings (`quartet dpo`'s); it trains on the label stage's pairs"""
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(prompts="", num_prompts=64))
    """the evaluation that compares every policy stage that ran with the SFT model (`quartet eval`'s settings;
    left unset, baseline is the SFT model, reference the policy stage's reference or else the SFT model, and
    reward_model the ppo stage's reward model)"""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """trackers for every stage (a stage's own `tracking` replaces it); run_name defaults to output_dir's name,
    each stage's run is `<run_name>-<stage>` in group `<run_name>`, and a `<run_name>` run holds the resolved
    config, the eval table and the report"""
    rounds: int = 1
    """rounds of feedback, InstructGPT's "more comparison data is collected on the current best policy, which is
    used to train a new RM and then a new policy": round k+1 labels answers of round k's PPO policy (label seed + k),
    trains a new reward model on every round's pairs so far, and runs PPO again from the SFT model with it; rounds
    2.. write into `<output_dir>/rounds/<k>/` and the eval compares every round's policy with SFT. 1: no rounds"""

    def validate(self, where: str = "pipeline") -> None:
        if not self.stages:
            raise ConfigError(f"{where}.stages: names no stage; list at least one of {', '.join(STAGE_ORDER)}")
        unknown = [s for s in self.stages if s not in STAGE_ORDER]
        if unknown:
            raise ConfigError(f"{where}.stages: unknown stage '{unknown[0]}' (stages: {', '.join(STAGE_ORDER)})")
        if self.task not in list_tasks():
            raise ConfigError(f"{where}.task: unknown task '{self.task}' (known tasks: {', '.join(list_tasks())})")
        if self.label.judge == NO_JUDGE and "label" in self.stages and {"rm", "dpo"} & set(self.stages):
            raise ConfigError(f"{where}.label.judge: none writes answers and no pairs, and the "
                              f"{'rm' if 'rm' in self.stages else 'dpo'} stage trains on pairs; name a judge, or "
                              f"rank the answers in `quartet annotate` and train on its export")
        positive(self.rounds, f"{where}.rounds")
        if self.rounds > 1:
            _check_rounds(self, where)


STAGE_ORDER = ("sft", "label", "rm", "ppo", "dpo", "eval")
POLICY_STAGES = ("ppo", "dpo")
"""stages whose output is a policy the eval compares with the SFT model"""
ROUND_STAGES = ("label", "rm", "ppo")
"""the stages each round after the first runs again"""


def _check_rounds(cfg: PipelineConfig, where: str) -> None:
    missing = [s for s in ROUND_STAGES if s not in cfg.stages]
    if missing:
        raise ConfigError(f"{where}.rounds: {cfg.rounds} rounds need the {', '.join(ROUND_STAGES)} stages (round k+1 "
                          f"labels answers of round k's PPO policy); stages has no {', '.join(missing)}")
    if "dpo" in cfg.stages:
        raise ConfigError(f"{where}.rounds: rounds run label -> rm -> ppo again; leave dpo out of stages, or run it "
                          f"with rounds: 1")
    rm_model = str(Path(cfg.rm.output_dir) / "model")
    if cfg.ppo.reward != rm_model:
        raise ConfigError(f"{where}.rounds: each round's PPO trains with that round's reward model; leave ppo.reward "
                          f"unset (it is '{cfg.ppo.reward}', the rm stage writes '{rm_model}')")


def round_config(cfg: PipelineConfig, k: int) -> PipelineConfig:
    """The pipeline as round `k` runs it: round 1 is `cfg` itself; round k >= 2 labels answers of round k-1's PPO
    policy with seed label.seed + k - 1, trains its reward model on every round's pairs up to k (one file,
    `combine_pairs`), and runs PPO with it, each into `<output_dir>/rounds/<k>/`; every other setting is round 1's.

    Each round's PPO starts from the SFT model (ppo.policy), as InstructGPT's RL policies were all fine-tuned from
    their SFT model, the rounds sharing data, not weights: the KL penalty is measured against SFT anyway, so a
    policy continued from round k-1 would start with round k-1's KL already spent, and keep what it learned to
    exploit in round k-1's reward model, which the new pairs were collected to correct."""
    if k == 1:
        return cfg
    out = round_dir(cfg, k)
    previous = round_config(cfg, k - 1)
    label, rm, ppo = (copy.deepcopy(getattr(cfg, s)) for s in ROUND_STAGES)
    label.policy = str(Path(previous.ppo.output_dir) / "model")
    label.output = str(out / "label" / Path(cfg.label.output).name)
    label.seed = cfg.label.seed + k - 1  # other draws than round 1's, also where two rounds' policies agree
    rm.data.path = str(out / "pairs.jsonl")
    rm.output_dir = str(out / "rm")
    ppo.reward = str(out / "rm" / "model")
    ppo.output_dir = str(out / "ppo")
    for sub in (label, rm, ppo):
        if sub.tracking.run_name:
            sub.tracking.run_name = f"{sub.tracking.run_name}-round-{k}"
    return dataclasses.replace(cfg, label=label, rm=rm, ppo=ppo)


def round_dir(cfg: PipelineConfig, k: int) -> Path:
    """Where round k >= 2 writes its label, rm and ppo stages and its combined pairs."""
    return Path(cfg.output_dir) / "rounds" / str(k)


def combine_pairs(cfg: PipelineConfig, k: int) -> Path:
    """Every round's pairs up to k in one file, each row tagged with its `round` (the data readers take one path,
    and ignore the tag): what round k's reward model trains on. Written again before each of its runs, from the
    label stages' files as they are then."""
    rows = []
    for j in range(1, k + 1):
        text = Path(round_config(cfg, j).label.output).read_text(encoding="utf-8")
        rows += [json.dumps(json.loads(line) | {"round": j}, ensure_ascii=False) + "\n"
                 for line in text.splitlines() if line.strip()]
    return atomic_write_text(round_dir(cfg, k) / "pairs.jsonl", "".join(rows))


def _steps(cfg: PipelineConfig):
    """(stage, the pipeline as that stage's round runs it, round) in the order they run: the configured stages,
    rounds 2.. after the first round's ppo."""
    for stage in STAGE_ORDER:
        if stage in cfg.stages:
            yield stage, cfg, 1
        if stage == "ppo":
            for k in range(2, cfg.rounds + 1):
                round_cfg = round_config(cfg, k)
                for again in ROUND_STAGES:
                    yield again, round_cfg, k


def _step_name(stage: str, k: int) -> str:
    return stage if k == 1 else f"{stage} (round {k})"


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
    if unset("rm", "normalize_responses") and _label_answers_fit(cfg):
        cfg.rm.normalize_responses = str(samples_path(cfg.label.output))  # no second round of sampling
    if unset("ppo", "policy"):
        cfg.ppo.policy = policy
    if unset("ppo", "reward") and not cfg.ppo.reward_funcs:  # reward_funcs stand in its place
        cfg.ppo.reward = str(out / "rm" / "model") if "rm" in cfg.stages else f"task:{task}"
    if unset("ppo", "gold") and cfg.ppo.reward != f"task:{task}":
        cfg.ppo.gold = f"task:{task}"
    if unset("ppo", "monitor_judges") and task in list_tasks() and "relevance" in get_task(task).judges:
        cfg.ppo.monitor_judges = {"relevance": f"task:{task}/relevance"}  # the on-task signal, logged every iteration
    if unset("ppo", "prompts", "path"):
        cfg.ppo.prompts.path = f"task:{task}/train"
    if unset("ppo", "output_dir"):
        cfg.ppo.output_dir = str(out / "ppo")
    if unset("dpo", "policy"):
        cfg.dpo.policy = policy
    if unset("dpo", "data", "path"):
        cfg.dpo.data.path = cfg.label.output
    if unset("dpo", "output_dir"):
        cfg.dpo.output_dir = str(out / "dpo")
    if not cfg.eval.prompts:
        cfg.eval.prompts = f"task:{task}/eval"
    # one tracker run per stage, grouped under the pipeline's run name
    cfg.tracking.run_name = cfg.tracking.run_name or out.name
    cfg.tracking.group = cfg.tracking.group or cfg.tracking.run_name
    for stage in ("sft", "label", "rm", "ppo", "dpo"):
        sub = getattr(cfg, stage)
        if unset(stage, "tracking"):
            sub.tracking = dataclasses.replace(cfg.tracking, run_name=None)
        sub.tracking.run_name = sub.tracking.run_name or f"{cfg.tracking.run_name}-{stage}"
        sub.tracking.group = sub.tracking.group or cfg.tracking.group
    return cfg


def load_pipeline(path: str, overrides: list[str] | None = None) -> PipelineConfig:
    data = apply_overrides(read_yaml(path), overrides or [])
    cfg = from_dict(PipelineConfig, data)
    cfg = wire(cfg, data)
    validate(cfg)
    check_rule_names(cfg.ppo.stop_on, "ppo.stop_on")  # the doctor's rules: config knows none of them
    return cfg


def _done(path: Path) -> bool:
    return (path / "config.json").is_file() if path.suffix == "" else path.is_file()


def _label_answers_fit(cfg: PipelineConfig) -> bool:
    """Whether the label stage's answers are what the reward model's normalisation would sample: the same policy,
    prompts and sampling settings, and the answers file written (or about to be: a label output without one is
    an earlier version's, and the normalisation samples anew)."""
    sampling = ("temperature", "top_p", "top_k", "max_new_tokens")
    label, rm = cfg.label, cfg.rm
    return ("label" in cfg.stages and rm.normalize_policy == label.policy and rm.normalize_prompts == label.prompts
            and all(getattr(label.generation, k) == getattr(rm.normalize_generation, k) for k in sampling)
            and (samples_path(label.output).is_file() or not Path(label.output).exists()))


def check_inputs(cfg: PipelineConfig) -> None:
    """Every input the configured stages will read, checked before the first stage starts, so a typo in
    the last stage does not cost the hours of the first ones: model names and dirs (config.json and
    weight headers), data (files, task names and splits, and every row with the fields its stage reads),
    reward and judge specs (task names, `module:function` imports, trained reward-model dirs), each with the
    stage's own check (quartet.preflight), and each stage's output (not a user's folder or file). What an
    earlier stage of this run writes is taken on trust. Errors name the config key."""
    check_output_dir(cfg.output_dir, "pipeline", overwritable=False)  # the folder around the stages' first
    made: set[str] = set()  # outputs of the stages that run before the one being checked

    for stage, round_cfg, k in _steps(cfg):
        sub = getattr(round_cfg, stage)
        if stage == "rm" and k > 1:
            made.add(os.path.normpath(sub.data.path))  # the rounds' pairs, combined
        check_stage_inputs(stage_inputs(stage, sub), skip=made)
        # where it writes: each stage refuses a user's folder or file when it starts; say so before the first
        if stage == "label":
            check_label_outputs(Path(sub.output), verdicts_path(sub))
        elif stage == "eval":
            check_output_dir(Path(cfg.output_dir) / "eval", "eval", key="out", overwritable=False)
        else:
            check_output_dir(sub.output_dir, stage, overwritable=False)
        if stage == "label":
            made.update({os.path.normpath(sub.output), os.path.normpath(samples_path(sub.output))})
        elif stage != "eval":
            made.add(os.path.normpath(Path(sub.output_dir) / "model"))


def run_pipeline(cfg: PipelineConfig, force: bool = False) -> dict:
    """Run the configured stages in order; returns {stage: seconds} (0.0 for reused stages)."""
    validate(cfg)  # every stage's settings (batch arithmetic included), also for a config built in Python
    check_rule_names(cfg.ppo.stop_on, "ppo.stop_on")
    check_inputs(cfg)
    out = check_output_dir(cfg.output_dir, "pipeline", overwritable=False)  # a user's folder is never written into
    times: dict[str, float] = {}
    with PipelineTracking(cfg.tracking, out, params=cfg) as tracking:
        for stage, round_cfg, k in _steps(cfg):
            t = time.perf_counter()
            name = _step_name(stage, k)
            ran_as = f" ({_algorithm_title(cfg, stage)})" if stage == "ppo" and cfg.ppo.advantage != "gae" else ""
            print(f"\n== {name}{ran_as} ==", flush=True)
            if stage == "rm" and k > 1:
                combine_pairs(cfg, k)
            ran = _run_stage(stage, round_cfg, force)
            times[name] = time.perf_counter() - t if ran else 0.0
            if ran:
                _mark(cfg, out)  # a stage of this call has its result: the folder is this call's run
            else:
                print(f"{name}: output exists, reused (pass --force to redo)")
        _mark(cfg, out)
        report = write_report(out)
        files = [report, out / "summary.md", out / "pipeline.yaml", out / "eval" / "eval.json"]
        tracking.attach(files, eval_table(out / "eval" / "eval.json"))
    return times


def _mark(cfg: PipelineConfig, out: Path) -> None:
    """The marker and this call's pipeline.yaml, written once a stage of the call has its result (or every stage
    was reused), not before: a call that fails in its first stage leaves the folder as it was, or absent."""
    write_marker(out, "pipeline")
    save_config(cfg, out / "pipeline.yaml")


def eval_table(path: Path):
    """(columns, rows) of an eval.json: one row per checkpoint (`<out>/<stage>/model` is called by its stage),
    the mean of each metric; None without an eval."""
    if not path.is_file():
        return None
    checkpoints = json.loads(path.read_text(encoding="utf-8"))["checkpoints"]
    keys = sorted({k for m in checkpoints.values() for k, v in m.items() if v is not None})
    rows = []
    for name, m in checkpoints.items():
        label = Path(name).parent.name if Path(name).name == "model" else name
        rows.append([label, *(m[k]["mean"] if isinstance(m.get(k), dict) else m.get(k) for k in keys)])
    return ["checkpoint", *keys], rows


def _run_stage(stage: str, cfg: PipelineConfig, force: bool) -> bool:
    out = Path(cfg.output_dir)
    if stage == "sft":
        if _done(Path(cfg.sft.output_dir) / "model") and not force:
            return False
        train_sft(cfg.sft)
    elif stage == "label":
        # judge: none writes no pairs; its answers file is its result
        done = samples_path(cfg.label.output) if cfg.label.judge == NO_JUDGE else Path(cfg.label.output)
        if _done(done) and not force:
            return False
        run_label(cfg.label)
    elif stage == "rm":
        if _done(Path(cfg.rm.output_dir) / "model") and not force:
            return False
        train_reward(cfg.rm)
    elif stage == "ppo":
        if _done(Path(cfg.ppo.output_dir) / "model") and not force:
            return False
        ppo_dir = Path(cfg.ppo.output_dir)
        if not (force and ppo_dir.exists()):
            # an iter-N checkpoint, not just the folder: with save_every: 0 it may hold best-N copies only
            train_ppo(cfg.ppo, resume=bool(list_checkpoints(ppo_dir)))
            return True
        # --force: a new run in place of the old one (PPO keeps its checkpoints in place, so it cannot be written
        # beside it). The old one is moved aside, and put back if the new one fails before it has a checkpoint to
        # resume from; deleted once the new one has finished (or has one)
        aside = ppo_dir.with_name(f".{ppo_dir.name}.old-{os.getpid()}")
        os.replace(ppo_dir, aside)
        try:
            train_ppo(cfg.ppo)
        except BaseException:
            if not list_checkpoints(ppo_dir):
                shutil.rmtree(ppo_dir, ignore_errors=True)
                os.replace(aside, ppo_dir)
            raise
        finally:
            if aside.exists():
                shutil.rmtree(aside, ignore_errors=True)
    elif stage == "dpo":
        if _done(Path(cfg.dpo.output_dir) / "model") and not force:
            return False
        train_dpo(cfg.dpo)
    elif stage == "eval":
        _evaluate(cfg, out)
    return True


def _algorithm_title(cfg: PipelineConfig, stage: str) -> str:
    """What a policy stage ran, as people name it: the ppo stage runs PPO, GRPO, RLOO ... by its estimator."""
    return get_estimator(cfg.ppo.advantage).title if stage == "ppo" else stage.upper()


def _evaluate(cfg: PipelineConfig, out: Path) -> None:
    ran = [s for s in POLICY_STAGES if s in cfg.stages] or ["ppo"]  # eval alone: the PPO run of an earlier call
    policies = {str(Path(getattr(cfg, s).output_dir) / "model"): _algorithm_title(cfg, s) for s in ran}
    if cfg.rounds > 1:  # every round's policy; the last round's reward model, trained on every round's pairs
        policies = {str(Path(round_config(cfg, k).ppo.output_dir) / "model"): f"{_algorithm_title(cfg, 'ppo')} "
                    f"round {k}" for k in range(1, cfg.rounds + 1)}
    last = round_config(cfg, cfg.rounds)
    baseline = cfg.eval.baseline or getattr(cfg, ran[0]).policy
    reward_model = last.ppo.reward if "ppo" in ran and Path(last.ppo.reward).is_dir() else None
    settings = dataclasses.replace(cfg.eval, baseline=baseline, reward_model=cfg.eval.reward_model or reward_model,
                                   reference=cfg.eval.reference or getattr(cfg, ran[0]).reference or baseline)
    result = evaluate([baseline, *policies], **dataclasses.asdict(settings), out=out / "eval")
    names = {baseline: "SFT", **policies}
    table = format_table(result, names=names)
    for path, name in policies.items():  # each evaluated policy's model card states how it compared
        add_eval(path, table, f"{name} against the SFT model (`{baseline}`) on {cfg.eval.prompts}, "
                              f"{cfg.eval.num_prompts or 'all'} prompts, temperature {cfg.eval.temperature}, "
                              f"seed {cfg.eval.seed} (`quartet run`'s eval stage):")
    cases = out / "eval" / "bad_cases.jsonl"
    text = "\n".join([
        "# Quartet pipeline summary", "",
        f"task `{cfg.task}`, policy `{cfg.sft.model}`; evaluation on {cfg.eval.prompts} "
        f"(temperature {cfg.eval.temperature}, seed {cfg.eval.seed}); SFT = `{baseline}`"
        + "".join(f", {name} = `{path}`" for path, name in policies.items()), "",
        table, "",
        *([f"By group ({result.settings['gold']}):", "", format_breakdown(result.breakdown, names), ""]
          if result.breakdown else []),
        *(_tax_section(result, names) if result.tasks else []),
        *(_rounds_table(cfg) if cfg.rounds > 1 else []),
        *([f"Bad cases for the next round of feedback: `{cases}` (`quartet label judge=none prompts.path={cases}`)",
           ""] if cfg.eval.bad_cases else []),
        "## Samples", "", format_samples(result, k=3, names=names), "",
    ])
    atomic_write_text(out / "summary.md", text)


def _tax_section(result, names: dict[str, str]) -> list[str]:
    """The alignment tax (eval.extra_tasks): each policy on other tasks than the pipeline's, against SFT."""
    return ["## Alignment tax", "",
            "Each checkpoint on other tasks (their eval split, their gold judge, the eval's sampling): what the "
            "training cost outside its task. Gold mean [95% CI], and the paired difference from SFT.", "",
            format_tax(result, names), "",
            *(line for task, t in result.tasks.items() if t.get("breakdown")
              for line in (f"{task} by group:", "", format_breakdown(t["breakdown"], names), ""))]


def _rounds_table(cfg: PipelineConfig) -> list[str]:
    """Each round's data: which policy answered, the pairs it gave, and the reward model trained on them."""
    lines = ["## Rounds", "", "| round | answers from | pairs | reward model trained on | its held-out accuracy |",
             "|---|---|---|---|---|"]
    total = 0
    for k in range(1, cfg.rounds + 1):
        r = round_config(cfg, k)
        pairs = sum(1 for line in Path(r.label.output).read_text(encoding="utf-8").splitlines() if line.strip())
        total += pairs
        held = [m["rm/eval_accuracy"] for m in read_metrics(r.rm.output_dir, warn=False) if "rm/eval_accuracy" in m]
        accuracy = f"{held[-1]:.3f}" if held else "-"
        rounds = f"rounds 1-{k}" if k > 1 else "round 1"
        lines.append(f"| {k} | `{r.label.policy}` | {pairs} | {total} pairs of {rounds} | {accuracy} |")
    return [*lines, "", "Each round's PPO starts from the SFT model with that round's reward model.", ""]


def cli(args) -> int:
    cfg = load_pipeline(args.config, args.overrides)
    start = time.perf_counter()
    times = run_pipeline(cfg, force=args.force)
    out = Path(cfg.output_dir)
    report = out / "report.html"
    total = time.perf_counter() - start
    lines = [f"{stage}: {sec:.0f} s" for stage, sec in times.items()] + [f"total: {total:.0f} s"]
    timing = "\n".join(["", "## Time per stage", "", *(f"- {line}" for line in lines), ""])
    summary = out / "summary.md"
    if summary.is_file():
        atomic_write_text(summary, summary.read_text(encoding="utf-8") + timing)
        print("\n" + summary.read_text(encoding="utf-8"))
    print(f"report: {report}")
    return 0
