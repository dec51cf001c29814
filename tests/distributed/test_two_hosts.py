"""Two hosts over a real network interface: two Linux network namespaces joined by a veth pair (scripts/netns.sh),
each running `accelerate launch` as machine K of 2 with gloo on its veth (scripts/two_hosts.sh,
configs/accelerate/two_hosts_gloo.yaml). What they compute equals one process on the whole batch (the 2-process
tests' driver and checks); a host that dies or goes silent mid-iteration ends the other within a bound, with one
error line naming it; --resume on both hosts then gives the uninterrupted run's numbers; an absent or unreachable
main host is one error line within the rendezvous timeout. Needs root and iproute2, skipped with the reason
otherwise."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_processes import (
    CASES_DRIVER,
    POLICY_GRADIENT_ATOL,
    assert_policy_gradients_equal,
    assert_supervised_equal,
    write_cases,
)

from quartet.errors import ConfigError
from quartet.trainers import checkpoint as ckpt
from quartet.trainers.loop import process_group_timeout

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
NETNS, LAUNCH = ROOT / "scripts" / "netns.sh", ROOT / "scripts" / "two_hosts.sh"
MAIN = "10.231.0.1"  # host 0's veth address: the only rendezvous target, and the only other address either host has
DIST_TIMEOUT = 10
"""QUARTET_DIST_TIMEOUT of the silent-host run: how long a process waits in a collective for a silent peer (the
others run at torch's default, 30 min: a killed peer must not need it)"""
KILLED_BOUND = 15
"""seconds from a peer's death to the other host's exit: its next collective fails at once (measured 1.8-2 s, and
up to 4 s with the machine loaded several-fold)"""
RDZV_TIMEOUT = 120
"""QUARTET_RDZV_TIMEOUT of these runs: how long the hosts wait for each other at start (a loaded machine can take
many seconds to start one of them)"""
ABSENT_RDZV_TIMEOUT = 3
"""the same, where host 1 starts alone"""
OUTER = 300  # each launch's own bounds are seconds; this only keeps a regression from hanging the suite
PORTS = itertools.count(29600)  # a fresh port per launch: no launch meets another's leftover socket


def _netns(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(NETNS), *args], capture_output=True, text=True)


def _pids() -> set[int]:
    """The processes in the two namespaces."""
    return {int(pid) for k in (0, 1) for pid in subprocess.run(["ip", "netns", "pids", f"qhost{k}"],
                                                               capture_output=True, text=True).stdout.split()}


THEIRS: set[int] = set()
"""processes that were in the namespaces before these tests (namespaces a user made): never killed"""


def _end_all_processes() -> None:
    """Kill what the tests started in the two namespaces and is still there (a stopped host, a failed test's)."""
    for pid in _pids() - THEIRS:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def hosts():
    """The two namespaces, made for this module (and removed after it) unless they were up before."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_NET_ADMIN)")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2)")
    were_up = _netns("status").returncode == 0
    up = _netns("up")
    if up.returncode:
        _netns("down")
        pytest.skip(f"cannot make network namespaces here: {(up.stderr or up.stdout).strip()[-300:]}")
    THEIRS.update(_pids())
    try:
        for k in (0, 1):  # one route, to the pair's own /30: no default route, no other address reachable
            routes = subprocess.run(["ip", "-n", f"qhost{k}", "-4", "route", "show"], capture_output=True,
                                    text=True, check=True).stdout.strip().splitlines()
            assert [r.split()[:3] for r in routes] == [["10.231.0.0/30", "dev", f"qveth{k}"]], routes
        yield
    finally:
        _end_all_processes()
        if not were_up:
            _netns("down")


@dataclass
class Host:
    proc: subprocess.Popen
    log: Path
    ended: float | None = None

    @property
    def stderr(self) -> str:
        return self.log.read_text(errors="replace")


def launch(rank: int, port: int, cwd: Path, *args: str, **env: str) -> Host:
    """Host `rank`'s part of a two-host run of `args`, as a user starts it (scripts/two_hosts.sh), with `env` added
    to a clean environment (no fault, torch's timeouts)."""
    log = cwd / f"host{rank}.log"
    env = {**{k: v for k, v in os.environ.items() if k not in ("QUARTET_DIST_TIMEOUT", "QUARTET_TEST_FAULT")},
           "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, "PYTHONPATH": f"{HERE.parent / 'trainers'}{os.pathsep}"
           f"{HERE}", "QUARTET_RDZV_TIMEOUT": str(RDZV_TIMEOUT), **env}
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", str(LAUNCH), str(rank), str(port), *args], cwd=cwd, env=env,
                                stdout=f, stderr=subprocess.STDOUT)
    return Host(proc, log)


def both(cwd: Path, *args: str, wait_for: tuple[int, ...] = (0, 1), **env: str) -> list[Host]:
    """Both hosts' parts of one run; returns once the hosts in `wait_for` ended, each with the moment it did."""
    cwd.mkdir(parents=True, exist_ok=True)
    port = next(PORTS)
    hosts = [launch(k, port, cwd, *args, **env) for k in (0, 1)]
    deadline = time.time() + OUTER
    while any(hosts[k].ended is None for k in wait_for):
        for h in hosts:
            if h.ended is None and h.proc.poll() is not None:
                h.ended = time.time()
        assert time.time() < deadline, [h.stderr[-2000:] for h in hosts]
        time.sleep(0.05)
    return hosts


def assert_both_succeeded(launched: list[Host]) -> None:
    """Both hosts exited 0; otherwise each host's whole log goes to the test's captured output (an assertion message
    is cut, and the logs sit in a temporary folder that is gone once the suite ends), and the test fails."""
    codes = [h.proc.returncode for h in launched]
    if codes != [0, 0]:
        for k, h in enumerate(launched):
            print(f"===== host {k} exited {codes[k]}: {h.log} =====\n{h.stderr}")
        pytest.fail(f"the hosts exited {codes}: their whole logs are in the captured stdout")


def _veth_bytes() -> int:
    """Bytes host 0's veth sent and received so far."""
    out = subprocess.run(["ip", "-n", "qhost0", "-j", "-s", "link", "show", "qveth0"], capture_output=True,
                         text=True, check=True).stdout
    stats = json.loads(out)[0]["stats64"]
    return stats["rx"]["bytes"] + stats["tx"]["bytes"]


# ---------------------------------------------------------------------------- what two hosts compute
@pytest.fixture(scope="module")
def runs(hosts, one_process, tmp_path_factory) -> dict:
    """mp_driver's five cases (test_processes.CASES) on one process (16 prompts, 8 rows per step: conftest.py) and
    on two hosts (8 and 4 each, one launch), with what each host's launch was and the bytes host 0's veth carried."""
    root = tmp_path_factory.mktemp("two-hosts")
    spec, outs = write_cases(root)
    before = _veth_bytes()
    launched = both(root, str(CASES_DRIVER), str(spec))
    assert_both_succeeded(launched)
    return {1: one_process, 2: {name: torch.load(path) for name, path in outs.items()}, "veth_bytes":
            _veth_bytes() - before, "launch": [json.loads((root / f"launch-rank{k}.json").read_text()) for k in (0, 1)]}


def test_the_run_crossed_the_veth_and_nothing_else(runs):
    """Each host's process met the other at host 0's veth address, over gloo on its own veth (the only interface it
    has besides loopback, so the run's traffic, a few MB of experience and gradients, went through the pair)."""
    assert runs["launch"] == [{"MASTER_ADDR": MAIN, "GLOO_SOCKET_IFNAME": f"qveth{k}", "backend": "gloo",
                               "world_size": 2, "rank": k} for k in (0, 1)]
    assert runs["veth_bytes"] > 1_000_000


@pytest.mark.parametrize("case", ["ppo", "grpo", "grpo-dynamic"])
def test_two_hosts_equal_one_process_for_the_policy_gradient_trainer(runs, case):
    """PPO with GAE and a shared critic, GRPO, and GRPO with dynamic sampling: the same samples, scores, advantages
    and metrics in both iterations, and the weights after them, as the 2-process tests check on one machine."""
    assert_policy_gradients_equal(runs[1][case], runs[2][case], POLICY_GRADIENT_ATOL[case])


@pytest.mark.parametrize("case", ["sft", "rm"])
def test_two_hosts_equal_one_process_for_sft_and_the_reward_model(runs, case):
    assert_supervised_equal(runs[1][case], runs[2][case])


# ---------------------------------------------------------------------------- faults
PPO_ARGS = ["-m", "quartet.cli", "ppo", "policy=tiny:llama?hidden=32&layers=1&heads=4&vocab=260&seed=1",
            "reward=host_faults:faulty", "prompts.path=task:tiny-target/train", "prompts.max_prompt_tokens=32",
            "rollout_batch_size=8", "minibatch_size=8", "micro_batch_size=4", "ppo_epochs=2",
            "generation.max_new_tokens=6", "optim.lr=1e-2", "precision=fp32", "critic=shared", "save_every=1",
            "reward_norm=true", "adaptive_kl=true", "iterations=3", "output_dir=run"]


def _one_error(host: Host) -> str:
    """The single `error:` line of a host's quartet process, which exited 2 without a traceback (the launcher's own
    report of a failed worker follows it)."""
    log = host.stderr
    assert not re.search(r"^\[rank\d\]: Traceback", log, re.M), log[-3000:]
    assert "exitcode  : 2" in log, log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, log[-3000:]
    return errors[0]


def _steps(run: Path) -> dict[int, dict]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("timing/", "memory/", "time"))}
            for r in lines}


def test_a_host_killed_mid_iteration_ends_the_other_and_resume_gives_the_uninterrupted_run(hosts, tmp_path):
    """The main host's process is killed in iteration 2 (after its rollout, before the experience gather): host 1
    stops at its next collective, at once (the dead process's kernel closed the connection; no timeout is set, so
    torch's 30 min would show), with one line naming rank 0 at 10.231.0.1. The checkpoint of iteration 1 is intact
    and --resume on both hosts ends where the uninterrupted run ends: the same metrics, samples and weights, exactly
    (the same arithmetic in the same order)."""
    clean = both(tmp_path / "clean", *PPO_ARGS)
    assert_both_succeeded(clean)

    work = tmp_path / "killed"
    killed, survivor = both(work, *PPO_ARGS, QUARTET_TEST_FAULT="kill 0 2")
    assert killed.proc.returncode != 0 and "(SIGKILL)" in killed.stderr
    assert re.fullmatch(r"error: lost rank 0 \(at 10\.231\.0\.1\) of this 2-process run: its connection failed "
                        r"\(.*\): its process or host is gone\. Rank 1 stops too; what was saved is intact: start the "
                        r"run again on every host \(ppo, grpo, rloo: with --resume, from the newest checkpoint\)",
                        _one_error(survivor))
    assert survivor.proc.returncode != 0
    assert survivor.ended - float((work / "fault.time").read_text()) < KILLED_BOUND
    run = work / "run"
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["iter-1"] and sorted(_steps(run)) == [1]
    assert ckpt.read_checkpoint(ckpt.list_checkpoints(run)[-1], ["policy"])[1]["iteration"] == 1

    resumed = both(work, *PPO_ARGS, "--resume")
    assert_both_succeeded(resumed)
    a, b = clean[0].log.parent / "run", run
    assert _steps(a) == _steps(b) and sorted(_steps(b)) == [1, 2, 3]
    assert (a / "samples.jsonl").read_text() == (b / "samples.jsonl").read_text()
    wa, wb = load_file(str(a / "model" / "model.safetensors")), load_file(str(b / "model" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not list(b.rglob("*.tmp"))


def test_a_silent_host_ends_the_other_within_the_timeout(hosts, tmp_path):
    """Host 1's process stops answering in iteration 2 (SIGSTOP: its connections stay open, as when a host hangs or
    its network goes): host 0 stops after QUARTET_DIST_TIMEOUT, with one line naming rank 1. Host 1 never ends by
    itself; the fixture kills it."""
    survivor, _ = both(tmp_path, *PPO_ARGS, QUARTET_TEST_FAULT="stop 1 2", QUARTET_DIST_TIMEOUT=str(DIST_TIMEOUT),
                       wait_for=(0,))
    _end_all_processes()
    assert _one_error(survivor).startswith(f"error: lost rank 1 of this 2-process run: it did not answer within "
                                           f"{DIST_TIMEOUT} s (QUARTET_DIST_TIMEOUT): its host is silent or its "
                                           f"process stuck. Rank 0 stops too")
    waited = survivor.ended - float((tmp_path / "fault.time").read_text())
    assert DIST_TIMEOUT <= waited < DIST_TIMEOUT + 10, waited


@pytest.mark.parametrize("main_host", ["absent", "unreachable"])
def test_no_main_host_at_start_is_one_error_within_the_rendezvous_timeout(hosts, tmp_path, main_host):
    """Host 1 started alone (absent: nothing listens at 10.231.0.1), or with host 0's veth down (unreachable)."""
    if main_host == "unreachable":
        subprocess.run(["ip", "-n", "qhost0", "link", "set", "qveth0", "down"], check=True)
    try:
        start = time.time()
        host = launch(1, next(PORTS), tmp_path, *PPO_ARGS, QUARTET_RDZV_TIMEOUT=str(ABSENT_RDZV_TIMEOUT))
        host.proc.wait(timeout=OUTER)
        waited = time.time() - start
    finally:
        subprocess.run(["ip", "-n", "qhost0", "link", "set", "qveth0", "up"], check=True)
    assert host.proc.returncode == 2
    assert re.fullmatch(rf"error: host 1: the main host 10\.231\.0\.1:\d+ did not answer within "
                        rf"{ABSENT_RDZV_TIMEOUT} s \(QUARTET_RDZV_TIMEOUT\): start host 0 with the same port, and "
                        r"check that this host reaches its address\n", host.stderr)
    assert ABSENT_RDZV_TIMEOUT <= waited < ABSENT_RDZV_TIMEOUT + 5, waited


def test_the_process_group_timeout_is_checked(monkeypatch):
    monkeypatch.delenv("QUARTET_DIST_TIMEOUT", raising=False)
    assert process_group_timeout() is None  # torch's default
    monkeypatch.setenv("QUARTET_DIST_TIMEOUT", "2.5")
    assert process_group_timeout().total_seconds() == 2.5
    for bad in ("0", "-1", "ten", "inf", "nan", ""):
        monkeypatch.setenv("QUARTET_DIST_TIMEOUT", bad)
        with pytest.raises(ConfigError, match=f"^QUARTET_DIST_TIMEOUT: must be a number of seconds > 0, got '{bad}'$"):
            process_group_timeout()
