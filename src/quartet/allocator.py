"""glibc's malloc told to keep the memory a training process frees, so that it is not faulted in again.

On CPU, torch takes every tensor from the C allocator. glibc serves blocks above a threshold (128 KB at start,
moving up to 32 MB) with a fresh `mmap` and returns them with `munmap`, and gives the top of its heap back to
the kernel once more than a threshold is free there. A training step frees and re-allocates gigabytes of
activations, gradients and logits, so every step pays a page fault (and the kernel's zeroing) on each 4 KB it
touches again: measured for SmolLM2-135M PPO (separate critic, 16 x 96 tokens, AVX-512 BF16 CPU, 2 threads):
350,000-470,000 faults per epoch (1.4-1.9 GB touched afresh), against 17,000 with the settings below once the
heap has grown to the step's size (from the third iteration), and 29-31 s instead of 31-33 s per 4-epoch update.

`retain_freed_memory()` sets what the field's launchers set with MALLOC_MMAP_MAX_ / MALLOC_TRIM_THRESHOLD_
(or by preloading jemalloc or tcmalloc): no `mmap` for tensors, no trimming of the heap. Freed memory stays
with the process for its next step, so the resident size stays at its peak rather than falling between phases;
the peak itself was the same (8.3-8.4 GB in the run above). A trim threshold of -1 means never trim
(mallopt(3)). It is process-wide and applied once, by the CLI and by every trainer's accelerator;
QUARTET_MALLOC=default leaves glibc as it is. Other C libraries (musl, macOS) are left alone.

With them, `huge_page_tensors()` turns on torch's own THP_MEM_ALLOC_ENABLE (tensors of 2 MB and more page-aligned
and advised onto transparent huge pages) for the process. Measured on the run above's workload in fp32 with
selective recompute (AVX-512 BF16 CPU, 2 threads, 4 iterations each, one run after the other): peak RSS 6.71-6.87
-> 6.28-6.38 GB at the same time per iteration (57-60 s without, 59-61 s with, within this machine's run-to-run
spread). Freed heap that glibc keeps is most of the peak above what is in use: a thread calling `malloc_trim`
every 0.1 s held the peak to 5.9 GB, for 20 s more per iteration. QUARTET_MALLOC=default, or
THP_MEM_ALLOC_ENABLE set by the user, leaves it as it is.
"""

from __future__ import annotations

import ctypes
import os
import sys

from quartet.errors import ConfigError

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h; a trim threshold of -1 turns trimming off (mallopt(3))
THP = "THP_MEM_ALLOC_ENABLE"  # torch's switch (c10's CPU allocator), read once, at its first allocation

_applied: bool | None = None
_huge: bool | None = None


def retain_freed_memory() -> bool:
    """Apply the settings above once per process; True when glibc took them."""
    global _applied
    if _applied is not None:
        return _applied
    mode = os.environ.get("QUARTET_MALLOC", "retain")
    if mode not in ("retain", "default"):
        raise ConfigError(f"QUARTET_MALLOC: must be retain or default, got {mode!r}")
    _applied = False
    if mode == "retain" and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6")
            if hasattr(libc, "gnu_get_libc_version"):  # glibc, not musl
                _applied = all(libc.mallopt(opt, value) == 1 for opt, value in
                               ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1)))
        except OSError:
            pass
        if _applied:
            huge_page_tensors()
    return _applied


def huge_page_tensors() -> bool:
    """Tensors of 2 MB and more page-aligned and on transparent huge pages (torch's THP_MEM_ALLOC_ENABLE=1, as
    PyTorch's CPU tuning guides set it), for this process only: the variable is set for torch's first allocation,
    which reads it, and removed again, so child processes do not inherit it. True when such tensors come out
    page-aligned afterwards; False (nothing changed) where torch had already allocated, and where the user set
    the variable, whose value then stands."""
    global _huge
    if _huge is not None:
        return _huge
    _huge = False
    if THP in os.environ or not sys.platform.startswith("linux"):
        return _huge
    os.environ[THP] = "1"
    try:
        import torch

        # blocks of 2 MB and more are page-aligned under it, 64-byte aligned otherwise (by chance 1 in 64 each)
        held = [torch.empty(n << 20, dtype=torch.uint8) for n in (2, 3, 4)]
        _huge = all(t.data_ptr() % 4096 == 0 for t in held)
    finally:
        del os.environ[THP]
    return _huge
