"""The parts of scripts/gpu_check.sh that are Python: the environment, one device's tiny runs, CPU-vs-GPU comparison,
and the summary.

    python scripts/gpu_check.py env                                 # JSON: versions, GPU, CPU
    QUARTET_DEVICE=cpu  python scripts/gpu_check.py runs --out A    # SFT, PPO (GAE) and GRPO on tiny models, fp32
    QUARTET_DEVICE=cuda python scripts/gpu_check.py runs --out B
    python scripts/gpu_check.py compare A B                         # same samples and metrics within the tolerance
    python scripts/gpu_check.py summary --out DIR                   # DIR/gpu_check.md and .json from the parts

The comparison, argued from the arithmetic (docs/gpu.md): both sides run fp32 with TF32 off (torch's default for
matmuls), so each product agrees to float32 rounding (~1e-7 relative per operation; cuBLAS sums in another order
than the CPU's kernels). Before the first update the weights are the same bits, so the first rollout's answers are
the same (a token can differ only where a row's uniform lies within rounding of a boundary of the cumulative
softmax, ~1e-6 per draw) and everything computed from them before the update (scores, KL, rollout statistics,
advantages, entropy) agrees to 1e-4 relative. From the first optimizer step on, an RL run's trajectory is not a
tolerance question: Adam's first steps are ~lr x sign(gradient), so a gradient at rounding level moves its weight by
a full step either way, and clip fractions and sampled tokens are discontinuous in the weights. Two CPU runs that
differ only in their thread count (another sum order) part the same way (docs/gpu.md). So later RL iterations are
reported, not held to a tolerance; their learning is held by the learning tests (`pytest -m gpu`). SFT has no
sampling and no discontinuous statistic: its whole trajectory is held to 1e-2 relative.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIRST_RTOL, LATER_RTOL, ATOL, SAME_ANSWERS = 1e-4, 1e-2, 1e-5, 0.99
"""an RL run's first-rollout metrics; SFT's whole trajectory (relative); absolute floor; share of identical answers
in an RL run's first rollout"""
UPDATE_STATS = ("policy/approx_kl", "policy/clipfrac", "policy/loss", "policy/ratio", "policy/kl_loss",
                "policy/grad_norm", "optim/", "value/")
"""an RL iteration's statistics of its update (after its first optimizer step): reported, not compared"""
SKIP = ("timing/", "memory/", "time", "throughput", "speed/", "tokens_per_s", "optim/lr_")


def env() -> dict:
    import accelerate
    import peft
    import tokenizers
    import torch
    import transformers

    import quartet
    from quartet.models.precision import compute_device, mixed_precision

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": transformers.__version__, "accelerate": accelerate.__version__, "peft": peft.__version__,
           "tokenizers": tokenizers.__version__, "quartet": getattr(quartet, "__version__", "?"),
           "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
           "compute_device": str(compute_device()), "mixed_precision_auto": mixed_precision("auto")}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, gpu_memory_gb=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}",
                   bf16=torch.cuda.is_bf16_supported(), tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            out["driver"] = smi.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return out


# --------------------------------------------------------------------------- one device's runs
def runs(out: Path) -> None:
    """SFT (memorise a fixed set), PPO with GAE and GRPO on tiny-target: the test suite's learning runs, fp32,
    written under `out` (each its own run dir, metrics.jsonl and samples.jsonl) with what they reached."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "trainers")]
    import torch
    from trainer_helpers import TINY, memorise_rows, write_jsonl

    from builders import tiny_ppo
    from quartet.config import SFTConfig, from_dict
    from quartet.models.precision import compute_device
    from quartet.trainers.ppo import train_ppo
    from quartet.trainers.sft import train_sft

    torch.set_num_threads(int(os.environ.get("GPU_CHECK_THREADS", "1")))  # another count: another sum order
    out.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(out / "demo.jsonl", memorise_rows())
    sft = train_sft(from_dict(SFTConfig, {
        "model": TINY, "data": {"path": str(data), "chat_template": False},
        "eval_data": {"path": str(data), "chat_template": False}, "output_dir": str(out / "sft"), "max_steps": 80,
        "batch_size": 8, "optim": {"lr": 1e-2, "warmup_steps": 5}, "eval_every": 1000, "log_every": 10,
        "precision": "fp32"}))
    reached = {"device": str(compute_device()),
               "sft": {"first_eval_loss": sft.first_eval_loss, "eval_loss": sft.eval_loss}}
    for name, overrides in (("ppo", ["iterations=12"]), ("grpo", ["iterations=12", "advantage=grpo", "critic=null",
                                                                   "samples_per_prompt=4"])):
        cfg = tiny_ppo(out, *overrides)
        cfg.output_dir = str(out / name)
        result = train_ppo(cfg, progress=False)
        rows = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
        reached[name] = {"first_score": rows[0].get("objective/score"), "last_score": rows[-1].get("objective/score"),
                         "iterations": len(rows), "model": str(result.model_dir)}
    (out / "reached.json").write_text(json.dumps(reached, indent=1))
    print(json.dumps(reached))


# --------------------------------------------------------------------------- comparison
def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _close(a: float, b: float, rtol: float) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return abs(a - b) <= ATOL + rtol * max(abs(a), abs(b))


def compare(a: Path, b: Path) -> dict:
    """Per stage: SFT's every logged row within LATER_RTOL; an RL run's first rollout (answers and the metrics computed
    from them before the update) within FIRST_RTOL; the later rows' worst gap and identical answers, reported."""
    report: dict = {"tolerance": {"first_rollout_rtol": FIRST_RTOL, "sft_rtol": LATER_RTOL, "atol": ATOL,
                                  "same_first_answers": SAME_ANSWERS}, "stages": {}, "ok": True}
    for stage in ("sft", "ppo", "grpo"):
        ma, mb = _rows(a / stage / "metrics.jsonl"), _rows(b / stage / "metrics.jsonl")
        entry = {"steps": [len(ma), len(mb)], "worst": [], "failures": []}
        if not ma or len(ma) != len(mb):
            entry["failures"].append(f"metrics rows differ: {len(ma)} vs {len(mb)}")
        for i, (ra, rb) in enumerate(zip(ma, mb)):
            worst = (0.0, "")
            for key in sorted(set(ra) & set(rb)):
                va, vb = ra[key], rb[key]
                if any(s in key for s in SKIP) or not isinstance(va, (int, float)) or isinstance(va, bool) \
                        or not isinstance(vb, (int, float)):
                    continue
                gap = abs(va - vb) / max(abs(va), abs(vb), 1e-12)
                if math.isfinite(gap) and gap > worst[0] and abs(va - vb) > ATOL:
                    worst = (gap, key)
                held = LATER_RTOL if stage == "sft" else FIRST_RTOL if i == 0 and not key.startswith(UPDATE_STATS) \
                    else None
                if held is not None and not _close(float(va), float(vb), held):
                    entry["failures"].append(f"row {i + 1} {key}: {va!r} vs {vb!r} (rtol {held:g})")
            entry["worst"].append({"row": i + 1, "rel_gap": worst[0], "key": worst[1]})
        sa, sb = _rows(a / stage / "samples.jsonl"), _rows(b / stage / "samples.jsonl")
        if sa or sb:
            pairs = [(x.get("response"), y.get("response")) for x, y in zip(sa, sb)]
            first = [(x.get("response"), y.get("response")) for x, y in zip(sa, sb) if x.get("step") == 1]
            same_first = sum(x == y for x, y in first) / max(len(first), 1)
            entry["answers"] = {"count": [len(sa), len(sb)], "same": sum(x == y for x, y in pairs) / max(len(pairs), 1),
                                "same_first_iteration": same_first}
            if len(sa) != len(sb) or not first or same_first < SAME_ANSWERS:
                entry["failures"].append(f"answers of the first rollout: {same_first:.4f} identical "
                                         f"(< {SAME_ANSWERS}) or counts differ")
        entry["ok"] = not entry["failures"]
        report["ok"] &= entry["ok"]
        report["stages"][stage] = entry
    return report


# --------------------------------------------------------------------------- summary
def summary(out: Path) -> dict:
    """gpu_check.json and gpu_check.md from the parts gpu_check.sh left in `out`."""
    import xml.etree.ElementTree as ET

    doc: dict = {}
    for name in ("env", "compare", "reached_cuda", "reached_cpu", "vs_trl"):
        path = out / f"{name}.json"
        try:
            doc[name] = json.loads(path.read_text()) if path.is_file() else None
        except json.JSONDecodeError as e:  # a step killed while writing it: say so, keep the rest
            doc[name] = None
            doc.setdefault("unreadable", []).append(f"{path.name}: {e}")
    junit = out / "junit.xml"
    if junit.is_file():
        root = ET.parse(junit).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        failed = [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
                  if c.find("failure") is not None or c.find("error") is not None]
        doc["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        doc["tests"]["time_s"] = float(suite.get("time", 0))
        doc["tests"]["failed"] = failed
    steps = out / "steps.txt"
    doc["steps"] = steps.read_text().splitlines() if steps.is_file() else []
    (out / "gpu_check.json").write_text(json.dumps(doc, indent=1))
    lines = ["# Quartet GPU check", ""]
    if doc["env"]:
        e = doc["env"]
        lines += [f"- machine: {e.get('gpu', 'no GPU')} ({e.get('gpu_memory_gb', '-')} GB, capability "
                  f"{e.get('capability', '-')}, driver {e.get('driver', '-')}), {e['cpu_count']} CPU cores",
                  f"- torch {e['torch']} (CUDA {e['cuda']}), transformers {e['transformers']}, accelerate "
                  f"{e['accelerate']}, peft {e['peft']}, Python {e['python']}; compute device {e['compute_device']},"
                  f" precision auto = {e['mixed_precision_auto']}"]
    for line in doc["steps"]:
        lines.append(f"- {line}")
    if doc.get("tests"):
        t = doc["tests"]
        lines += ["", f"## Device-sensitive tests (`pytest -m gpu`) on {doc['env'].get('compute_device') if doc['env'] else '?'}",
                  f"{t['tests']} tests: {t['tests'] - t['failures'] - t['errors'] - t['skipped']} passed, "
                  f"{t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped, {t['time_s']:.0f} s"]
        lines += [f"- FAILED {name}" for name in t["failed"][:40]]
    for dev in ("cuda", "cpu"):
        r = doc.get(f"reached_{dev}")
        if r:
            lines += ["", f"## Tiny runs on {r['device']}",
                      f"- SFT held-out loss {r['sft']['first_eval_loss']:.3f} -> {r['sft']['eval_loss']:.4f}"]
            for stage in ("ppo", "grpo"):
                lines.append(f"- {stage.upper()}: score {r[stage]['first_score']:.3f} -> {r[stage]['last_score']:.3f}"
                             f" over {r[stage]['iterations']} iterations")
    c = doc.get("compare")
    if c:
        tol = c["tolerance"]
        lines += ["", "## CPU vs GPU, the same fp32 runs",
                  f"held: SFT's every row within rtol {tol['sft_rtol']:g}; PPO's and GRPO's first rollout (answers >= "
                  f"{tol['same_first_answers']:.0%} identical, its pre-update metrics within rtol "
                  f"{tol['first_rollout_rtol']:g}); atol {tol['atol']:g}; later RL rows reported. Result: "
                  f"{'PASS' if c['ok'] else 'FAIL'}"]
        for stage, e in c["stages"].items():
            worst = max(e["worst"], key=lambda w: w["rel_gap"], default={"rel_gap": float('nan'), "key": "", "row": 0})
            first = e["worst"][0] if e["worst"] else {"rel_gap": float("nan"), "key": ""}
            ans = e.get("answers")
            lines.append(f"- {stage}: {e['steps'][0]} rows; row 1 worst gap {first['rel_gap']:.2e} ({first['key']}), "
                         f"overall {worst['rel_gap']:.2e} ({worst['key']}, row {worst['row']})"
                         + (f"; answers identical {ans['same']:.1%} (iteration 1: {ans['same_first_iteration']:.1%})"
                            if ans else "") + ("" if e["ok"] else f"; FAIL: {'; '.join(e['failures'][:3])}"))
    v = doc.get("vs_trl")
    if v:
        lines += ["", "## PPO, SmolLM2-135M-shaped (random weights), 16 prompts x 32 tokens, 4 epochs", "",
                  "| side | precision | s / iteration | generate | scoring | update | peak GPU GB | rollout tokens/s |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in v.get("rows", []):
            gpu = "-" if r.get("peak_gpu_mb") is None else f"{r['peak_gpu_mb'] / 1024:.2f}"
            lines.append(f"| {r['side']} | {r['precision']} | {r['total']:.3f} | {r['generate']:.3f} | "
                         f"{r['scoring']:.3f} | {r['update']:.3f} | {gpu} | {r['tokens_per_s']:.0f} |")
        if v.get("profile"):
            sys.path.insert(0, str(ROOT / "benchmarks"))
            from vs_trl import profile_table  # the benchmark's own rendering of its counts

            lines += ["", "One more iteration per Quartet side under torch.profiler (host waits: cudaStreamSynchronize "
                      "and kin; scalar reads: values read back to the host):", "", *profile_table(v["profile"])]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    return doc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("env")
    r = sub.add_parser("runs")
    r.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--json", default="")
    s = sub.add_parser("summary")
    s.add_argument("--out", required=True)
    args = p.parse_args()
    if args.cmd == "env":
        print(json.dumps(env(), indent=1))
    elif args.cmd == "runs":
        runs(Path(args.out))
    elif args.cmd == "compare":
        report = compare(Path(args.a), Path(args.b))
        text = json.dumps(report, indent=1)
        if args.json:
            Path(args.json).write_text(text)
        print(text)
        sys.exit(0 if report["ok"] else 1)
    else:
        summary(Path(args.out))
        print((Path(args.out) / "gpu_check.md").read_text())


if __name__ == "__main__":
    main()
