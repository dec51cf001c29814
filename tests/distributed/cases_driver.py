"""Run several of mp_driver's cases in one process (a launch starts in seconds; a tiny case runs in one), and write
what the launch was: the equivalence tests' sides (test_processes.CASES), on one process, on 2 processes of one
machine (test_processes.py) or on each of two hosts (test_two_hosts.py).

    cases_driver.py CASES.json    # [[stage, out.pt, [key=value, ...]], ...]: mp_driver.py's arguments, in order

Each case seeds itself, as it does alone. Each process writes launch-rank<R>.json beside CASES.json: the rendezvous
address, the interface gloo was told to use, the process group's backend and size.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mp_driver  # noqa: E402 (puts tests/ and tests/trainers on sys.path)

if __name__ == "__main__":
    torch.set_num_threads(1)
    cases = Path(sys.argv[1])
    for stage, out, overrides in json.loads(cases.read_text()):
        {"ppo": mp_driver.ppo, "sft": mp_driver.sft, "rm": mp_driver.rm}[stage](Path(out), overrides)
    dist = torch.distributed
    launch = {k: os.environ.get(k) for k in ("MASTER_ADDR", "GLOO_SOCKET_IFNAME")}
    if dist.is_initialized():
        launch |= {"backend": dist.get_backend(), "world_size": dist.get_world_size(), "rank": dist.get_rank()}
    (cases.parent / f"launch-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(launch))
    from quartet.cli import leave_process_group

    leave_process_group()
