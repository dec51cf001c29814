"""A user's reward or judge that never returns stops the run with one error line naming it, exit 2, and a PPO run's
newest checkpoint resumes (quartet.judges.bounded). Real `python -m quartet.cli` processes: the point is that the
process exits although the hung call's thread is still asleep or spinning. Each has an outer timeout, so a
regression fails the test instead of hanging it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quartet.trainers.checkpoint import list_checkpoints

TINY = "tiny:llama?hidden=32&layers=1&heads=4&vocab=300"
SMALL = ["prompts.max_prompt_tokens=32", "generation.max_new_tokens=4", "rollout_batch_size=2", "minibatch_size=2",
         "micro_batch_size=2", "ppo_epochs=1", "precision=fp32"]
HANG = '''
import os, time
from pathlib import Path


def sleeps(prompts, responses):
    time.sleep(10**6)


def spins(prompts, responses):
    while True:
        pass


def second_call_sleeps(prompts, responses):
    """Scores the first call; with QUARTET_TEST_HANG set, every later call sleeps forever."""
    calls = Path("calls")
    n = int(calls.read_text()) if calls.exists() else 0
    calls.write_text(str(n + 1))
    if n >= 1 and os.environ.get("QUARTET_TEST_HANG"):
        time.sleep(10**6)
    return [len(r) / 10 for r in responses]
'''
OUTER_TIMEOUT = 180  # the command's own limit is a few seconds; this only keeps a regression from hanging the suite


def quartet(cwd: Path, *argv: str, hang: bool = False) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("QUARTET_TEST_HANG", None)
    if hang:
        env["QUARTET_TEST_HANG"] = "1"
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "quartet.cli", *argv], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=OUTER_TIMEOUT)
    return out, time.monotonic() - start


def one_error(out: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    return errors[0]


@pytest.fixture
def case(tmp_path) -> Path:
    (tmp_path / "hang.py").write_text(HANG)
    return tmp_path


@pytest.mark.parametrize("command,fn", [("ppo", "sleeps"), ("grpo", "spins")])
def test_a_reward_that_never_returns_is_one_error_naming_it(case, command, fn):
    out, seconds = quartet(case, command, f"policy={TINY}", "prompts.path=task:tiny-target/train", "output_dir=out",
                           "iterations=2", *SMALL, f"reward=hang:{fn}", "judge_timeout=1.5")
    assert one_error(out) == (f"error: reward 'hang:{fn}' did not return within 1.5 s (judge_timeout); it may be "
                              f"stuck, or raise judge_timeout if it is only slow")
    assert seconds < 90  # start-up, one generation, 1.5 s, and an exit that does not wait for the hung thread


def test_a_hung_reward_leaves_the_newest_checkpoint_and_resume_completes(case):
    args = ["ppo", f"policy={TINY}", "prompts.path=task:tiny-target/train", "output_dir=out", "iterations=3",
            "save_every=1", "keep_checkpoints=3", *SMALL, "reward=hang:second_call_sleeps"]
    out, _ = quartet(case, *args, "judge_timeout=2", hang=True)
    assert "'hang:second_call_sleeps' did not return within 2 s" in one_error(out)
    run = case / "out"
    assert [p.name for p in list_checkpoints(run)] == ["iter-1"]
    assert not (run / "model").exists()

    # the fixed reward (no hang), and a longer timeout: a setting a resumed run may change
    out, _ = quartet(case, *args, "judge_timeout=60", "--resume")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "judge_timeout 2.0 -> 60.0" in out.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert (run / "model" / "model.safetensors").is_file()
    assert (case / "calls").read_text() == "4"  # iteration 1, the hung call of iteration 2, then iterations 2 and 3


def test_a_label_judge_that_never_returns_is_one_error_and_writes_nothing(case):
    before = sorted(p.name for p in case.iterdir())
    out, _ = quartet(case, "label", f"policy={TINY}", "prompts.path=task:tiny-target/train", "prompts.limit=4",
                     "generation.max_new_tokens=4", "output=pairs.jsonl", "judge=hang:spins", "judge_timeout=1")
    assert one_error(out).startswith("error: reward 'hang:spins' did not return within 1 s (judge_timeout)")
    assert sorted(p.name for p in case.iterdir()) == before


def test_an_eval_judge_that_never_returns_is_one_error_and_writes_nothing(case):
    out, _ = quartet(case, "eval", TINY, "--prompts", "task:tiny-target/eval", "--num-prompts", "2",
                     "--max-new-tokens", "4", "--relevance", "hang:sleeps", "--judge-timeout", "1", "--out", "out")
    assert one_error(out).startswith("error: reward 'hang:sleeps' did not return within 1 s (judge_timeout)")
    assert not (case / "out").exists()
