"""1 process x 2 threads against 2 processes x 1 thread for a PPO iteration, and the communication share.

    python benchmarks/processes.py                     # tiny llama (hidden 256, 4 layers), 4 iterations
    python benchmarks/processes.py --model smollm2-135m-instruct --lora --iterations 3
    python benchmarks/processes.py --two-hosts         # also 2 hosts x 1 thread over a veth (root; scripts/netns.sh)

Both runs train on the same global batch (the 2-process run has half of it per process) with the same
seeds, so they sample the same responses. Printed per configuration: median seconds per iteration (the
first iteration is left out: it includes warm-up), rollout tokens/s, and for the 2-process run the
communication share: the experience gather (`timing/gather`) plus the measured cost of all-reducing the
trainable gradients once per optimizer step, over the iteration time. With --two-hosts, the same 2-process run
again with each process on its own host (network namespaces qhost0 and qhost1 joined by a veth pair,
scripts/two_hosts.sh), so the gather and the all-reduce cross a network interface instead of loopback. Run it
alone on the machine: two processes on two cores are slowed several-fold by any third busy process.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ALLREDUCE = r"""
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
n = int(sys.argv[1]); reps = int(sys.argv[2])
x = torch.zeros(n)
dist.all_reduce(x)
t = time.perf_counter()
for _ in range(reps):
    dist.all_reduce(x)
if dist.get_rank() == 0:
    print((time.perf_counter() - t) / reps)
dist.destroy_process_group()
"""


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


TWO_HOSTS = Path(__file__).resolve().parents[1] / "scripts" / "two_hosts.sh"
HOST_PORTS = itertools.count(29700 + os.getpid() % 100 * 10)


def _on_two_hosts(args: list[str], threads: int) -> subprocess.CompletedProcess:
    """`args` (a script or -m module and its arguments) run as a two-host launch: one process per host."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHON": sys.executable}
    port = str(next(HOST_PORTS))  # each launch its own: a new rendezvous never meets the last one's socket
    with tempfile.TemporaryDirectory() as tmp:
        logs = [(Path(tmp) / f"out{k}", Path(tmp) / f"err{k}") for k in (0, 1)]
        hosts = []
        for k, (out, err) in enumerate(logs):
            with open(out, "w") as o, open(err, "w") as e:
                hosts.append(subprocess.Popen(["bash", str(TWO_HOSTS), str(k), port, *args], env=env, stdout=o,
                                              stderr=e))
        codes = [h.wait() for h in hosts]
        failed = [err.read_text()[-3000:] for code, (_, err) in zip(codes, logs) if code]
        return subprocess.CompletedProcess(args, 1 if failed else 0, logs[0][0].read_text(), "\n".join(failed))


def _launch(processes: int, threads: int, args: list[str], hosts: bool = False) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    base = [sys.executable, "-m", "quartet.cli", "ppo"] if processes == 1 else [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--num_processes", str(processes),
        "--main_process_port", _port(), "-m", "quartet.cli", "ppo"]
    t = time.perf_counter()
    if hosts:
        proc = _on_two_hosts(["-m", "quartet.cli", "ppo", *args], threads)
    else:
        proc = subprocess.run([*base, *args], env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"error: run failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t


def _allreduce_seconds(numel: int, processes: int, hosts: bool = False) -> float:
    """Seconds for one gloo all-reduce of `numel` float32 values across `processes` local processes (with `hosts`:
    one process on each of the two hosts)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(ALLREDUCE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
           "--master_port", _port(), f.name, str(numel), "5"]
    out = _on_two_hosts([f.name, str(numel), "5"], 1) if hosts else subprocess.run(cmd, env=env, capture_output=True,
                                                                                   text=True)
    os.unlink(f.name)
    if out.returncode:
        sys.exit(f"error: all-reduce timing failed:\n{out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny:llama?hidden=256&layers=4&heads=4&vocab=260&seed=1")
    ap.add_argument("--reward", default=None, help="default: task:tiny-target for tiny models, task:positive-review else")
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--batch", type=int, default=16, help="global prompts per iteration")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--two-hosts", action="store_true",
                    help="also run the 2 processes on two hosts joined by a veth (needs `scripts/netns.sh up`)")
    a = ap.parse_args()
    if a.two_hosts and subprocess.run(["bash", str(TWO_HOSTS.with_name("netns.sh")), "status"],
                                      capture_output=True).returncode:
        sys.exit("error: --two-hosts runs on network namespaces qhost0 and qhost1: make them with "
                 "`scripts/netns.sh up` (as root)")
    tiny = a.model.startswith("tiny:")
    reward = a.reward or ("task:tiny-target" if tiny else "task:positive-review")
    prompts = "task:tiny-target/train" if tiny else "task:positive-review/train"
    root = Path(a.out or tempfile.mkdtemp(prefix="quartet-processes-"))
    import torch

    from quartet.models import load_causal_lm

    model, _ = load_causal_lm(a.model, torch.float32)
    if a.lora:
        from quartet.config import LoraConfig
        from quartet.models import apply_lora

        model = apply_lora(model, LoraConfig(enabled=True))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    del model

    rows = []
    for processes, threads, hosts in ((1, 2, False), (2, 1, False), *[(2, 1, True)] * a.two_hosts):
        out = root / f"p{processes}{'-hosts' if hosts else ''}"
        per = a.batch // processes
        args = [f"policy={a.model}", f"reward={reward}", f"prompts.path={prompts}", f"output_dir={out}",
                f"iterations={a.iterations}", f"rollout_batch_size={per}", f"minibatch_size={max(1, per // 2)}",
                f"micro_batch_size={max(1, per // 2)}", "ppo_epochs=2", f"generation.max_new_tokens={a.new_tokens}",
                f"generation.batch_size={per}", "critic=shared", f"lora.enabled={str(a.lora).lower()}"]
        wall = _launch(processes, threads, args, hosts)
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]
        it = statistics.median(r["timing/total"] for r in recs)
        gen = statistics.median(r["timing/generate"] for r in recs)
        tokens = statistics.median(r["rollout/length_mean"] for r in recs) * a.batch
        comm = None
        if processes > 1:
            steps = 2 * 2  # ppo_epochs x minibatches per iteration
            comm = statistics.median(r.get("timing/gather", 0.0) for r in recs) + steps * _allreduce_seconds(
                trainable, processes, hosts)
        rows.append((f"{processes} x {threads}{' (2 hosts, veth)' if hosts else ''}", it, tokens / gen, comm, wall))

    import platform

    bf16 = "AVX-512 BF16" if "avx512_bf16" in Path("/proc/cpuinfo").read_text() else "AVX2-only (no native bf16)"
    print(f"model {a.model}{' + LoRA' if a.lora else ''}, {a.batch} prompts x {a.new_tokens} new tokens, "
          f"ppo_epochs 2, 2 minibatches; {os.cpu_count()} cores, {bf16}, {platform.processor() or platform.machine()}")
    print(f"trainable parameters: {trainable:,}\n")
    print("| processes x threads | s / iteration | rollout tokens/s | communication share | wall (incl. start-up) |")
    print("|---|---|---|---|---|")
    for name, it, tps, comm, wall in rows:
        share = f"{comm / it:.1%} ({comm:.3f} s)" if comm is not None else "-"
        print(f"| {name} | {it:.2f} | {tps:.0f} | {share} | {wall:.0f} s |")


if __name__ == "__main__":
    main()
