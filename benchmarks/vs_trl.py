"""Quartet's PPO against TRL 1.12's PPOTrainer on the identical workload, with per-phase floors.

    python benchmarks/vs_trl.py --tiny                      # tiny:llama models both sides, seconds
    OMP_NUM_THREADS=2 python benchmarks/vs_trl.py --threads 2 --sequential   # SmolLM2-135M-Instruct x4
    python benchmarks/vs_trl.py --model .gpu/smollm2-shape --random-init --trl-python current   # a GPU machine

TRL 1.12.0 is the last TRL with PPO; it is installed into its own virtual environment (default
.venv-trl, built on first use with the pinned torch from constraints.txt), or `--trl-python` names an interpreter
that has it (`current`: this one; it inherits this environment, PYTHONPATH included). `--model` picks the policy
(any name `load_causal_lm` accepts); `--random-init` builds it instead from the config.json + tokenizer in the dir
`--model` names, with seeded random weights (scripts/gpu_assets.py writes SmolLM2-135M-Instruct's: the GGUF
package does not travel to a GPU machine; the timings depend on the shape, not on the weights). Both sides get:
the same policy dir (SmolLM2 dequantised once and saved with `quartet.models.save_model`), the same
tokenized prompts (16 per iteration, encoded once by Quartet's prompt encoder and handed to TRL as
`input_ids`), 32 new tokens with EOS ignored (every response is 32 tokens), temperature 1, 4 PPO
epochs, one minibatch of 16 (one micro-batch), lr 3e-6, kl_coef 0.05, vf_coef 0.1, and four real
models: policy, reference, a reward model and a value model, both made from the policy's backbone
with the same seeded scalar head (the value model starts from the reward model on both sides).

Sides: trl (all fp32; the ratios are against it), trl-bf16 (TRL's `bf16=True`: accelerate's bf16 autocast around
TRL's policy-and-value forward, i.e. the update; its generation, reference and reward forwards stay fp32. Under
transformers 5 the flag no longer reaches the Accelerator TRL makes, so this side sets ACCELERATE_MIXED_PRECISION=bf16
as transformers 4's TrainingArguments did; the table shows the precision TRL's Accelerator ran with), and trl-mb8
(the same minibatch of 16 in two micro-batches of 8: gradient_accumulation_steps 2); quartet separate critic,
full fine-tune, fp32 and auto (bf16 autocast where the CPU has it), each also with activation checkpointing
(`activation_checkpointing: selective` or `full`: less memory for more time), fp32 in micro-batches of 8 (the
same update, half the activations at a time) and fp32 without the shared prompt prefix (`share_prompt_prefix:
false`: every row's 24-token system prompt computed in every forward, as TRL does); quartet's own recipe: shared
value head + LoRA, auto. Each side runs in its own process, so peak RSS (getrusage) is that side's alone.
By default the processes run in lockstep, one iteration each in turn (A B C D A B C D ...), so
machine noise spreads over all sides; `--sequential` runs one side after the other instead (needed
when all sides do not fit in memory at once: SmolLM2 x4 needs ~10 GB per side).

Per side: one warm-up iteration, then the median of `--iterations` (3) of: s/iteration, rollout
tokens/s (16 x 32 / generate seconds), and the phases generate / scoring forwards / update, each
next to its floor on this CPU (or GPU): FLOPs (2 per parameter per token forward, 6 forward + backward,
4 for a frozen LoRA base) over the matmul rate measured here (fp32 or bf16 by the side's
precision; trl-bf16's update only), and for decoding also the bandwidth floor (the weights read once per
new token) over the measured memory bandwidth. Attention FLOPs are left out (T < 100 here: a few percent).
The floors count every row's tokens, as the workload is defined; on a CPU Quartet's forwards run the rows' shared
24-token system prompt once (models/prefix.py; `share_prompt_prefix: auto`), a quarter fewer tokens, so its scoring
and update can come in under them.

On a GPU (torch sees one; QUARTET_DEVICE=cpu keeps every side on the CPU) each side runs there: Quartet's trainers
and TRL's PPOTrainer place their models through accelerate. The default sides are then trl, q-separate-fp32,
q-separate-auto (bf16 autocast where the GPU has it) and q-separate-fp32-prefix (the shared prompt prefix, which
`auto` leaves off on a GPU; trl-bf16 on request); the machine rates are the GPU's (fp32
matmul with TF32 off, torch's default; bf16 matmul; a device-to-device copy for the bandwidth), every clock read
synchronizes the GPU first, and each side also reports its peak GPU memory (torch.cuda.max_memory_allocated) next
to its peak RSS. TRL's "other" is its gc.collect() and empty_cache() calls (the latter frees the GPU's cache).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TAG = "@@vs_trl "
SMOLLM2 = "smollm2-135m-instruct"
TINY = "tiny:llama?hidden=64&layers=2&heads=4"
TRL_PINS = ["trl==1.12.0", "transformers==5.23.0", "tokenizers==0.23.3", "datasets==5.2.0",
            "accelerate==1.15.0", "peft==0.21.2", "numpy==2.4.6", "safetensors", "psutil"]
SIDES = {
    "trl": {"label": "TRL 1.12: policy, reference, reward model, value model, all fp32", "trl": True},
    "trl-bf16": {"label": "TRL 1.12, bf16=True (autocast around the update's forward)", "trl": True, "bf16": True},
    "trl-mb8": {"label": "TRL 1.12, micro-batches of 8 (gradient_accumulation_steps 2)", "trl": True,
                "micro_batch_size": 8},
    "q-separate-fp32": {"label": "Quartet, separate critic, full fine-tune, fp32",
                        "critic": "separate", "lora": False, "precision": "fp32"},
    "q-separate-auto": {"label": "Quartet, separate critic, full fine-tune, auto (bf16 autocast)",
                        "critic": "separate", "lora": False, "precision": "auto"},
    "q-separate-auto-selective": {"label": "Quartet, separate critic, full fine-tune, auto, selective recompute",
                                  "critic": "separate", "lora": False, "precision": "auto",
                                  "activation_checkpointing": "selective"},
    "q-separate-auto-full": {"label": "Quartet, separate critic, full fine-tune, auto, full recompute",
                             "critic": "separate", "lora": False, "precision": "auto",
                             "activation_checkpointing": "full"},
    "q-separate-fp32-whole": {"label": "Quartet, separate critic, full fine-tune, fp32, no shared prompt prefix",
                              "critic": "separate", "lora": False, "precision": "fp32", "share_prompt_prefix": False},
    "q-separate-fp32-prefix": {"label": "Quartet, separate critic, full fine-tune, fp32, shared prompt prefix",
                               "critic": "separate", "lora": False, "precision": "fp32", "share_prompt_prefix": True},
    "q-separate-fp32-selective": {"label": "Quartet, separate critic, full fine-tune, fp32, selective recompute",
                                  "critic": "separate", "lora": False, "precision": "fp32",
                                  "activation_checkpointing": "selective"},
    "q-separate-fp32-full": {"label": "Quartet, separate critic, full fine-tune, fp32, full recompute",
                             "critic": "separate", "lora": False, "precision": "fp32", "activation_checkpointing": "full"},
    "q-separate-fp32-mb8": {"label": "Quartet, separate critic, full fine-tune, fp32, micro-batches of 8",
                            "critic": "separate", "lora": False, "precision": "fp32", "micro_batch_size": 8},
    "q-shared-lora": {"label": "Quartet, shared value head + LoRA, auto",
                      "critic": "shared", "lora": True, "precision": "auto"},
}
# the default on a CPU: every side as before trl-bf16 came (the -prefix side is what auto does there already)
CPU_SIDES = [s for s in SIDES if s not in ("trl-bf16", "q-separate-fp32-prefix")]
GPU_SIDES = ["trl", "q-separate-fp32", "q-separate-auto", "q-separate-fp32-prefix"]
BATCH, NEW_TOKENS, EPOCHS, LR, MAX_PROMPT = 16, 32, 4, 3e-6, 64
INIT_SEED = 43  # --random-init: the policy's weights


def emit(obj: dict) -> None:
    print(TAG + json.dumps(obj), flush=True)


def wait_go() -> None:
    line = sys.stdin.readline()
    if line.strip() != "go":
        sys.exit(0)  # parent gone or told us to stop


def rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def on_cuda() -> bool:
    """The sides run on the GPU: torch sees one and QUARTET_DEVICE does not say cpu. Quartet's rule
    (`quartet.models.precision.compute_device`), restated: TRL's side may run in .venv-trl, which lacks what
    `quartet.models` imports (gguf: not among TRL_PINS)."""
    import torch

    return os.environ.get("QUARTET_DEVICE", "auto") != "cpu" and torch.cuda.is_available()


_sync = None
"""torch.cuda.synchronize in a child on the GPU, where a kernel launch returns before the kernel has run"""


def clock() -> float:
    """time.perf_counter() once the GPU's queued work is done."""
    if _sync is not None:
        _sync()
    return time.perf_counter()


def device_stats() -> dict:
    """This process's device ("cpu" or the GPU's name), peak RSS and peak GPU memory (MB; None on the CPU)."""
    import torch

    out = {"device": "cpu", "rss_mb": rss_mb(), "peak_gpu_mb": None}
    if _sync is not None:
        out["device"] = torch.cuda.get_device_name()
        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


# --------------------------------------------------------------------------- machine rates
def machine_rates(threads: int) -> dict:
    """Measured fp32 and bf16 matmul GFLOP/s and memory bandwidth (GB/s) on this CPU, or on the GPU."""
    import torch

    torch.set_num_threads(threads)
    if on_cuda():
        return gpu_rates()
    out = {"device": "cpu"}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
        for _ in range(3):
            a @ b
        n, t = 0, time.perf_counter()
        while time.perf_counter() - t < 1.0:
            a @ b
            n += 1
        out[f"gflops_{name}"] = 2 * 1024**3 * n / (time.perf_counter() - t) / 1e9
    x = torch.ones(64 * 2**20)  # 256 MB, far past the caches
    for _ in range(2):
        x.sum()
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < 1.0:
        x.sum()
        n += 1
    out["gbps"] = x.numel() * 4 * n / (time.perf_counter() - t) / 1e9
    return out


def gpu_rates(size: int = 8192) -> dict:
    """fp32 (TF32 as torch has it: off by default) and bf16 matmul GFLOP/s on size^3, and device memory bandwidth
    (GB/s: bytes read + written by a 1 GiB device-to-device copy), each timed over ~1 s after warm-ups."""
    import torch

    def rate(fn, warmup: int = 3) -> float:  # calls per second
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        n, t = 0, time.perf_counter()
        while time.perf_counter() - t < 1.0:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            n += 5
        return n / (time.perf_counter() - t)

    def matmuls(dtype) -> float:
        a, b = (torch.randn(size, size, dtype=dtype, device="cuda") for _ in range(2))
        c = torch.empty_like(a)
        return rate(lambda: torch.matmul(a, b, out=c))

    out = {"device": torch.cuda.get_device_name(), "fp32_matmul_precision": torch.get_float32_matmul_precision(),
           "gflops_fp32": 2 * size**3 * matmuls(torch.float32) / 1e9,
           "gflops_bf16": 2 * size**3 * matmuls(torch.bfloat16) / 1e9}
    x = torch.ones(2**28, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    out["gbps"] = 2 * x.numel() * 4 * rate(lambda: y.copy_(x)) / 1e9
    return out


# --------------------------------------------------------------------------- shared inputs
def prepare(work: Path, model: str, random_init: bool = False) -> dict:
    """Policy dir, reward-model dir and prompts (text for Quartet, token ids for TRL), made once."""
    import torch

    from quartet.config import DataConfig
    from quartet.data import encode_prompts, load_prompts
    from quartet.models import load_causal_lm, load_reward_model, save_model, save_reward_model

    meta_file = work / "inputs.json"
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        if (meta["model"], meta.get("random_init", False)) != (model, random_init):
            raise SystemExit(f"error: {work} holds the inputs of {meta['model']} (random init: "
                             f"{meta.get('random_init', False)}); use another --work")
        return meta
    policy_dir, reward_dir = work / "policy", work / "reward"
    lm, tok = random_policy(model) if random_init else load_causal_lm(model)
    save_model(lm, tok, policy_dir)
    torch.manual_seed(44)  # the reward (and value) head
    rm = load_reward_model(str(policy_dir))
    save_reward_model(rm, reward_dir)
    examples = load_prompts(DataConfig(path="task:positive-review/train", limit=BATCH))
    prompts = [e.prompt for e in examples]
    (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    enc = encode_prompts(tok, prompts, MAX_PROMPT, "left", True, where="prompts")
    ids = [list(map(int, x)) for x in enc.input_ids]
    if len(ids) != BATCH or any(tok.pad_token_id in x for x in ids):
        raise SystemExit("error: prompts: need 16 prompts without the pad token (TRL masks every pad id)")
    meta = {
        "model": model, "random_init": random_init, "policy": str(policy_dir), "reward": str(reward_dir),
        "prompts": str(work / "prompts.jsonl"), "prompt_ids": ids, "pad": tok.pad_token_id,
        "params_lm": sum(p.numel() for p in lm.parameters()),
        "params_embedding": lm.get_input_embeddings().weight.numel(),
    }
    meta_file.write_text(json.dumps(meta))
    return meta


def random_policy(model_dir: str):
    """(model, tokenizer) shaped by `model_dir`'s config.json, with seeded random weights, prepared as
    `load_causal_lm` prepares a loaded one (its tokenizer from the same dir, pad kept)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from quartet.models import load_tokenizer
    from quartet.models.loading import prepare as prepare_loaded

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise SystemExit(f"error: --random-init: {model_dir} is not a dir with config.json "
                         "(write one with scripts/gpu_assets.py)")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    torch.manual_seed(INIT_SEED)
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if (path / "generation_config.json").is_file():
        lm.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    tok = load_tokenizer(str(path))
    prepare_loaded(lm, tok)
    return lm, tok


# --------------------------------------------------------------------------- Quartet side
def run_quartet(args, meta: dict, spec: dict) -> None:
    from quartet.allocator import huge_page_tensors, retain_freed_memory

    retain_freed_memory()  # first, as the CLI does: torch reads its huge-page switch at its first allocation
    import torch

    import quartet.trainers.experience
    import quartet.trainers.ppo
    from quartet.config import PPOConfig, from_dict
    from quartet.trainers.ppo import PPOTrainer

    torch.set_num_threads(args.threads)
    for module in (quartet.trainers.experience, quartet.trainers.ppo):  # their phase clocks: synchronized too
        module.time = _SyncedTime()
    out = Path(tempfile.mkdtemp(prefix="vs-trl-q-", dir=args.work))
    cfg = from_dict(PPOConfig, {
        "policy": meta["policy"], "reward": meta["reward"],
        "prompts": {"path": meta["prompts"], "max_prompt_tokens": MAX_PROMPT},
        "output_dir": str(out / "ppo"), "iterations": args.iterations + 1 + bool(args.profile),
        "rollout_batch_size": BATCH, "minibatch_size": BATCH, "micro_batch_size": spec.get("micro_batch_size", BATCH),
        "ppo_epochs": EPOCHS, "share_prompt_prefix": spec.get("share_prompt_prefix", "auto"),
        "generation": {"max_new_tokens": NEW_TOKENS, "batch_size": BATCH, "temperature": 1.0},
        "critic": spec["critic"], "lora": {"enabled": spec["lora"]}, "precision": spec["precision"],
        "activation_checkpointing": spec.get("activation_checkpointing", "none"),
        # TRL's PPO loop steps without clipping the gradient
        "optim": {"lr": LR, "adam_eps": 1e-5, "warmup_steps": 0, "max_grad_norm": None},
        "kl_coef": 0.05, "vf_coef": 0.1,
    })
    trainer = PPOTrainer(cfg, progress=False)
    trainer.experience.engine.generation_config.eos_token_id = None  # every response is 32 tokens
    emit({"ready": True, "precision": trainer.accelerator.mixed_precision or "no", **device_stats(),
          "huge_pages": huge_page_tensors()})
    for it in range(1, args.iterations + 2):
        wait_go()
        t = clock()
        m = trainer.step(it).metrics
        total = clock() - t
        tokens = BATCH * NEW_TOKENS
        scoring = m["timing/score"] + m["timing/forward"] + m["timing/reference"]
        emit({"iteration": it, "total": total, "generate": m["timing/generate"], "scoring": scoring,
              "score": m["timing/score"], "old_logprob_value": m["timing/forward"],
              "reference": m["timing/reference"], "update": m["timing/update"],
              "other": total - m["timing/generate"] - scoring - m["timing/update"],
              "tokens": tokens, **device_stats(), "kl": m["objective/kl"], "score_mean": m["objective/score"]})
    if args.profile:  # one more iteration, after the timed ones, under torch.profiler
        profile_step(trainer, args.iterations + 2, Path(args.profile), args.child)
    shutil.rmtree(out, ignore_errors=True)


SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
"""runtime calls that make the host wait for the GPU (cudaMemcpy: the blocking copy; cudaMemcpyAsync is counted
apart: from pageable memory, or followed by a stream synchronization when torch's copy is blocking)"""


def profile_step(trainer, iteration: int, folder: Path, side: str) -> None:
    """One step under torch.profiler (CPU, and CUDA on a GPU), with the update and the experience marked:
    writes `folder/<side>.txt` (the operators by device time and by host time) and `folder/<side>.json` (the
    update's wall time, the GPU's busy time inside it, its kernel launches, host waits, copies and scalar reads)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    def marked(fn, name):
        def wrapper(*a, **k):
            with record_function(name):
                return fn(*a, **k)
        return wrapper

    trainer._update = marked(trainer._update, "quartet::update")
    trainer.experience.make = marked(trainer.experience.make, "quartet::experience")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if _sync is not None else [])
    with profile(activities=activities) as prof:
        trainer.step(iteration)
        clock()
    events = prof.events()
    out = {}
    for phase in ("update", "experience"):
        marks = [e for e in events if e.name == f"quartet::{phase}"]
        if not marks:
            continue
        lo, hi = marks[0].time_range.start, marks[0].time_range.end
        inside = [e for e in events if lo <= e.time_range.start <= hi]
        host = [e for e in inside if e.device_type == torch.autograd.DeviceType.CPU]
        # the device's own work: the marks above also appear on the GPU's timeline, spanning the whole phase
        kernels = [e for e in inside if e.device_type != torch.autograd.DeviceType.CPU
                   and not e.name.startswith("quartet::")]
        names = collections.Counter(e.name for e in host)
        count = lambda wanted, names=names: sum(names[n] for n in wanted)  # noqa: E731
        out[phase] = {"wall_s": (hi - lo) / 1e6, "device_busy_s": sum(e.time_range.elapsed_us() for e in kernels) / 1e6,
                      "kernels": len(kernels), "launches": count(("cudaLaunchKernel", "cudaLaunchKernelExC")),
                      "host_waits": count(SYNCS), "async_copies": count(("cudaMemcpyAsync",)),
                      "scalar_reads": count(("aten::_local_scalar_dense",)),
                      "aten_ops": sum(v for n, v in names.items() if n.startswith("aten::"))}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{side}.json").write_text(json.dumps(out, indent=1))
    table = prof.key_averages()
    sections = [("host time", "self_cpu_time_total")]
    if _sync is not None:
        sections.insert(0, ("device time", "self_device_time_total"))
    with open(folder / f"{side}.txt", "w") as f:
        for title, key in sections:
            try:  # the counts above are written already: a table torch cannot sort does not fail the side
                text = table.table(sort_by=key, row_limit=30, max_name_column_width=60)
            except Exception as e:  # noqa: BLE001
                text = f"(no table: {type(e).__name__}: {e})"
            f.write(f"== {side}: operators by {title}\n{text}\n")


class _SyncedTime:
    """The `time` module, with a perf_counter that synchronizes the GPU first (see `clock`)."""

    perf_counter = staticmethod(clock)

    def __getattr__(self, name):
        return getattr(time, name)


# --------------------------------------------------------------------------- TRL side
def run_trl(args, meta: dict, spec: dict) -> None:
    import gc

    import torch
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if spec.get("bf16"):  # what TrainingArguments(bf16=True) told accelerate before transformers 5 (module docstring)
        os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"
    import trl.experimental.ppo.ppo_trainer as T
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    spent = {"generate": 0.0, "scoring": 0.0, "gc": 0.0}  # "gc": TRL's gc.collect() and empty_cache() calls

    def timed(fn, key_of):
        def wrapper(*a, **k):
            key = key_of(a)
            if not key:  # the update's own forwards: no synchronizing inside it
                return fn(*a, **k)
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += clock() - t
        return wrapper

    T.batch_generation = timed(T.batch_generation, lambda a: "generate")
    T.get_reward = timed(T.get_reward, lambda a: "scoring")
    # forward() on the policy-and-value wrapper is the update's; on a bare policy it is the reference
    T.forward = timed(T.forward, lambda a: None if type(a[0]).__name__ == "PolicyAndValueWrapper" else "scoring")

    class _GC:
        def __getattr__(self, name):
            return getattr(gc, name)

        def collect(self, *a):
            t = clock()
            try:
                return gc.collect(*a)
            finally:
                spent["gc"] += clock() - t

    T.gc = _GC()
    T.empty_cache = timed(T.empty_cache, lambda a: "gc")

    tok = AutoTokenizer.from_pretrained(meta["policy"])
    assert tok.pad_token_id == meta["pad"], (tok.pad_token_id, meta["pad"])
    policy = AutoModelForCausalLM.from_pretrained(meta["policy"], dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(meta["policy"], dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(meta["reward"], num_labels=1, dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(meta["reward"], num_labels=1, dtype=torch.float32)
    for m in (policy, ref, reward, value):
        m.config.pad_token_id = tok.pad_token_id
        bad = [n for n, p in m.named_parameters() if not p.is_floating_point() or p.dtype != torch.float32]
        assert not bad, bad
    data = Dataset.from_dict({"input_ids": meta["prompt_ids"]})
    out = Path(tempfile.mkdtemp(prefix="vs-trl-trl-", dir=args.work))
    micro = spec.get("micro_batch_size", BATCH)  # the minibatch of 16 in micro-batches of this many rows
    cfg = PPOConfig(
        output_dir=str(out), per_device_train_batch_size=micro, gradient_accumulation_steps=BATCH // micro,
        num_mini_batches=1,
        num_ppo_epochs=EPOCHS, response_length=NEW_TOKENS, total_episodes=BATCH * (args.iterations + 1),
        local_rollout_forward_batch_size=BATCH, learning_rate=LR, temperature=1.0, kl_coef=0.05, vf_coef=0.1,
        stop_token=None, missing_eos_penalty=None, num_sample_generations=0, report_to=[], save_strategy="no",
        logging_steps=1000, seed=0, use_cpu=not on_cuda(), bf16=bool(spec.get("bf16")), dataloader_num_workers=0,
    )
    state = {"it": 0, "t": 0.0, "last": {}}

    class Lockstep(TrainerCallback):
        def _begin(self):
            wait_go()
            spent.update(generate=0.0, scoring=0.0, gc=0.0)
            state["t"] = clock()

        def on_train_begin(self, a, s, c, **kw):
            self._begin()

        def on_log(self, a, s, c, logs=None, **kw):
            state["last"] = dict(logs or {})

        def on_step_end(self, a, s, c, **kw):
            state["it"] += 1
            total = clock() - state["t"]
            update = total - spent["generate"] - spent["scoring"] - spent["gc"]
            emit({"iteration": state["it"], "total": total, "generate": spent["generate"],
                  "scoring": spent["scoring"], "update": update, "gc": spent["gc"], "other": 0.0,
                  "tokens": BATCH * NEW_TOKENS, **device_stats(),
                  "kl": state["last"].get("objective/kl"), "score_mean": state["last"].get("objective/scores")})
            if state["it"] < args.iterations + 1:
                self._begin()

    trainer = PPOTrainer(args=cfg, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                         train_dataset=data, value_model=value, callbacks=[Lockstep()])
    cfg.logging_steps = 1  # after __init__: metrics of every step reach on_log (TRL logs before on_step_end)
    trainer.state.logging_steps = 1
    emit({"ready": True, "precision": trainer.accelerator.mixed_precision or "no", **device_stats()})
    trainer.train()
    shutil.rmtree(out, ignore_errors=True)


# --------------------------------------------------------------------------- parent
def trl_python(args) -> str:
    if args.trl_python:
        py = sys.executable if args.trl_python == "current" else args.trl_python
        if shutil.which(py) is None:
            raise SystemExit(f"error: --trl-python: {py} is not an executable")
        return py
    venv = Path(args.trl_venv)
    py = venv / "bin" / "python"
    stamp = venv / ".vs-trl-installed"
    if not stamp.is_file():
        print(f"building {venv} (TRL 1.12.0, torch from constraints.txt) ...", flush=True)
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(py), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt")]
        subprocess.run(pip + ["torch==2.13.0"], check=True)
        subprocess.run(pip + TRL_PINS, check=True)
        stamp.touch()
    return str(py)


def floors(meta: dict, side: str, spec: dict, rates: dict, precision: str) -> dict:
    """Seconds per phase at this machine's measured matmul rate / bandwidth (see the module docstring)."""
    n_lm = meta["params_lm"]  # tied embeddings: the output layer's matmul uses the embedding's weights
    n_body = n_lm - meta["params_embedding"]  # reward / value models: backbone + a 1-wide head
    tokens = sum(len(x) for x in meta["prompt_ids"]) + BATCH * NEW_TOKENS
    prompt_tokens = sum(len(x) for x in meta["prompt_ids"])
    bf16 = precision == "bf16"
    update_rate = rates["gflops_bf16" if bf16 else "gflops_fp32"] * 1e9
    bf16 = bf16 and not spec.get("trl")  # TRL's autocast wraps only the update's forward (module docstring)
    rate = rates["gflops_bf16" if bf16 else "gflops_fp32"] * 1e9
    bytes_per = 2 if bf16 else 4
    gen_flops = 2 * n_lm * (prompt_tokens + BATCH * NEW_TOKENS)
    gen_bw = NEW_TOKENS * n_lm * bytes_per / (rates["gbps"] * 1e9)
    # scoring: reference (LM) + reward model (body); + value model (body) for a separate critic; TRL's and the
    # floor's old log-probs come from the generation pass
    separate = spec.get("trl") or spec.get("critic") == "separate"
    score_flops = 2 * tokens * (n_lm + n_body * (2 if separate else 1))
    per_param = 4 if spec.get("lora") else 6  # a frozen base still back-propagates to its inputs
    update_flops = EPOCHS * tokens * (per_param * n_lm + (6 * n_body if separate else 0))
    return {"generate": max(gen_flops / rate, gen_bw), "scoring": score_flops / rate,
            "update": update_flops / update_rate,
            "generate_kind": "bandwidth" if gen_bw > gen_flops / rate else "flops"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=SMOLLM2, help="the policy: any name load_causal_lm accepts, or with "
                   "--random-init a dir with config.json + tokenizer (default: %(default)s)")
    p.add_argument("--tiny", action="store_true", help=f"shorthand for --model '{TINY}'")
    p.add_argument("--random-init", action="store_true",
                   help=f"build the policy from --model's config.json with random weights (seed {INIT_SEED})")
    p.add_argument("--sides", default="", help="comma-separated, of: " + ", ".join(SIDES) + "; default: all but "
                   f"trl-bf16 on a CPU, {','.join(GPU_SIDES)} on a GPU")
    p.add_argument("--iterations", type=int, default=3, help="timed iterations after one warm-up")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument("--sequential", action="store_true", help="one side after the other (less memory at once)")
    p.add_argument("--work", default="", help="where the shared model dirs go (default: a temp dir, removed)")
    p.add_argument("--trl-venv", default=str(ROOT / ".venv-trl"))
    p.add_argument("--trl-python", default="", help="run TRL's sides with this interpreter (with this environment, "
                   "PYTHONPATH included) instead of --trl-venv; `current`: this one")
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("--profile", default="", help="after the timed iterations, run one more of each Quartet side "
                   "under torch.profiler and write its operator tables and update/experience counts (kernels, "
                   "launches, host waits, copies) into this folder")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "src"))  # this repo's Quartet, in this process as in the sides (PYTHONPATH below)
    if args.child:
        if on_cuda():
            import torch

            global _sync
            _sync = torch.cuda.synchronize
        if args.child == "rates":
            emit(machine_rates(args.threads))
            return
        meta = json.loads((Path(args.work) / "inputs.json").read_text())
        if SIDES[args.child].get("trl"):
            run_trl(args, meta, SIDES[args.child])
        else:
            run_quartet(args, meta, SIDES[args.child])
        return

    cuda = on_cuda()
    sides = [s.strip() for s in args.sides.split(",") if s.strip()] or (GPU_SIDES if cuda else CPU_SIDES)
    model = TINY if args.tiny else args.model
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        raise SystemExit(f"error: --sides: unknown {unknown}; choose from {list(SIDES)}")
    keep = bool(args.work)
    work = Path(args.work) if keep else Path(tempfile.mkdtemp(prefix="vs-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    args.work = str(work)
    inherited = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TRL_EXPERIMENTAL_SILENCE": "1",
           "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(part for part in (str(ROOT / "src"), inherited) if part)}
    # TRL's own venv sees this repo's src only, as it always did; a --trl-python interpreter this environment
    trl_env = env if args.trl_python else {**env, "PYTHONPATH": str(ROOT / "src")}
    try:
        trl_py = trl_python(args) if any(SIDES[s].get("trl") for s in sides) else None
        rates = _rates(args, env, work)
        if cuda:
            print(f"machine: {rates['device']}; matmul fp32 {rates['gflops_fp32'] / 1e3:.1f} TFLOP/s (float32 "
                  f"matmul precision '{rates['fp32_matmul_precision']}'), bf16 {rates['gflops_bf16'] / 1e3:.0f} "
                  f"TFLOP/s; device memory copy {rates['gbps']:.0f} GB/s (read + write)", flush=True)
        else:
            print(f"machine: {_cpu()}, {args.threads} threads; matmul fp32 {rates['gflops_fp32']:.0f} GFLOP/s, "
                  f"bf16 {rates['gflops_bf16']:.0f} GFLOP/s; memory read {rates['gbps']:.1f} GB/s", flush=True)
        meta = prepare(work, model, args.random_init)
        lens = [len(x) for x in meta["prompt_ids"]]
        name = meta["model"] + (" (random weights)" if meta.get("random_init") else "")
        print(f"workload: {name} ({meta['params_lm'] / 1e6:.1f}M params) x4 roles; {BATCH} prompts of "
              f"{min(lens)}-{max(lens)} tokens x {NEW_TOKENS} new tokens (EOS ignored), {EPOCHS} epochs, one "
              f"minibatch of {BATCH}; {args.iterations} timed iterations after 1 warm-up; "
              f"{'sequential' if args.sequential else 'interleaved'}", flush=True)
        groups = [[s] for s in sides] if args.sequential else [sides]
        results = {}
        for group in groups:
            results.update(_run_group(group, args, env, trl_env, trl_py, work))
        rows = _report(results, meta, rates)
        profiles = _report_profiles(Path(args.profile), [s for s in sides if not SIDES[s].get("trl")]) \
            if args.profile else {}
        if args.json:
            Path(args.json).write_text(json.dumps({"rates": rates, "meta": {k: v for k, v in meta.items()
                                                                            if k != "prompt_ids"},
                                                   "rows": rows, "profile": profiles, "raw": results}, indent=1))
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def _rates(args, env: dict, work: Path) -> dict:
    """machine_rates, measured in a child process (no GPU memory or threads of the parent's while the sides run)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "rates", "--work", str(work),
           "--threads", str(args.threads)]
    with open(work / "rates.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=str(ROOT))
        rates = _read(proc, "rates", work)
        proc.wait()
    return rates


def _run_group(group, args, env, trl_env, trl_py, work: Path) -> dict:
    procs, logs = {}, {}
    for side in group:
        trl = SIDES[side].get("trl")
        cmd = [trl_py if trl else sys.executable, str(Path(__file__).resolve()), "--child", side, "--work", str(work),
               "--iterations", str(args.iterations), "--threads", str(args.threads)]
        if args.profile and not trl:
            cmd += ["--profile", str(Path(args.profile).resolve())]
        logs[side] = open(work / f"{side}.log", "w")
        procs[side] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logs[side],
                                       text=True, env=trl_env if trl else env, cwd=str(ROOT))
    results = {s: {"iterations": []} for s in group}
    try:
        for side in group:
            results[side].update(_read(procs[side], side, work))
        for _ in range(args.iterations + 1):
            for side in group:  # A B C ... A B C ...
                procs[side].stdin.write("go\n")
                procs[side].stdin.flush()
                r = _read(procs[side], side, work)
                results[side]["iterations"].append(r)
                print(f"  {side} iteration {r['iteration']}: {r['total']:.2f} s", flush=True)
        for side in group:
            procs[side].stdin.close()
            if procs[side].wait(timeout=600):
                raise SystemExit(f"error: side {side} failed; see {work / (side + '.log')}")
    finally:
        for side, proc in procs.items():
            if proc.poll() is None:
                proc.kill()
            logs[side].close()
    return results


def _read(proc, side: str, work: Path) -> dict:
    for line in proc.stdout:
        if line.startswith(TAG):
            return json.loads(line[len(TAG):])
    tail = (work / f"{side}.log").read_text()[-3000:]
    raise SystemExit(f"error: side {side} ended early:\n{tail}")


def _report(results: dict, meta: dict, rates: dict) -> list[dict]:
    rows = []
    for side, res in results.items():
        its = res["iterations"][1:]  # the first is warm-up
        med = {k: statistics.median(float(it.get(k) or 0.0) for it in its)
               for k in ("total", "generate", "scoring", "update", "gc", "other")}
        precision = {"no": "fp32"}.get(res.get("precision", "no"), res.get("precision"))
        gpu = [it["peak_gpu_mb"] for it in res["iterations"] if it.get("peak_gpu_mb") is not None]
        row = {"side": side, "label": SIDES[side]["label"], "precision": precision,
               "device": res["iterations"][-1].get("device", "cpu"),
               "peak_rss_mb": max(it["rss_mb"] for it in res["iterations"]),
               "peak_gpu_mb": max(gpu) if gpu else None,
               "tokens_per_s": BATCH * NEW_TOKENS / med["generate"], **med,
               "floor": floors(meta, side, SIDES[side], rates, precision),
               "kl_last": its[-1].get("kl"), "score_last": its[-1].get("score_mean")}
        rows.append(row)
    base = next((r for r in rows if r["side"] == "trl"), None)
    gpu = any(r["peak_gpu_mb"] is not None for r in rows)

    def vs(key, r):
        return f"{r[key] / base[key]:.2f}" if base and base[key] and r[key] is not None else "-"

    if gpu:
        print("\n| run | precision | device | s / iteration | vs TRL | peak GPU memory | vs TRL | peak RSS | vs TRL "
              "| rollout tokens/s |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    else:
        print("\n| run | s / iteration | vs TRL | peak RSS | vs TRL | rollout tokens/s |")
        print("|---|---|---|---|---|---|")
    for r in rows:
        rss = f"{r['peak_rss_mb'] / 1024:.2f} GB | {vs('peak_rss_mb', r)}"
        if gpu:
            mem = "-" if r["peak_gpu_mb"] is None else f"{r['peak_gpu_mb'] / 1024:.2f} GB"
            print(f"| {r['label']} | {r['precision']} | {r['device']} | {r['total']:.2f} | {vs('total', r)} | "
                  f"{mem} | {vs('peak_gpu_mb', r)} | {rss} | {r['tokens_per_s']:.0f} |")
        else:
            print(f"| {r['label']} | {r['total']:.2f} | {vs('total', r)} | {rss} | {r['tokens_per_s']:.0f} |")
    where = "this GPU" if gpu else "this CPU"
    print(f"\nper phase, median seconds per iteration (x = times the floor on {where} at the side's precision):")
    print("| run | generate (floor) | scoring forwards (floor) | update (floor) | other |")
    print("|---|---|---|---|---|")
    for r in rows:
        f = r["floor"]
        other = r["gc"] + r["other"]
        d = 4 if gpu else 2  # decimals: a GPU's floors are milliseconds
        print(f"| {r['side']} ({r['precision']}) | {r['generate']:.{d}f} ({f['generate']:.{d}f} {f['generate_kind']}, "
              f"{r['generate'] / f['generate']:.1f}x) | {r['scoring']:.{d}f} ({f['scoring']:.{d}f}, "
              f"{r['scoring'] / f['scoring']:.1f}x) | {r['update']:.{d}f} ({f['update']:.{d}f}, "
              f"{r['update'] / f['update']:.1f}x) | {other:.{d}f} |")
    for side, res in results.items():
        if not SIDES[side].get("trl"):
            its = res["iterations"][1:]
            parts = {k: statistics.median(it[k] for it in its) for k in ("score", "old_logprob_value", "reference")}
            print(f"{side} scoring split: reward model {parts['score']:.2f} s, old log-probs + values "
                  f"{parts['old_logprob_value']:.2f} s, reference {parts['reference']:.2f} s")
    return rows


def profile_table(profiles: dict) -> list[str]:
    """Markdown rows of profile_step's counts, {side: {phase: counts}} (also scripts/gpu_check.py's summary)."""
    keys = ("kernels", "launches", "host_waits", "async_copies", "scalar_reads", "aten_ops")
    lines = ["| run | phase | wall s | device busy s | " + " | ".join(k.replace("_", " ") for k in keys) + " |",
             "|---|---|---|---|" + "---|" * len(keys)]
    for side, phases in profiles.items():
        for phase, c in phases.items():
            lines.append(f"| {side} | {phase} | {c['wall_s']:.3f} | {c['device_busy_s']:.3f} | "
                         + " | ".join(str(c[k]) for k in keys) + " |")
    return lines


def _report_profiles(folder: Path, sides: list[str]) -> dict:
    """Print the profiled iteration's counts per Quartet side (profile_step's files in `folder`); returns them."""
    found = {side: json.loads((folder / f"{side}.json").read_text()) for side in sides
             if (folder / f"{side}.json").exists()}
    print(f"\nprofiled iteration (torch.profiler; tables in {folder}):", *profile_table(found), sep="\n")
    missing = [side for side in sides if side not in found]
    if missing:
        print(f"no profile from: {', '.join(missing)}")
    return found


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                flags = Path("/proc/cpuinfo").read_text()
                return name + (" (AVX-512 BF16)" if "avx512_bf16" in flags else " (no native bf16)")
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    main()
