"""The reward the two-host fault tests name as `host_faults:faulty` (tests/distributed on PYTHONPATH)."""

import os
import signal
import time
from collections import Counter
from pathlib import Path

CALLS = [0]
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def faulty(prompts, responses):
    """The count of the response's most common character, as ppo_rewards:repeated_char. With QUARTET_TEST_FAULT=
    "KIND RANK CALL" in its environment, the process of rank RANK sends itself KIND at its CALLth call, after its
    rollout and before the experience gather: kill (SIGKILL: no handler runs, the kernel closes its sockets) is a
    process or host that died; stop (SIGSTOP: its sockets stay open, nothing answers) one that went silent. The
    moment is written to fault.time in the working directory first."""
    CALLS[0] += 1
    fault = os.environ.get("QUARTET_TEST_FAULT")
    if fault:
        kind, rank, call = fault.split()
        if os.environ.get("RANK") == rank and CALLS[0] == int(call):
            Path("fault.time").write_text(repr(time.time()))
            os.kill(os.getpid(), SIGNALS[kind])
    return [max(Counter(r).values()) / 12.0 if r else 0.0 for r in responses]
