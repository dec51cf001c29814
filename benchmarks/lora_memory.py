"""Memory of Actor + Reference: (a) full actor + frozen reference copy vs (b) LoRA actor + shared reference.

    python benchmarks/lora_memory.py                      # SmolLM2-135M-Instruct
    python benchmarks/lora_memory.py "tiny:llama?hidden=256&layers=4"

Each setup runs in a fresh subprocess, so its RSS is its own. Reported per setup: bytes of the
distinct parameter/buffer tensors the two roles hold, RSS growth over the bare process, and peak
RSS. (b) should be about one model (plus the adapter), (a) about two.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys

DEFAULT_MODEL = "smollm2-135m-instruct"


def tensor_bytes(*modules) -> int:
    """Bytes of the distinct tensors (by storage) in ``modules``: shared weights counted once."""
    seen, total = set(), 0
    for module in modules:
        for t in list(module.parameters()) + list(module.buffers()):
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def run_setup(setup: str, name: str) -> dict:
    import torch

    from quartet.config import LoraConfig
    from quartet.models import apply_lora, count_parameters, load_causal_lm, make_reference

    torch.set_num_threads(1)
    start = rss_mb()
    actor, tok = load_causal_lm(name, cache=False)  # no in-process GGUF cache: it would be a third copy
    if setup == "lora":
        actor = apply_lora(actor, LoraConfig(enabled=True, r=16, alpha=32))
    reference = make_reference(actor, None)
    enc = tok(["The quick brown fox jumps over the lazy dog."], return_tensors="pt")
    reference.logits(enc["input_ids"], enc["attention_mask"])
    return {
        "setup": setup,
        "reference_shared": reference.shared,
        "weights_mb": tensor_bytes(actor, reference.model) / 2**20,
        "trainable_params": count_parameters(actor, trainable_only=True),
        "rss_growth_mb": rss_mb() - start,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main(argv: list[str]) -> None:
    if len(argv) == 3 and argv[0] == "--setup":
        print(json.dumps(run_setup(argv[1], argv[2])))
        return
    name = argv[0] if argv else DEFAULT_MODEL
    rows = []
    for setup in ("full", "lora"):
        out = subprocess.run(
            [sys.executable, __file__, "--setup", setup, name], check=True, capture_output=True, text=True
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"model: {name}")
    print(f"{'setup':38s} {'weights MB':>10s} {'RSS growth MB':>14s} {'peak RSS MB':>12s} {'trainable':>12s}")
    labels = {"full": "(a) actor + frozen reference copy", "lora": "(b) LoRA actor + adapter-off reference"}
    for r in rows:
        print(
            f"{labels[r['setup']]:38s} {r['weights_mb']:10.1f} {r['rss_growth_mb']:14.1f} "
            f"{r['peak_rss_mb']:12.1f} {r['trainable_params']:12,d}"
        )
    a, b = rows
    print(
        f"(b) / (a): weights {b['weights_mb'] / a['weights_mb']:.2f}, RSS growth {b['rss_growth_mb'] / a['rss_growth_mb']:.2f}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
