"""K samples per prompt (the label stage's sampling): the prompt's keys held once against repeated K times.

    .venv/bin/python benchmarks/k_samples.py --model runs/demo/sft/model              # the demo's label batches
    .venv/bin/python benchmarks/k_samples.py --model smollm2-135m-instruct --batches 4 --threads 2

The HF engine samples `--k` answers to each of `--prompts` prompts of the positive-review task (the demo's label
settings: T 1, 48 new tokens, generate calls of 384 answers), once with the K samples decoding on one copy of
their prompt's keys and values (models/sample_prefix.py) and once on transformers' cache repeated K times, the two
alternating batch by batch after a warm-up of each. Prints seconds per batch for each, and how many answers came
out token for token the same (the two differ by rounding only: a draw can flip where rounding moves a logit
across a sampling boundary, and the rest of that answer then differs). Then how far each is from float32: the
next-token distributions of 16 prompts x 4 samples over 6 decoding steps (fixed tokens fed: the engine's probe,
`HFEngine._forced_steps`), KL(float32 on the repeated cache || the engine's dtype on either cache) per token; the
shared cache should be as close as the repeated one. Run alone: it prints the threads it used.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=192, help="prompts of task:positive-review/train")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--batch", type=int, default=384, help="answers per generate call")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from quartet.algo import full_kl
    from quartet.config import DataConfig, GenerationConfig
    from quartet.data import encode_prompts, left_pad, load_prompts
    from quartet.models import load_causal_lm
    from quartet.rollout.engine import HFEngine
    from quartet.trainers import loop

    examples = load_prompts(DataConfig(path="task:positive-review/train", limit=args.prompts))
    model, tok = load_causal_lm(args.model, torch.float32)
    enc = encode_prompts(tok, examples, 256, "left", True)
    gen = GenerationConfig(max_new_tokens=args.new_tokens, batch_size=args.batch, temperature=1.0, top_p=1.0)
    engine = HFEngine(model, tok, gen, loop.generation_dtype("auto"))
    per_call = args.batch // args.k
    calls = [list(range(s, min(s + per_call, len(enc.input_ids)))) for s in range(0, len(enc.input_ids), per_call)]
    seconds = {True: [], False: []}
    same = total = 0
    tokens = {True: 0, False: 0}
    for n, chunk in enumerate([calls[0]] + calls):
        ids, mask = left_pad([enc.input_ids[i] for i in chunk], tok.pad_token_id)
        out = {}
        for share in (True, False) if n % 2 else (False, True):
            engine._prompt_sharing = None if share else False
            start = time.perf_counter()
            ro = engine.generate(ids, mask, seed=n, num_samples=args.k)
            if n:  # the first call of each is warm-up
                seconds[share].append(time.perf_counter() - start)
                tokens[share] += int(ro.response_mask.sum())
            if share and not engine._prompt_sharing:
                raise SystemExit("error: this model's decoding cannot share its prompts' keys (see the log)")
            out[share] = ro.responses
        if n:
            same += sum(a == b for a, b in zip(out[True], out[False]))
            total += len(out[True])
    dtype = str(engine.dtype).replace("torch.", "")
    print(f"{args.model}: {len(calls)} generate calls of {per_call} prompts x {args.k} answers, {args.new_tokens} "
          f"new tokens, {dtype}, {torch.get_num_threads()} threads")
    for share, name in ((False, "cache repeated K times"), (True, "prompt keys held once")):
        s = seconds[share]
        print(f"  {name:24s} {statistics.fmean(s):6.2f} s per call (min {min(s):.2f}, max {max(s):.2f}), "
              f"{tokens[share] / sum(s):7.0f} answer tokens/s, {sum(s):6.1f} s in all")
    print(f"  answers the same token for token: {same} of {total}")
    if engine.dtype != torch.float32:
        ids, mask = left_pad(enc.input_ids[:16], tok.pad_token_id)
        ref = HFEngine(model, tok, gen, torch.float32)
        steps = [torch.arange(ids.shape[0] * 4)] * 6  # 4 samples of each prompt, 6 steps of fixed tokens
        exact = ref._forced_steps(ids, mask, 4, False, steps).log_softmax(-1)
        for share, name in ((False, "cache repeated K times"), (True, "prompt keys held once")):
            got = engine._forced_steps(ids, mask, 4, share, steps).log_softmax(-1)
            kl = full_kl(exact, got).mean()
            print(f"  {name:24s} KL(float32 || {dtype}) {float(kl):.2e} nats per token")


if __name__ == "__main__":
    main()
