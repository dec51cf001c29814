"""Print the CPU kind this machine is, the way the project names it in every measurement and CI note.

AVX-512 BF16 machines multiply bf16 natively; AVX2-only machines emulate it (and run `precision: auto` in fp32).
Torch's own kernel level is printed too, so a run held to AVX2 by ATEN_CPU_CAPABILITY on an AVX-512 CPU says so:
that is an emulation of the instruction set, not an AVX2-only machine.
"""

from __future__ import annotations

import os
import platform


def cpu_kind() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info = f.read()
    except OSError:
        return f"unknown ({platform.machine()}: no /proc/cpuinfo)"
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        kind = "AVX-512 BF16"
    elif "avx2" in flags:
        kind = "AVX2-only (no avx512_bf16)"
    else:
        kind = "neither AVX-512 BF16 nor AVX2"
    return f"{kind}; {model}; {os.cpu_count()} cores"


def main() -> None:
    line = f"CPU kind: {cpu_kind()}"
    try:
        import torch

        line += f"; torch kernels: {torch.backends.cpu.get_cpu_capability()}"
    except ImportError:
        pass
    held = [f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                                             "QUARTET_CPU_BF16") if k in os.environ]
    if held:
        line += f"; held by {' '.join(held)} (an emulation, not that kind of machine)"
    print(line, flush=True)


if __name__ == "__main__":
    main()
