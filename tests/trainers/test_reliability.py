"""Reliability of runs: no user file lost, no checkpoint unpickled, damaged checkpoints skipped, resume
continues exactly or refuses, a run killed at any moment resumes to the same metrics, and non-finite
weights never reach a saved model."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from builders import TINY, tiny_ppo
from quartet.atomic import atomic_dir, atomic_write_text
from quartet.errors import ConfigError, QuartetError
from quartet.outputs import MARKER, check_output_dir, run_lock
from quartet.trainers import checkpoint as ckpt
from quartet.trainers import loop
from quartet.trainers.ppo import NonFiniteWeights, PPOTrainer

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA

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


def test_overwrite_writes_beside_the_users_files_and_never_over_one(tmp_path):
    user = tmp_path / "out"
    user.mkdir()
    (user / "keep.txt").write_text("mine")
    with loop.run_dir(str(user), MAIN, "sft", overwrite=True) as tmp:
        (tmp / "summary.md").write_text("new")
        (tmp / "model").mkdir()
    assert (user / "keep.txt").read_text() == "mine"
    assert (user / "summary.md").read_text() == "new" and (user / "model").is_dir()
    assert json.loads((user / MARKER).read_text())["stage"] == "sft"
    # a user's file at a path the stage writes: refused, nothing touched
    other = tmp_path / "other"
    other.mkdir()
    (other / "summary.md").write_text("my summary")
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError, match=r"other already holds files that are not a Quartet run, and .*other/"
                                          r"summary.md is a path the sft stage writes"):
        with loop.run_dir(str(other), MAIN, "sft", overwrite=True):
            pass
    assert snapshot(tmp_path) == before


def test_a_run_of_the_same_stage_is_replaced_and_of_another_refused(tmp_path):
    out = tmp_path / "run"
    with loop.run_dir(str(out), MAIN, "sft") as tmp:
        (tmp / "summary.md").write_text("1")
        (tmp / "model").mkdir()
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "model", "summary.md"]
    with loop.run_dir(str(out), MAIN, "sft") as tmp:
        (tmp / "summary.md").write_text("2")
    assert (out / "summary.md").read_text() == "2" and not (out / "model").exists()  # the old run's files go
    (out / "notes.txt").write_text("mine")  # a file the user put into the run folder stays through a re-run
    with loop.run_dir(str(out), MAIN, "sft") as tmp:
        (tmp / "summary.md").write_text("3")
        (tmp / "model").mkdir()
    assert (out / "notes.txt").read_text() == "mine" and (out / "summary.md").read_text() == "3"
    assert (out / "model").is_dir() and not list(tmp_path.glob(".*"))
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
    return tiny_ppo(tmp_path / name, **common)


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
    with pytest.raises(ConfigError, match=r"ppo --resume: optim.lr was 0.01 .* now 0.005.*: set optim.lr=0.01 to "
                                          r"resume it, or start a new output_dir$"):
        PPOTrainer(changed, resume=True, progress=False)
    longer = _run(tmp_path, iterations=3, **{"optim.schedule": "constant"})
    PPOTrainer(longer, resume=True, progress=False).train()
    assert "iterations: 3" in (Path(cfg.output_dir) / "config.yaml").read_text()
    assert sorted(_steps(Path(cfg.output_dir))) == [1, 2, 3]
    # a decaying schedule extends too (issue 35): test_resume_extends_a_finished_run_over_a_rebuilt_schedule


def _lrs(run_dir: Path) -> dict[int, float]:
    return {step: rec["optim/lr"] for step, rec in _steps(run_dir).items()}


def test_resume_extends_a_finished_run_over_a_rebuilt_schedule(tmp_path):
    """A finished 2-iteration run (linear decay: lr 0 at its last step) resumed with iterations=4 trains
    iterations 3 and 4 on the schedule of a 4-iteration run from step 8 of 16 (lr 5e-3 = half the peak 1e-2,
    then down to 0), and config.yaml and summary.md say so. Asking for no more iterations than it has is one
    line, with nothing written."""
    cfg = _run(tmp_path, iterations=2)  # linear schedule, peak 1e-2, 4 optimizer steps per iteration
    PPOTrainer(cfg, progress=False).train()
    run = Path(cfg.output_dir)
    assert _lrs(run)[2] == 0.0

    longer = PPOTrainer(_run(tmp_path, iterations=4), resume=True, progress=False)
    assert longer.start_iteration == 2 and longer.resumed_from.name == "iter-2"
    assert [g["lr"] for g in longer.optimizer.param_groups] == pytest.approx([5e-3, 5e-3])  # not the old 0
    before = {n: p.detach().clone() for n, p in longer.roles.actor.named_parameters()}
    result = longer.train()
    assert result.iterations == 4 and result.extended_from == 2
    assert sorted(_steps(run)) == [1, 2, 3, 4]
    assert any(not torch.equal(before[n], p) for n, p in longer.roles.actor.named_parameters())
    # the steps after the extension follow the schedule a 4-iteration run has there
    uninterrupted = PPOTrainer(_run(tmp_path, "four", iterations=4), progress=False).train()
    assert [_lrs(run)[i] for i in (3, 4)] == pytest.approx([_lrs(uninterrupted.run_dir)[i] for i in (3, 4)])
    assert _lrs(run)[3] == pytest.approx(2.5e-3) and _lrs(run)[4] == 0.0
    note = ("ppo --resume at iteration 2: iterations 2 -> 4 (extended_from: 2); the linear LR schedule rebuilt over "
            "4 iterations, continuing from optimizer step 8 of 16: lr 0 -> 0.005")
    text = (run / "config.yaml").read_text()
    assert text.splitlines()[0] == f"# {note}" and "\niterations: 4\n" in text
    assert note in (run / "summary.md").read_text()
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["iter-1", "iter-2", "iter-3", "iter-4"]

    # a resume of the extended run keeps the record (no setting changed: config.yaml is not rewritten)
    before = snapshot(run)
    for iterations in (4, 3):
        with pytest.raises(ConfigError) as err:
            PPOTrainer(_run(tmp_path, iterations=iterations), resume=True, progress=False)
        assert str(err.value) == (f"ppo --resume: {run} already has 4 iterations (iter-4), so iterations={iterations} "
                                  f"adds none; pass iterations=N with N > 4 to extend it")
    assert snapshot(run) == before


def test_an_extension_killed_before_its_first_checkpoint_resumes_exactly(tmp_path):
    """2 iterations extended to 4 with save_every 2, killed in iteration 4: config.yaml already says 4, the
    newest checkpoint is the 2-iteration run's own (lr 0 in its optimizer). The resume still takes the 4-iteration
    schedule's lr and repeats the uninterrupted extension's iterations 3 and 4 exactly."""
    def extend(name: str, crash: bool) -> Path:
        PPOTrainer(_run(tmp_path, name, iterations=2, save_every=2), progress=False).train()
        trainer = PPOTrainer(_run(tmp_path, name, iterations=4, save_every=2), resume=True, progress=False)
        if crash:
            real_step = trainer.step

            def step(iteration):
                if iteration == 4:
                    raise KeyboardInterrupt
                return real_step(iteration)

            trainer.step = step
            with pytest.raises(KeyboardInterrupt):
                trainer.train()
            assert "iterations: 4" in (Path(trainer.cfg.output_dir) / "config.yaml").read_text()
            trainer = PPOTrainer(_run(tmp_path, name, iterations=4, save_every=2), resume=True, progress=False)
            assert trainer.start_iteration == 2 and trainer.extended_from is None
            assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)
        trainer.train()
        return Path(trainer.cfg.output_dir)

    clean, crashed = _steps(extend("clean", crash=False)), _steps(extend("crashed", crash=True))
    assert sorted(crashed) == [1, 2, 3, 4] and all(clean[i] == crashed[i] for i in (3, 4))


def test_a_run_stopped_while_finishing_completes_with_its_own_iterations(tmp_path):
    """The last checkpoint is written before the final model and the summary: a run killed between them resumes
    with the same iterations and writes them, while the same resume of a finished run is refused."""
    cfg = _run(tmp_path, iterations=2, **{"optim.schedule": "constant"})
    PPOTrainer(cfg, progress=False).train()
    run = Path(cfg.output_dir)
    (run / "summary.md").unlink()
    shutil.rmtree(run / "model")
    PPOTrainer(cfg, resume=True, progress=False).train()
    assert (run / "model").is_dir() and (run / "summary.md").is_file()
    with pytest.raises(ConfigError, match="already has 2 iterations"):
        PPOTrainer(cfg, resume=True, progress=False)


def test_save_every_0_writes_no_checkpoint_and_resume_says_what_to_do(tmp_path):
    """save_every: 0 (the default) keeps no checkpoint, the last neither, and no best copy unless best_metric is
    set; --resume then names the way on: a new run from the final model against the same reference."""
    cfg = _run(tmp_path, iterations=2, save_every=0, best_metric=None)
    PPOTrainer(cfg, progress=False).train()
    run = Path(cfg.output_dir)
    assert (run / "model").is_dir() and not (run / "checkpoints").exists() and not (run / "best").exists()
    assert "best_metric: none" in (run / "config.yaml").read_text()
    with pytest.raises(ConfigError) as err:
        PPOTrainer(_run(tmp_path, iterations=4, save_every=0, best_metric=None), resume=True, progress=False)
    assert str(err.value) == (
        f"{run}: --resume given but there is no checkpoint under {run / 'checkpoints'} (it ran with save_every: 0, "
        f"which keeps none); to train its policy further, start a new run from its model: policy={run / 'model'} "
        f"reference={TINY} output_dir=<a new folder> (a new optimizer, schedule and critic; with save_every > 0 "
        f"that run can be extended with --resume iterations=N)")

    tracked = _run(tmp_path, "tracked", iterations=1, save_every=0, best_metric="objective/score")
    PPOTrainer(tracked, progress=False).train()
    folders = sorted(p.name for p in (Path(tracked.output_dir) / "checkpoints").iterdir())
    assert folders == ["best-1"]  # the best's weights, asked for; no iter-N


def test_non_finite_weights_never_reach_a_saved_model(tmp_path):
    cfg = _run(tmp_path, iterations=3)
    trainer = PPOTrainer(cfg, progress=False)
    real_step = trainer.optimizer.step
    calls = {"n": 0}
    per_iteration = cfg.updates_per_iteration * (2 if trainer.plan.split_backward else 1)  # a step per role

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
            if (out / "summary.md").is_file():  # killed after its last write: finished, and --resume refuses
                break                           # a finished run with no more iterations (issue 35)
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


# ---------------------------------------------------------------------------- checkpoint state validated on read
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 2-iteration run with checkpoints iter-1 and iter-2, copied by each test that edits it."""
    cfg = _run(tmp_path_factory.mktemp("finished"), iterations=2)
    PPOTrainer(cfg, progress=False).train()
    return Path(cfg.output_dir)


def _set(key, value):
    return lambda state: state.__setitem__(key, value)


@pytest.mark.parametrize("edit, iterations, message", [
    (_set("iteration", -1), 2, "iteration must be a whole number >= 0, got -1"),
    (_set("iteration", "2"), 2, "iteration must be a whole number >= 0, got '2'"),
    (_set("iteration", True), 2, "iteration must be a whole number >= 0, got True"),
    (_set("iteration", 2.5), 2, "iteration must be a whole number >= 0, got 2.5"),
    (_set("iteration", 1), 2, "iteration 1 does not match its folder iter-2"),
    (lambda state: state.pop("iteration"), 2, "missing field 'iteration'"),
    (lambda state: state.pop("kl_ctl"), 2, "missing field 'kl_ctl'"),
    (lambda state: state.pop("rng"), 2, "missing field 'rng'"),
    (_set("best", {"value": 0.5, "iteration": "../../etc"}), 2, "best.iteration must be a whole number from 0 to 2"),
    (_set("best", {"value": float("nan"), "iteration": 1}), 2, "best.value must be a finite number or null, got nan"),
], ids=["negative", "text", "bool", "float", "other-folder", "no-iteration", "no-kl-ctl", "no-rng", "best-iteration",
        "best-nan"])
def test_a_hand_edited_checkpoint_state_is_refused_naming_the_field(finished_run, tmp_path, edit, iterations, message):
    """One line naming state.json and the field; nothing written, nothing pruned, no fallback to iter-1 (which
    would resume from another point than the files say)."""
    cfg = _run(tmp_path, iterations=iterations)
    shutil.copytree(finished_run, cfg.output_dir)
    file = Path(cfg.output_dir) / "checkpoints" / "iter-2" / ckpt.STATE_JSON
    if edit is not None:
        state = json.loads(file.read_text())
        edit(state)
        file.write_text(json.dumps(state))
    before = snapshot(Path(cfg.output_dir))
    with pytest.raises(ckpt.InvalidState) as err:
        PPOTrainer(cfg, resume=True, progress=False)
    assert str(err.value).startswith(f"{file}: {message}")
    assert snapshot(Path(cfg.output_dir)) == before


def test_pruning_never_removes_the_checkpoint_resumed_from(tmp_path):
    """iter-3 and iter-4 damaged, so the resume starts from iter-2, with keep_checkpoints lowered to 2: writing
    iter-3 once pruned iter-1 and iter-2 (the newest two being iter-3 and the damaged iter-4), leaving no
    checkpoint known to read back. Now the damaged iter-4 does not count (it is replaced when reached) and iter-2
    stays while the run goes on."""
    cfg = _run(tmp_path, iterations=4, **{"optim.schedule": "constant"})
    PPOTrainer(cfg, progress=False).train()
    run = Path(cfg.output_dir)
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["iter-1", "iter-2", "iter-3", "iter-4"]
    for n in (3, 4):
        weights = run / "checkpoints" / f"iter-{n}" / "policy.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    resumed = PPOTrainer(_run(tmp_path, iterations=4, keep_checkpoints=2, **{"optim.schedule": "constant"}),
                         resume=True, progress=False)
    assert resumed.start_iteration == 2 and resumed.resumed_from.name == "iter-2"
    resumed.train()
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["iter-2", "iter-3", "iter-4"]
    for path in ckpt.list_checkpoints(run):  # all three read back whole: iter-3 and iter-4 were rewritten
        ckpt.read_checkpoint(path, ["policy"], max_iteration=4)


def test_save_checkpoint_prunes_only_older_checkpoints_and_never_the_protected_one(tmp_path):
    for n in (1, 2, 3, 9):
        (tmp_path / "checkpoints" / f"iter-{n}").mkdir(parents=True)
    ckpt.save_checkpoint(tmp_path, 4, {}, {"iteration": 4}, keep=1, protect=tmp_path / "checkpoints" / "iter-2")
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["iter-2", "iter-4", "iter-9"]


# ---------------------------------------------------------------------------- best_metric, dpo kl_samples=0
@pytest.mark.parametrize("kw", [
    dict(critic="separate", gold="task:tiny-target", monitor_judges={"rel": "task:tiny-target"}, reward_norm=True),
    dict(advantage="grpo", samples_per_prompt=2, critic=None, kl_in_reward=False),
    dict(critic="shared", entropy_coef=0.01),
], ids=["separate-critic-gold-monitor", "grpo-kl-loss", "shared-critic"])
def test_logged_metrics_are_exactly_what_a_run_logs(tmp_path, kw):
    """PPOConfig.logged_metrics, which best_metric is checked against, is the trainer's own list: a drift
    between the two fails here."""
    cfg = tiny_ppo(tmp_path, iterations=1, **kw)
    PPOTrainer(cfg, progress=False).train()
    records = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert set().union(*records) - {"stage", "algorithm", "step", "time"} == set(cfg.logged_metrics)
    assert {r["algorithm"] for r in records} == {"ppo" if cfg.advantage == "gae" else cfg.advantage}


def test_best_metric_must_name_a_metric_the_run_logs(tmp_path):
    from quartet.config import validate

    with pytest.raises(ConfigError, match=r"ppo.best_metric: 'objective/gold' is not a metric this run logs \(choose "
                                          r"from memory/peak_rss_mb, objective/kl, .*value/loss\)$"):
        validate(tiny_ppo(tmp_path, best_metric="objective/gold"))
    with pytest.raises(ConfigError, match="'value/loss' is not a metric this run logs"):
        validate(tiny_ppo(tmp_path, best_metric="value/loss", advantage="grpo", samples_per_prompt=2, critic=None))
    validate(tiny_ppo(tmp_path, best_metric="objective/gold", gold="task:tiny-target"))
    validate(tiny_ppo(tmp_path, best_metric="rollout/rel", monitor_judges={"rel": "task:tiny-target"}))


def test_dpo_with_kl_samples_zero_logs_no_kl_and_its_run_reads_back(tmp_path):
    """kl_samples: 0 turns the KL measurement off: no dpo/kl (not a NaN) in metrics.jsonl, no KL line in the
    summary, and the report and the doctor read the run without it."""
    from test_dpo import make_cfg as dpo_cfg

    from quartet.monitor import diagnose_run, read_metrics, write_report
    from quartet.trainers.dpo import train_dpo

    result = train_dpo(dpo_cfg(tmp_path, n=40, epochs=1.0, kl_samples=0))
    assert result.first_eval.kl is None and result.eval.kl is None
    run = tmp_path / "dpo"
    records = read_metrics(run)
    assert any("rewards/eval_accuracy" in r for r in records) and not any("dpo/kl" in r for r in records)
    text = (run / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert "KL to the reference" not in (run / "summary.md").read_text()
    assert "DPO: KL to the reference" not in write_report(run).read_text()
    diagnose_run(run)
    assert (run / "findings.jsonl").is_file()


def test_a_run_saved_before_max_line_mb_existed_resumes(tmp_path):
    """A reading limit does not change the run: a config.yaml without prompts.max_line_mb (written before the
    field existed), or with another value, resumes."""
    import yaml

    cfg = _run(tmp_path, iterations=2, **{"optim.schedule": "constant"})
    PPOTrainer(cfg, progress=False).train()
    saved = Path(cfg.output_dir) / "config.yaml"
    data = yaml.safe_load(saved.read_text())
    del data["prompts"]["max_line_mb"]
    saved.write_text(yaml.safe_dump(data, sort_keys=False))
    longer = _run(tmp_path, iterations=3, **{"optim.schedule": "constant", "prompts.max_line_mb": 4.0})
    PPOTrainer(longer, resume=True, progress=False).train()
    assert sorted(_steps(Path(cfg.output_dir))) == [1, 2, 3]
    assert "max_line_mb: 4.0" in saved.read_text()


def test_a_run_saved_before_critic_was_filled_in_resumes(tmp_path):
    """config.yaml of a run written before the critic default was filled in at validation holds critic: null; a
    resume now fills it in (separate: no LoRA) and goes on, as the checkpoint fits."""
    import yaml

    cfg = _run(tmp_path, iterations=1, critic=None)
    PPOTrainer(cfg, progress=False).train()
    saved = Path(cfg.output_dir) / "config.yaml"
    data = yaml.safe_load(saved.read_text())
    assert data["critic"] == "separate"
    data["critic"] = None
    saved.write_text(yaml.safe_dump(data, sort_keys=False))
    PPOTrainer(_run(tmp_path, iterations=2, critic=None), resume=True, progress=False).train()
    assert sorted(_steps(Path(cfg.output_dir))) == [1, 2]


# ---------------------------------------------------------------------------- where and how a stage writes
REWARD_DOWN = {"on": False}


def switchable_reward(prompts, responses):
    """tiny-target's reward, or an error while REWARD_DOWN is on (`test_reliability:switchable_reward`)."""
    if REWARD_DOWN["on"]:
        raise RuntimeError("the reward service is down")
    return [float(r.strip()[:1] in "aeiou") for r in responses]


def _contents(root: Path) -> dict:
    """Every entry under `root`: a file's bytes, size and mtime; a folder's mtime (an entry added or removed
    changes it)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None, p.lstat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def test_a_resume_that_fails_before_its_first_result_leaves_the_run_as_it_was(tmp_path):
    """A resumed run writes nothing until its first iteration has a result: not the allowed change to
    config.yaml, not the truncation of what was logged after the checkpoint, not a new tb/ event file."""
    cfg = _run(tmp_path, iterations=1, reward="test_reliability:switchable_reward", **{"optim.schedule": "constant"})
    PPOTrainer(cfg, progress=False).train()
    run = Path(cfg.output_dir)
    with open(run / "metrics.jsonl", "a") as f:  # logged after the newest checkpoint by a run that was then killed
        f.write(json.dumps({"stage": "ppo", "step": 2, "objective/score": 0.5}) + "\n")
    before = _contents(run)
    longer = _run(tmp_path, iterations=2, reward="test_reliability:switchable_reward",
                  **{"optim.schedule": "constant"})
    REWARD_DOWN["on"] = True
    try:
        with pytest.raises(QuartetError, match="switchable_reward.*the reward service is down"):
            PPOTrainer(longer, resume=True, progress=False).train()
    finally:
        REWARD_DOWN["on"] = False
    assert _contents(run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ppo"]  # no lock, no temporary beside it
    PPOTrainer(longer, resume=True, progress=False).train()  # and it resumes as it would have
    assert "iterations: 2" in (run / "config.yaml").read_text() and sorted(_steps(run)) == [1, 2]


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    """A tmpfs of `size` at `path`: a disk that really fills up. Skipped where this process may not mount one."""
    path.mkdir()
    try:
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no `mount` command here: the disk-full cases need a small tmpfs")
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (it needs root or CAP_SYS_ADMIN; mount said: "
                    f"{out.stderr.strip() or out.returncode}): the disk-full cases need one")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def _cli(tmp_path, *args, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}
    return subprocess.run([sys.executable, "-m", "quartet.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path, **kw)


def _one_error(out: subprocess.CompletedProcess, *parts: str) -> None:
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    for part in parts:
        assert part in errors[0], errors[0]


SFT_DATA = '{"prompt": "ab", "completion": "aa"}\n{"prompt": "cd", "completion": "a1"}\n'
SMALL_LM = "tiny:llama?hidden=32&layers=1&heads=4&vocab=300"  # its sft run: ~170 kB
BIG_LM = "tiny:llama?hidden=128&layers=2&heads=4&vocab=300"  # ~2.4 MB: does not fit the 1 MB disk


def test_a_full_disk_while_saving_is_one_line_and_keeps_the_previous_output_whole(tmp_path):
    (tmp_path / "sft.jsonl").write_text(SFT_DATA)
    with small_disk(tmp_path / "disk", "1m") as disk:
        run = disk / "run"

        def sft(model):
            return _cli(tmp_path, "sft", f"model={model}", "data.path=sft.jsonl", "max_steps=1", f"output_dir={run}")

        _one_error(sft(BIG_LM), f"cannot write {run}", "No space left on device")
        assert os.listdir(disk) == []  # no folder, no temporary, no lock
        assert sft(SMALL_LM).returncode == 0
        before = _contents(run)
        _one_error(sft(BIG_LM), f"cannot write {run}/model", "No space left on device",
                   "what was there before is unchanged")
        assert _contents(run) == before and os.listdir(disk) == ["run"]


def test_a_full_disk_while_labelling_leaves_no_file(tmp_path):
    """One page free: the first of the stage's files fits, the next does not. Before, the config written first
    was left behind; now every file is complete before any is renamed into place."""
    with small_disk(tmp_path / "disk", "256k") as disk:
        free = os.statvfs(disk)
        (disk / "filler").write_bytes(b"x" * (free.f_bavail * free.f_frsize - 4096))
        out = _cli(tmp_path, "label", f"policy={SMALL_LM}", "prompts.path=task:tiny-target/train", "num_samples=2",
                   "generation.max_new_tokens=4", "min_gap=0", f"output={disk / 'label' / 'pairs.jsonl'}")
        _one_error(out, f"cannot write {disk / 'label'}/pairs.", "No space left on device")
        assert os.listdir(disk) == ["filler"]


def test_every_file_a_pipeline_writes_has_the_umasks_mode_and_a_declared_name(tmp_path):
    """Every stage, run for real under umask 027: each file 0640 and folder 0750 (weights too: safetensors writes
    them 0600 on its own), and each stage writes only the names quartet.outputs.WRITES declares, which is what
    --overwrite checks and a re-run replaces."""
    from quartet.outputs import WRITES

    (tmp_path / "sft.jsonl").write_text(SFT_DATA * 4)
    out = tmp_path / "out"
    (tmp_path / "pipe.yaml").write_text(json.dumps({
        "output_dir": str(out), "task": "tiny-target", "stages": ["sft", "label", "rm", "ppo", "dpo", "eval"],
        "tracking": {"report_to": ["tensorboard"]},
        "sft": {"model": SMALL_LM, "data": {"path": "sft.jsonl", "chat_template": False}, "max_steps": 1,
                "precision": "fp32"},
        "label": {"num_samples": 4, "prompts": {"limit": 8}, "min_gap": 0.0,
                  "generation": {"max_new_tokens": 4, "batch_size": 32}},
        "rm": {"model": SMALL_LM, "max_steps": 1, "precision": "fp32", "normalize_samples": 4},
        "ppo": {"iterations": 2, "rollout_batch_size": 4, "minibatch_size": 4, "micro_batch_size": 4, "save_every": 1,
                "generation": {"max_new_tokens": 4, "batch_size": 4}, "precision": "fp32"},
        "dpo": {"max_steps": 1, "precision": "fp32", "kl_samples": 2, "generation": {"max_new_tokens": 4}},
        "eval": {"num_prompts": 2, "max_new_tokens": 4, "batch_size": 2},
    }))
    done = _cli(tmp_path, "run", "pipe.yaml", umask=0o027)
    assert done.returncode == 0, done.stderr[-3000:]
    modes = {str(p.relative_to(out)): stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*")}
    wrong = {p: oct(m) for p, m in modes.items() if m != (0o750 if (out / p).is_dir() else 0o640)}
    assert not wrong and any(p.endswith(".safetensors") for p in modes)
    assert {p.name for p in out.iterdir()} <= set(WRITES["pipeline"])
    for stage in ("sft", "rm", "ppo", "dpo", "eval"):
        undeclared = {p.name for p in (out / stage).iterdir()} - set(WRITES[stage])
        assert not undeclared, f"{stage} writes {undeclared}, not in quartet.outputs.WRITES"
    assert {p.name for p in (out / "label").iterdir()} == {f"preferences.{s}" for s in
                                                            ("jsonl", "samples.jsonl", "config.yaml", "summary.md")}
