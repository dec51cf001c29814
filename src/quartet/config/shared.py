"""The sub-configs several stages share (LoRA, data, optimizer, generation, tracking) and their defaults."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Literal

from quartet.config.validators import in_range, non_negative, positive
from quartet.errors import ConfigError

Precision = Literal["auto", "fp32", "bf16", "fp16"]

JUDGE_TIMEOUT = 600.0
"""seconds one call of a user's reward or judge callable may take (the configs' `judge_timeout` default)"""


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
        positive(self.r, f"{where}.r")
        positive(self.alpha, f"{where}.alpha")
        in_range(self.dropout, 0.0, 1.0, f"{where}.dropout")
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
            positive(self.limit, f"{where}.limit")
        positive(self.max_prompt_tokens, f"{where}.max_prompt_tokens")
        positive(self.max_line_mb, f"{where}.max_line_mb")
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
            positive(self.lr, f"{where}.lr")
        non_negative(self.weight_decay, f"{where}.weight_decay")
        positive(self.adam_eps, f"{where}.adam_eps")
        non_negative(self.warmup_steps, f"{where}.warmup_steps")
        if self.max_grad_norm is not None:
            positive(self.max_grad_norm, f"{where}.max_grad_norm")


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
        positive(self.max_new_tokens, f"{where}.max_new_tokens")
        positive(self.temperature, f"{where}.temperature")
        in_range(self.top_p, 1e-6, 1.0, f"{where}.top_p")
        non_negative(self.top_k, f"{where}.top_k")
        positive(self.batch_size, f"{where}.batch_size")


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



LLM_JUDGE_MODES = ("pairwise", "pointwise")
LLM_JUDGE_BACKENDS = ("auto", "local", "openai")
LLM_JUDGE_ORDERS = ("agree", "average")
LLM_JUDGE_DTYPES = ("auto", "bf16", "fp32")


@dataclass
class LLMJudgeConfig:
    """How an `llm:<model>` judge reads answers (quartet.judges.llm): its principles, its question, where it runs."""

    rubric: str | None = None
    """the principles answers are judged by: the text itself, or the path of a .txt/.md file of them (one
    principle per line); null = the task's own rubric, else a generic one (helpful, honest, harmless, on-topic,
    concise)"""
    mode: Literal["pairwise", "pointwise"] = "pairwise"
    """pairwise: "which answer is better, A or B?" (log-odds of the two letters); pointwise: each answer rated 1-9
    alone (the expected rating), a pair compared by the difference"""
    orders: Literal["agree", "average"] = "agree"
    """how a pair's two verdicts (each order of the answers) make one: agree = a winner only when both orders pick
    the same answer, else a tie; average = the two orders' log-odds averaged (RLAIF, Lee et al. 2023), a winner
    when they lean either way: a judge that mostly picks one position then still ranks by what is left"""
    backend: Literal["auto", "local", "openai"] = "auto"
    """local: the model loaded here (a dir, a .gguf, smollm2-135m-instruct, tiny:...); openai: an OpenAI-compatible
    server at base_url (vllm serve, llama.cpp's server, Ollama); auto: openai when base_url is set, else local"""
    base_url: str | None = None
    """the server's API root, e.g. http://127.0.0.1:8000/v1 (the openai backend only)"""
    api_key_env: str = "OPENAI_API_KEY"
    """name of the environment variable holding the server's key (may be unset for a local server); the key itself
    is never written in a config"""
    timeout: float = 60.0
    """seconds one HTTP request may take before it is retried"""
    max_retries: int = 5
    """retries of a request that failed with 429, a 5xx or a dropped connection (exponential backoff with jitter,
    Retry-After honoured); then the stage stops with an error"""
    max_in_flight: int = 8
    """HTTP requests sent at once"""
    batch_size: int = 16
    """local backend: pairs (pointwise: answers) in one forward"""
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """local backend: the judge model's weights and compute (log-probs are taken in fp32 either way); auto = bf16
    where the hardware computes it natively (a GPU, a CPU with AVX-512 BF16 or AMX), else fp32. Part of the
    judge's name, so fp32 and bf16 verdicts are never read back as each other's"""
    cache: str | None = "auto"
    """SQLite file of the verdicts, so a rerun or a resume pays for none twice: "auto" = verdicts.sqlite in the stage's
    output folder; a path; null = no cache"""

    def validate(self, where: str) -> None:
        if self.mode not in LLM_JUDGE_MODES:
            raise ConfigError(f"{where}.mode: must be one of {', '.join(LLM_JUDGE_MODES)}, got {self.mode!r}")
        if self.backend not in LLM_JUDGE_BACKENDS:
            raise ConfigError(f"{where}.backend: must be one of {', '.join(LLM_JUDGE_BACKENDS)}, "
                              f"got {self.backend!r}")
        if self.orders not in LLM_JUDGE_ORDERS:
            raise ConfigError(f"{where}.orders: must be one of {', '.join(LLM_JUDGE_ORDERS)}, got {self.orders!r}")
        if self.dtype not in LLM_JUDGE_DTYPES:
            raise ConfigError(f"{where}.dtype: must be one of {', '.join(LLM_JUDGE_DTYPES)}, got {self.dtype!r}")
        if self.rubric is not None and (not isinstance(self.rubric, str) or not self.rubric.strip()):
            raise ConfigError(f"{where}.rubric: must be the principles' text or a file path (null: the task's "
                              f"own), got {self.rubric!r}")
        if self.base_url is not None:
            if not isinstance(self.base_url, str) or not self.base_url.startswith(("http://", "https://")):
                raise ConfigError(f"{where}.base_url: must be an http:// or https:// URL (e.g. "
                                  f"http://127.0.0.1:8000/v1), got {self.base_url!r}")
            if self.backend == "local":
                raise ConfigError(f"{where}.base_url: is set but backend is local (the model is loaded here); "
                                  f"remove base_url or set backend: openai")
        elif self.backend == "openai":
            raise ConfigError(f"{where}.base_url: the openai backend needs the server's URL (e.g. "
                              f"http://127.0.0.1:8000/v1)")
        if not isinstance(self.api_key_env, str) or not self.api_key_env.isidentifier():
            raise ConfigError(f"{where}.api_key_env: must be the name of an environment variable (e.g. "
                              f"OPENAI_API_KEY), got {self.api_key_env!r}")
        positive(self.timeout, f"{where}.timeout")
        non_negative(self.max_retries, f"{where}.max_retries")
        positive(self.max_in_flight, f"{where}.max_in_flight")
        positive(self.batch_size, f"{where}.batch_size")
        if self.cache is not None and (not isinstance(self.cache, str) or not self.cache.strip()):
            raise ConfigError(f"{where}.cache: must be \"auto\", a file path or null, got {self.cache!r}")

    @property
    def resolved_backend(self) -> str:
        """"local" or "openai" (auto: openai when base_url is set, else local)."""
        if self.backend != "auto":
            return self.backend
        return "openai" if self.base_url else "local"
