"""quartet.allocator: memory a step frees is taken again without page faults (glibc only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# a step's worth of tensors (1 to 64 MB) filled and freed, six times: the faults of the last three rounds are what
# the setting removes. The first rounds grow the heap, and where the big blocks land varies from run to run: in 4 of
# 12 runs round 3 still faulted the 40 MB block in afresh, in none did a later round (2026-11-26)
PROBE = """
import json, resource, torch
from quartet.allocator import retain_freed_memory
applied = retain_freed_memory()
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    xs = [torch.empty(mb * 2**18, dtype=torch.float32).fill_(1.0) for mb in (1, 3, 8, 40, 2, 16, 64, 5)]
    del xs
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""
PAGES = (1 + 3 + 8 + 40 + 2 + 16 + 64 + 5) * 2**20 // 4096


def probe(mode: str) -> dict:
    env = {**os.environ, "QUARTET_MALLOC": mode}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"),
                    reason="glibc only")
def test_freed_memory_is_reused_without_page_faults():
    default, retain = probe("default"), probe("retain")
    assert not default["applied"] and retain["applied"]
    # glibc maps the large ones afresh and trims the heap: most pages fault again each round
    assert min(default["faults"][3:]) >= PAGES * 0.5
    assert max(retain["faults"][3:]) < PAGES * 0.05


def test_unknown_mode_is_a_config_error(monkeypatch):
    from quartet import allocator
    from quartet.errors import ConfigError

    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setenv("QUARTET_MALLOC", "jemalloc")
    with pytest.raises(ConfigError, match="QUARTET_MALLOC: must be retain or default"):
        allocator.retain_freed_memory()


HUGE = """
import json, os
from quartet.allocator import retain_freed_memory, huge_page_tensors
retain_freed_memory()
import torch
held = [torch.empty(n << 20, dtype=torch.uint8) for n in (2, 5, 9)]
print(json.dumps({"on": huge_page_tensors(), "aligned": all(t.data_ptr() % 4096 == 0 for t in held),
                  "env": os.environ.get("THP_MEM_ALLOC_ENABLE")}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"),
                    reason="glibc only")
@pytest.mark.parametrize("mode, user, on", [("retain", None, True), ("default", None, False), ("retain", "0", False)])
def test_tensors_are_page_aligned_for_huge_pages_unless_told_otherwise(mode, user, on):
    """torch's THP_MEM_ALLOC_ENABLE, set for this process only (the variable is gone afterwards, so child processes
    do not inherit it); QUARTET_MALLOC=default, or the user's own value of the variable, leaves torch as it is."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    env.update({"QUARTET_MALLOC": mode, **({"THP_MEM_ALLOC_ENABLE": user} if user is not None else {})})
    out = subprocess.run([sys.executable, "-c", HUGE], env=env, capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.splitlines()[-1])
    assert got == {"on": on, "aligned": on, "env": user}


def test_huge_pages_are_left_alone_once_torch_has_allocated():
    """c10 reads the variable at its first allocation: after that, setting it changes nothing, and it says so."""
    code = ("import torch; x = torch.ones(3); from quartet.allocator import huge_page_tensors; "
            "print(huge_page_tensors(), torch.empty(3 << 20, dtype=torch.uint8).data_ptr() % 4096 == 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
