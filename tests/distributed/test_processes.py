"""N processes compute what one process computes: 2 processes x 8 prompts against 1 process x 16 prompts,
launched for real (accelerate launch, gloo on CPU), for PPO, GRPO (also with dynamic sampling), SFT and the
reward model; and whole 2-process runs of the CLI: one metrics line per step, checkpoints that load, resume,
stop_on."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from equivalence import update_atol

HERE = Path(__file__).parent
DRIVER = HERE / "mp_driver.py"
TINY = "tiny:llama?hidden=32&layers=1&heads=4&vocab=260&seed=1"
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no"]


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run(n: int, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent / "trainers")}
    if n == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [*ACCELERATE, "--num_processes", str(n), "--main_process_port", _port(), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def one_vs_two(tmp_path: Path, stage: str, *overrides: str) -> tuple[dict, dict]:
    out = []
    for n in (1, 2):
        path = tmp_path / f"p{n}" / "out.pt"
        path.parent.mkdir()
        run(n, str(DRIVER), stage, str(path), *overrides)
        out.append(torch.load(path))
    return out[0], out[1]


# mp_driver runs AdamW in its linear regime (tests/equivalence.py argues these): PPO 2 iterations x 2 epochs x 2
# minibatches = 8 steps, SFT and the reward model 2 steps, all at lr 1e-2
PPO_WEIGHTS_ATOL = update_atol(steps=8, lr=1e-2)
# GRPO's 4 samples per prompt: 64 sequences an iteration, 8 minibatches of 8, so 2 x 2 x 8 = 32 steps
GRPO_WEIGHTS_ATOL = update_atol(steps=32, lr=1e-2)
SUPERVISED_WEIGHTS_ATOL = update_atol(steps=2, lr=1e-2)


def _assert_weights_close(a: dict, b: dict, atol: float, start: dict | None = None) -> None:
    """The two runs' weights within `atol`; with the start, the largest step is >= 20x that (so a wrong one fails)."""
    assert set(a) == set(b)
    if start is not None:
        assert max(float((a[n].float() - start[n].float()).abs().max()) for n in a) >= 20 * atol
    for name, w in a.items():
        torch.testing.assert_close(w.float(), b[name].float(), rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def _close_metrics(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        # clip fractions count tokens on either side of a threshold: a 1e-7 difference may move one token. The
        # rest are token means (METRIC_TOL of their scale), the second iteration's after steps <= PPO_WEIGHTS_ATOL
        # apart, whose effect on a mean of log-probs and values of scale <= 10 is <= 10 x 2.2e-5: 1e-4 bounds both
        tol = 0.02 if "clipfrac" in k else 1e-4 * max(1.0, abs(a[k]))
        assert abs(a[k] - b[k]) <= tol, (k, a[k], b[k])


# GRPO as its preset runs it (KL as a k3 loss term). With the KL in the reward instead, a group whose scores
# tie is left with sequence returns that differ only by float noise in the KL, which the std division then
# blows up to O(1): a property of std-normalised advantages, not of the process split.
GRPO = ("advantage=grpo", "critic=none", "samples_per_prompt=4", "kl_in_reward=false", "kl_estimator=k3")
# has_digit pays 1 for a response with a digit, else 0: of the untrained tiny model's 8-token answers some groups
# hold none (or all), so they are flat, dropped, and a second round is sampled (the test asserts it)
GRPO_DYNAMIC = (*GRPO, "reward=ppo_rewards:has_digit", "dynamic_sampling=true")
CASES = {"ppo": ("ppo", ()), "grpo": ("ppo", GRPO), "grpo-dynamic": ("ppo", GRPO_DYNAMIC), "sft": ("sft", ()),
         "rm": ("rm", ())}
"""mp_driver's equivalence cases, all in one launch per side (cases_driver.py; rm last: it sets reward.CHUNK_ROWS).
A launch starts in seconds and a case runs in one: 2 launches instead of 10. The one-process side is made once per
session (conftest.py) and also checks two hosts (test_two_hosts.py)."""
CASES_DRIVER = HERE / "cases_driver.py"


def write_cases(root: Path) -> tuple[Path, dict[str, Path]]:
    """cases_driver.py's spec for CASES under `root`, and where each case's output will be."""
    outs = {name: root / name / "out.pt" for name in CASES}
    for path in outs.values():
        path.parent.mkdir(parents=True)
    spec = root / "cases.json"
    spec.write_text(json.dumps([[stage, str(outs[name]), list(overrides)] for name, (stage, overrides) in
                                CASES.items()]))
    return spec, outs


def run_cases(n: int, root: Path) -> dict[str, dict]:
    spec, outs = write_cases(root)
    run(n, str(CASES_DRIVER), str(spec))
    return {name: torch.load(path) for name, path in outs.items()}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict[str, dict]:
    return run_cases(2, tmp_path_factory.mktemp("two-processes"))


def assert_policy_gradients_equal(a: dict, b: dict, atol: float = PPO_WEIGHTS_ATOL) -> None:
    """mp_driver's ppo outputs, one process (a) against N (b); test_two_hosts.py checks two hosts with it."""
    for it in range(2):  # two iterations: the second starts from the first's update
        assert torch.equal(a["response_ids"][it], b["response_ids"][it])  # the same samples
        assert torch.allclose(a["scores"][it], b["scores"][it], atol=1e-6)  # normalised over the whole batch
        assert torch.allclose(a["advantages"][it], b["advantages"][it], atol=1e-5)  # whitened over the whole batch
        _close_metrics(a["metrics"][it], b["metrics"][it])
    _assert_weights_close(a["weights"], b["weights"], atol, a["start"])


POLICY_GRADIENT_ATOL = {"ppo": PPO_WEIGHTS_ATOL, "grpo": GRPO_WEIGHTS_ATOL, "grpo-dynamic": GRPO_WEIGHTS_ATOL}
"""each policy-gradient case's weight tolerance, by its number of optimizer steps"""


@pytest.mark.parametrize("case", ["ppo", "grpo"])
def test_two_processes_equal_one_for_the_policy_gradient_trainer(one_process, two_processes, case):
    assert_policy_gradients_equal(one_process[case], two_processes[case], POLICY_GRADIENT_ATOL[case])


def test_two_processes_equal_one_with_dynamic_sampling(one_process, two_processes):
    """DAPO's dynamic sampling (experience.py `_fill`): the processes choose from every process's groups, so they
    sample as many rounds, drop the same groups and train on the batch one process trains on."""
    a, b = one_process["grpo-dynamic"], two_processes["grpo-dynamic"]
    keys = ("rollout/dropped_groups", "rollout/sampling_rounds")
    assert any(m[keys[0]] > 0 and m[keys[1]] > 1 for m in a["metrics"])  # else this case tests nothing
    assert [[m[k] for k in keys] for m in a["metrics"]] == [[m[k] for k in keys] for m in b["metrics"]]
    assert_policy_gradients_equal(a, b, POLICY_GRADIENT_ATOL["grpo-dynamic"])


def test_two_processes_equal_one_with_the_shared_prompt_prefix(tmp_path):
    """Prompts that start alike (models/prefix.py): each process runs its rows' shared beginning once per forward,
    under DDP, and the run is still the one-process run."""
    import random

    rng = random.Random(0)
    prompts = tmp_path / "prefixed.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "Answer with one short word: " + "".join(
        rng.choice("abcdefghij") for _ in range(6))}) + "\n" for _ in range(32)))
    a, b = one_vs_two(tmp_path, "ppo", f"prompts.path={prompts}", "prompts.max_prompt_tokens=64", "critic=separate")
    assert a["shares_prefix"] == b["shares_prefix"] == [True, True, True]  # actor, critic, reference
    for it in range(2):
        assert torch.equal(a["response_ids"][it], b["response_ids"][it])
        assert torch.allclose(a["advantages"][it], b["advantages"][it], atol=1e-5)
        _close_metrics(a["metrics"][it], b["metrics"][it])
    _assert_weights_close(a["weights"], b["weights"], PPO_WEIGHTS_ATOL, a["start"])


def assert_supervised_equal(a: dict, b: dict) -> None:
    """mp_driver's sft or rm outputs, one process (a) against N (b); test_two_hosts.py checks two hosts with it."""
    assert a["steps"] == b["steps"] == [1, 2]
    for ma, mb in zip(a["metrics"], b["metrics"]):
        _close_metrics(ma, mb)
    _assert_weights_close(a["weights"], b["weights"], SUPERVISED_WEIGHTS_ATOL)


@pytest.mark.parametrize("case", ["sft", "rm"])
def test_two_processes_equal_one_for_sft_and_the_reward_model(one_process, two_processes, case):
    """Micro-batches of different token counts on the two processes: the loss is still the global token mean."""
    assert_supervised_equal(one_process[case], two_processes[case])


PPO_ARGS = [f"policy={TINY}", "reward=task:tiny-target", "prompts.path=task:tiny-target/train",
            "prompts.max_prompt_tokens=32", "rollout_batch_size=8", "minibatch_size=8", "micro_batch_size=4",
            "ppo_epochs=2", "generation.max_new_tokens=6", "optim.lr=1e-2", "optim.schedule=constant",
            "precision=fp32", "critic=shared", "save_every=1"]


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_process_ppo_run_writes_once_checkpoints_and_resumes(tmp_path):
    out = tmp_path / "ppo"
    run(2, "-m", "quartet.cli", "ppo", *PPO_ARGS, f"output_dir={out}", "iterations=2")
    assert [r["step"] for r in _lines(out)] == [1, 2]
    assert len((out / "samples.jsonl").read_text().splitlines()) == 2 * 16  # 2 iterations x 2 processes x 8
    from quartet.trainers import checkpoint as ckpt
    from quartet.trainers.ppo_roles import PolicyModel

    newest = ckpt.list_checkpoints(out)[-1]
    tensors, state = ckpt.read_checkpoint(newest, ["policy"])
    assert state["iteration"] == 2 and tensors["policy"]
    run(2, "-m", "quartet.cli", "ppo", *PPO_ARGS, f"output_dir={out}", "iterations=3", "--resume")
    assert [r["step"] for r in _lines(out)] == [1, 2, 3]
    assert (out / "model" / "model.safetensors").is_file() and (out / "value_head.safetensors").is_file()
    assert not list(tmp_path.glob("quartet-rank-*")) and PolicyModel


def test_a_stop_on_rule_ends_both_processes_cleanly(tmp_path):
    out = tmp_path / "hack"
    proc = run(2, "-m", "quartet.cli", "ppo", *PPO_ARGS, f"output_dir={out}", "iterations=40",
               "reward=ppo_rewards:repeated_char", "kl_coef=0.0", "rollout_batch_size=16", "minibatch_size=16",
               "micro_batch_size=16", "ppo_epochs=4", "generation.max_new_tokens=12",
               "stop_on=[reward_hacking_repetition]", "save_every=0")
    steps = [r["step"] for r in _lines(out)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 40
    assert "stopping at iteration" in proc.stdout + proc.stderr
    assert (out / "model" / "model.safetensors").is_file()


def test_two_process_sft_and_rm_runs(tmp_path):
    sft_data = tmp_path / "sft.jsonl"
    sft_data.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": "ab" * (1 + i % 4)}) + "\n"
                                for i in range(24)))
    run(2, "-m", "quartet.cli", "sft", f"model={TINY}", f"data.path={sft_data}", "data.chat_template=false",
        f"output_dir={tmp_path / 'sft'}", "max_steps=3", "batch_size=4", "log_every=1", "eval_every=3",
        "precision=fp32")
    assert [r["step"] for r in _lines(tmp_path / "sft") if "sft/loss" in r] == [1, 2, 3]
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": "yes", "rejected": "no"}) + "\n"
                             for i in range(24)))
    run(2, "-m", "quartet.cli", "rm", f"model={TINY}", f"data.path={prefs}", "data.chat_template=false",
        f"output_dir={tmp_path / 'rm'}", "max_steps=3", "batch_size=4", "log_every=1", "eval_every=3",
        "precision=fp32")
    assert [r["step"] for r in _lines(tmp_path / "rm") if "rm/loss" in r] == [1, 2, 3]
    from quartet.models import load_reward_model

    assert load_reward_model(str(tmp_path / "rm" / "model")) is not None
