"""The evaluation's settings: `quartet eval`'s flags and `quartet run`'s eval section are one config.

What they mean, and how every checkpoint sees the same prompts, settings and random numbers, is told in
quartet.eval.evaluate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quartet.config.shared import JUDGE_TIMEOUT, LLMJudgeConfig
from quartet.config.validators import non_negative, number, positive, seed
from quartet.errors import ConfigError

ENGINES = ("hf", "vllm")
"""what can sample the evaluation's responses"""
SAMPLE_DTYPES = ("bf16", "fp32")
"""the dtypes a checkpoint can be sampled in ("auto" picks one by the hardware)"""


@dataclass
class EvalConfig:
    prompts: str = "task:positive-review/eval"
    """prompt set: any prompt file or `task:<name>/<split>`"""
    num_prompts: int | None = None
    """use the first N prompts"""
    gold: str | None = None
    """gold reward function spec; default: the task's judge for task prompts"""
    reward_model: str | None = None
    """reward model for the rm score"""
    relevance: str | None = "auto"
    """on-task judge spec for the relevance score; "auto": the task's `relevance` judge, else judge:relevance
    when the MiniLM package is installed; null: not measured"""
    reference: str | None = None
    """model the KL is measured against; default: the baseline"""
    baseline: str | None = None
    """checkpoint the others are compared with; default: the first"""
    max_new_tokens: int = 48
    """response length limit of the evaluation's samples"""
    temperature: float = 0.7
    """sampling temperature; 0 = greedy"""
    top_p: float = 1.0
    """nucleus sampling: only the most likely tokens whose mass reaches top_p are drawn (1 = the full softmax)"""
    seed: int = 0
    """sampling seed: each prompt's samples are seeded from it, the same for every checkpoint"""
    samples_per_prompt: int = 1
    """responses sampled per prompt, each from its own seed"""
    kl_samples_per_prompt: int | None = None
    """of each prompt's samples, the first N have their KL to the reference measured (a float32 forward of the
    checkpoint and one of the reference each, ~2.5x what sampling them costs on a CPU); null: all of them. The
    scores (gold, relevance, win rate) always use every sample"""
    max_prompt_tokens: int = 256
    """longer prompts keep their last tokens"""
    batch_size: int = 16
    """prompts decoded together (results do not depend on it; CPU decoding is memory-bound: a larger batch costs
    little more per step)"""
    sample_dtype: str = "auto"
    """"auto", "bf16" or "fp32" weights for sampling (auto: bf16 where the hardware has it); log-probs are
    always float32"""
    engine: str = "hf"
    """what samples the responses: "hf" (the exact inverse-CDF sampler, replayable here) or "vllm" (the vLLM
    extra, one engine for all checkpoints, their weights reloaded into it)"""
    judge_timeout: float | None = JUDGE_TIMEOUT
    """seconds one call of a user's `module:function` judge (gold, relevance) may take before eval stops with an
    error naming it; null = no bound, the function called on the main thread (quartet.judges.bounded)"""
    judge: str | None = None
    """`llm:<model>`: a judged win rate of each checkpoint against the baseline, every (prompt, sample) pair judged
    in both orders (ties half, a bootstrap CI over prompts); null: not measured"""
    llm_judge: LLMJudgeConfig = field(default_factory=LLMJudgeConfig)
    """how that judge judges: rubric, mode, local model or OpenAI-compatible server, verdict cache"""
    bad_cases: int = 32
    """prompts written to `<out>/bad_cases.jsonl` for the next round of feedback (`quartet label prompts.path=...`):
    the last checkpoint's lowest scores, its largest reward-model/gold disagreements and its regressions against
    the baseline, in turn (quartet.eval.bad_cases); 0 = none"""
    extra_tasks: list = field(default_factory=list)
    """built-in tasks every checkpoint is also evaluated on (each task's eval split, num_prompts of it, its gold
    judge; the same sampling): what training for one task cost on others, the alignment tax. Reported in eval.json
    under `tasks`, samples in `<out>/tasks/<task>/samples.jsonl`; e.g. [constraints, arithmetic]"""

    def validate(self, where: str | None = None) -> None:
        """`where`: the section's name in a pipeline config (`eval`), which prefixes each message."""

        def at(name: str) -> str:
            return f"{where}.{name}" if where else name

        # a NaN or an infinity fails these checks too (`nan < 0` is False)
        if self.num_prompts is not None:
            positive(self.num_prompts, at("num_prompts"))
        for name in ("max_new_tokens", "samples_per_prompt", "max_prompt_tokens", "batch_size"):
            positive(getattr(self, name), at(name))
        if self.kl_samples_per_prompt is not None:
            positive(self.kl_samples_per_prompt, at("kl_samples_per_prompt"))
            if self.kl_samples_per_prompt > self.samples_per_prompt:
                raise ConfigError(f"{at('kl_samples_per_prompt')}: {self.kl_samples_per_prompt} is more than the "
                                  f"{self.samples_per_prompt} samples_per_prompt drawn")
        non_negative(self.temperature, at("temperature"))  # 0 = greedy
        seed(self.seed, at("seed"))
        number(self.top_p, at("top_p"))
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"{at('top_p')}: must be in (0, 1], got {self.top_p}")
        if self.sample_dtype not in (*SAMPLE_DTYPES, "auto"):
            raise ConfigError(f"{at('sample_dtype')}: must be one of auto, {', '.join(SAMPLE_DTYPES)}, "
                              f"got {self.sample_dtype!r}")
        if self.engine not in ENGINES:
            raise ConfigError(f"{at('engine')}: must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.judge_timeout is not None:
            positive(self.judge_timeout, at("judge_timeout"))
        if self.judge is not None and (not isinstance(self.judge, str) or not self.judge.startswith("llm:")
                                       or not self.judge[len("llm:"):].strip()):
            raise ConfigError(f"{at('judge')}: must be llm:<model> (a model dir, a .gguf, smollm2-135m-instruct, "
                              f"or the server's model name), got {self.judge!r}")
        self.llm_judge.validate(at("llm_judge"))
        non_negative(self.bad_cases, at("bad_cases"))
        if not isinstance(self.extra_tasks, list) or not all(isinstance(t, str) and t for t in self.extra_tasks):
            raise ConfigError(f"{at('extra_tasks')}: must be a list of built-in task names, got {self.extra_tasks!r}")
        repeated = [t for i, t in enumerate(self.extra_tasks) if t in self.extra_tasks[:i]]
        if repeated:
            raise ConfigError(f"{at('extra_tasks')}: names {repeated[0]!r} twice")
