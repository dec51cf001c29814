"""Reliability of runs: no user file lost, no checkpoint unpickled, damaged checkpoints skipped, resume
continues exactly or refuses, a run killed at any moment resumes to the same metrics, and non-finite
weights never reach a saved model."""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_ppo import TINY, make_cfg

from quartet.atomic import atomic_dir, atomic_write_text
from quartet.errors import ConfigError
from quartet.outputs import MARKER, check_output_dir, run_lock
from quartet.trainers import checkpoint as ckpt
from quartet.trainers import loop
from quartet.trainers.ppo import NonFiniteWeights, PPOTrainer

MAIN = SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None)


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, p.is_dir())
            for p in sorted(root.rglob("*"))}


# ---------------------------------------------------------------------------- output folders
def test_a_users_folder_is_refused_and_kept(tmp_path):
    user = tmp_path / "thesis"
    user.mkdir()
    (user / "chapter1.tex").write_text("precious")
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError, match="sft.output_dir: .*thesis already holds files that are not a Quartet run"):
        with loop.run_dir(str(user), MAIN, "sft"):
            pass
    assert snapshot(tmp_path) == before


def test_a_file_is_never_replaced_by_a_run(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    before = snapshot(tmp_path)
    for stage in ("sft", "rm"):
        with pytest.raises(ConfigError, match=f"{stage}.output_dir: .*notes.txt is a file"):
            with loop.run_dir(str(f), MAIN, stage, overwrite=True):
                pass
    with pytest.raises(ConfigError, match="is a file"):
        with atomic_dir(f):
            pass
    assert snapshot(tmp_path) == before and f.read_text() == "mine"


def test_overwrite_writes_into_a_folder_and_keeps_the_users_files(tmp_path):
    user = tmp_path / "out"
    user.mkdir()
    (user / "keep.txt").write_text("mine")
    (user / "summary.md").write_text("old summary")
    with loop.run_dir(str(user), MAIN, "sft", overwrite=True) as tmp:
        (tmp / "summary.md").write_text("new")
        (tmp / "model").mkdir()
    assert (user / "keep.txt").read_text() == "mine"
    assert (user / "summary.md").read_text() == "new" and (user / "model").is_dir()
    assert json.loads((user / MARKER).read_text())["stage"] == "sft"


def test_a_run_of_the_same_stage_is_replaced_and_of_another_refused(tmp_path):
    out = tmp_path / "run"
    with loop.run_dir(str(out), MAIN, "sft") as tmp:
        (tmp / "a.txt").write_text("1")
    with loop.run_dir(str(out), MAIN, "sft") as tmp:
        (tmp / "b.txt").write_text("2")
    assert not (out / "a.txt").exists() and (out / "b.txt").is_file()
    with pytest.raises(ConfigError, match="already holds a Quartet sft run"):
        check_output_dir(out, "rm")
    for bad in (".", ""):
        with pytest.raises(ConfigError, match="current directory"):
            check_output_dir(bad, "sft")


def test_a_failed_run_leaves_nothing(tmp_path):
    before = snapshot(tmp_path)
    with pytest.raises(RuntimeError):
        with loop.run_dir(str(tmp_path / "a" / "b" / "run"), MAIN, "sft") as tmp:
            (tmp / "half.txt").write_text("x")
            raise RuntimeError("crash")
    assert snapshot(tmp_path) == before


def test_two_writers_of_one_output_get_a_clear_error(tmp_path):
    out = tmp_path / "run"
    with run_lock(out, "ppo.output_dir"):
        with pytest.raises(ConfigError, match="another quartet process is writing"):
            with run_lock(out, "ppo.output_dir"):
                pass
    with run_lock(out, "ppo.output_dir"):  # released: the next run may start
        pass
    code = "import sys; from quartet.outputs import run_lock; cm = run_lock(sys.argv[1], 'x'); cm.__enter__(); print('held', flush=True); sys.stdin.read()"
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match="another quartet process"):
            with run_lock(out, "ppo.output_dir"):
                pass
    finally:
        holder.kill()
        holder.wait()
    with run_lock(out, "ppo.output_dir"):  # a killed holder leaves no stale lock
        pass


def test_written_files_get_ordinary_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        f = atomic_write_text(tmp_path / "x.txt", "hi")
        with atomic_dir(tmp_path / "d") as tmp:
            (tmp / "y").write_text("y")
    finally:
        os.umask(old)
    assert stat.S_IMODE(f.stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o755


# ---------------------------------------------------------------------------- checkpoints
def _run(tmp_path, name="ppo", **kw):
    common = dict(iterations=4, save_every=1, keep_checkpoints=4, critic="separate", reference=TINY,
                  reward_norm=True, adaptive_kl=True)
    common.update(kw)
    return make_cfg(tmp_path / name, **common)


def _steps(run_dir: Path) -> dict:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = {k: v for k, v in rec.items() if not k.startswith(("timing/", "memory/", "time"))}
    return out


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {Evil.target}",))


def test_a_pickled_checkpoint_is_refused_and_its_code_never_runs(tmp_path):
    cfg = _run(tmp_path, iterations=2)
    PPOTrainer(cfg, progress=False).train()
    newest = ckpt.list_checkpoints(cfg.output_dir)[-1]
    for path in ckpt.list_checkpoints(cfg.output_dir):
        (path / ckpt.STATE_JSON).unlink()
        (path / ckpt.STATE_TENSORS).unlink()
        Evil.target = tmp_path / "pwned"
        (path / ckpt.LEGACY_STATE).write_bytes(pickle.dumps({"iteration": 2, "x": Evil()}))
    with pytest.raises(ConfigError, match="older Quartet.*not loaded because unpickling"):
        PPOTrainer(cfg, resume=True, progress=False)
    assert not (tmp_path / "pwned").exists()
    assert (newest / ckpt.LEGACY_STATE).is_file()  # refused, not deleted


def test_state_round_trips_without_pickle():
    import numpy as np

    tensors: dict = {}
    state = {"optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3)}},
                           "param_groups": [{"lr": 1e-3, "params": [0], "betas": (0.9, 0.999)}]},
             "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
             "best": {"value": None, "iteration": None}, "__odd": 1}
    tree = json.loads(json.dumps(ckpt.encode_state(state, tensors)))
    back = ckpt.decode_state(tree, tensors)
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert back["rng"]["python"] == state["rng"]["python"]
    assert np.array_equal(back["rng"]["numpy"][1], state["rng"]["numpy"][1]) and back["__odd"] == 1
    with pytest.raises(ValueError, match="tensor"):
        ckpt.decode_state({"__tensor__": "t99"}, tensors)


def test_a_damaged_newest_checkpoint_falls_back_and_resumes_exactly(tmp_path, caplog):
    full = PPOTrainer(_run(tmp_path, "a"), progress=False).train()
    cfg = _run(tmp_path, "b")
    PPOTrainer(cfg, progress=False).train()
    newest = ckpt.list_checkpoints(cfg.output_dir)[-1]
    data = (newest / "policy.safetensors").read_bytes()
    (newest / "policy.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    (Path(cfg.output_dir) / "model").rename(Path(cfg.output_dir) / "model-old")
    resumed = PPOTrainer(cfg, resume=True, progress=False)
    assert resumed.start_iteration == 3
    assert "policy.safetensors: damaged" in caplog.text
    resumed.train()
    a, b = _steps(full.run_dir), _steps(Path(cfg.output_dir))
    assert sorted(b) == [1, 2, 3, 4] and a[4] == b[4]


def test_no_readable_checkpoint_is_one_line_naming_the_file(tmp_path):
    cfg = _run(tmp_path, iterations=1)
    PPOTrainer(cfg, progress=False).train()
    for path in ckpt.list_checkpoints(cfg.output_dir):
        (path / ckpt.STATE_JSON).write_text("{not json")
    with pytest.raises(ConfigError, match=r"no readable checkpoint.*state.json: damaged") as err:
        PPOTrainer(cfg, resume=True, progress=False)
    assert "\n" not in str(err.value)


def test_resume_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="--resume given but there is no checkpoint"):
        PPOTrainer(_run(tmp_path, iterations=1), resume=True, progress=False)


def test_resume_refuses_changed_settings_and_records_allowed_ones(tmp_path):
    cfg = _run(tmp_path, iterations=2, **{"optim.schedule": "constant"})
    PPOTrainer(cfg, progress=False).train()
    changed = _run(tmp_path, iterations=2, **{"optim.schedule": "constant", "optim.lr": 5e-3})
    with pytest.raises(ConfigError, match=r"ppo --resume: optim.lr was 0.01 .* now 0.005"):
        PPOTrainer(changed, resume=True, progress=False)
    longer = _run(tmp_path, iterations=3, **{"optim.schedule": "constant"})
    PPOTrainer(longer, resume=True, progress=False).train()
    assert "iterations: 3" in (Path(cfg.output_dir) / "config.yaml").read_text()
    assert sorted(_steps(Path(cfg.output_dir))) == [1, 2, 3]
    decaying = _run(tmp_path, "c", iterations=1)
    PPOTrainer(decaying, progress=False).train()
    with pytest.raises(ConfigError, match="iterations was 1 .*the LR schedule depends on it"):
        PPOTrainer(_run(tmp_path, "c", iterations=2), resume=True, progress=False)


def test_non_finite_weights_never_reach_a_saved_model(tmp_path):
    cfg = _run(tmp_path, iterations=3)
    trainer = PPOTrainer(cfg, progress=False)
    real_step = trainer.optimizer.step
    calls = {"n": 0}
    per_iteration = cfg.updates_per_iteration * (2 if trainer.split_backward else 1)  # a step per role

    def poisoned_step(*a, **k):
        out = real_step(*a, **k)
        calls["n"] += 1
        if calls["n"] > per_iteration * 2:  # during iteration 3
            next(trainer.roles.actor.parameters()).data.fill_(float("nan"))
        return out

    trainer.optimizer.step = poisoned_step
    with pytest.raises(NonFiniteWeights, match="iteration 3 made weight .* non-finite"):
        trainer.train()
    run = Path(cfg.output_dir)
    assert not (run / "model").exists()
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["iter-1", "iter-2"]
    resumed = PPOTrainer(cfg, resume=True, progress=False)
    assert resumed.start_iteration == 2
    assert all(torch.isfinite(p).all() for p in resumed.roles.actor.parameters())


# ---------------------------------------------------------------------------- SIGKILL at random moments
KILL_ARGS = [f"policy={TINY}", "reward=task:tiny-target", "prompts.path=task:tiny-target/train",
             "prompts.max_prompt_tokens=32", "iterations=6", "rollout_batch_size=8", "minibatch_size=8",
             "micro_batch_size=4", "ppo_epochs=2", "generation.max_new_tokens=6", "generation.batch_size=8",
             "optim.lr=1e-2", "precision=fp32", "critic=shared", "save_every=1", "reward_norm=true",
             "adaptive_kl=true"]


def _quartet(out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}
    return subprocess.Popen([sys.executable, "-m", "quartet.cli", "ppo", *KILL_ARGS, f"output_dir={out}", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)


def _newest_checkpoint(run: Path) -> int:
    return max((int(p.name.split("-")[-1]) for p in ckpt.list_checkpoints(run)), default=0)


def test_sigkill_at_random_moments_then_resume_gives_the_uninterrupted_metrics(tmp_path):
    t0 = time.monotonic()
    clean = _quartet(tmp_path / "clean")
    assert clean.wait(timeout=300) == 0, clean.stderr.read()[-2000:]
    duration = time.monotonic() - t0
    rng = random.Random(0)
    out = tmp_path / "killed"
    kills = 0
    # five launches, whatever the machine's load: the first two are killed once they are under way (after their
    # first new checkpoint, a random few milliseconds on: in an iteration or a checkpoint write), the next two at a
    # random moment from start-up to the end of the clean run's time (or not, if they finish first), the last one
    # runs to the end. (Deadlines alone missed whole runs, or killed every one, when the load changed.)
    for launch in range(5):
        resume = ("--resume",) if ckpt.list_checkpoints(out) else ()
        newest = _newest_checkpoint(out)
        proc = _quartet(out, *resume)
        start = time.monotonic()
        if launch < 2:
            while proc.poll() is None and _newest_checkpoint(out) <= newest:
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.05))
        elif launch < 4:
            deadline = start + duration * rng.uniform(0.1, 0.95)
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        if launch < 4 and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
            continue
        assert proc.wait(timeout=300) == 0, proc.stderr.read()[-2000:]
        break
    assert kills >= 2 and (out / "model" / "model.safetensors").is_file()
    a, b = _steps(tmp_path / "clean"), _steps(out)
    assert sorted(b) == list(range(1, 7))
    assert a == b
    assert not list(out.rglob("*.tmp"))


def test_a_pipeline_never_writes_into_a_users_folder(tmp_path):
    from quartet.pipeline import load_pipeline, run_pipeline

    (tmp_path / "pipeline.yaml").write_text("a user's own file\n")
    (tmp_path / "notes.txt").write_text("mine")
    cfg_file = tmp_path / "p.yaml"
    cfg_file.write_text(f"output_dir: {tmp_path / 'runs'}\ntask: tiny-target\nstages: [ppo]\n")
    cfg = load_pipeline(str(cfg_file), [f"output_dir={tmp_path}"])
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError, match="pipeline.output_dir: .* already holds files that are not a Quartet run"):
        run_pipeline(cfg)
    assert snapshot(tmp_path) == before
