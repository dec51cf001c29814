"""Experiment trackers with the real libraries, offline: W&B (WANDB_MODE=offline, read back from the run's
transaction log), MLflow (a file: store read back through its client), trackio (its local SQLite store).
Each gets a tiny SFT run, a tiny PPO run and a pipeline; a tracker that raises does not stop training."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import struct
import sys
import tempfile
from pathlib import Path

import pytest

from builders import tiny_ppo
from quartet.config import PPOConfig, SFTConfig, TrackingConfig, from_dict, load_config
from quartet.errors import ConfigError
from quartet.monitor import MetricsLogger, read_metrics
from quartet.monitor.metrics import RESERVED

sys.path.insert(0, str(Path(__file__).parents[1] / "trainers"))
from trainer_helpers import TINY, keyword_pairs, memorise_rows, single_thread, write_jsonl  # noqa: E402, F401

ALL = ["tensorboard", "wandb", "mlflow", "trackio"]
needs_all = pytest.mark.skipif(
    any(importlib.util.find_spec(n) is None for n in ALL[1:]),
    reason="needs the tracking extras: pip install 'quartet[tracking]'",
)
# trackio reads TRACKIO_DIR once, when it is first imported: point it at a scratch dir before any test does
# (removed when the session exits)
if "TRACKIO_DIR" not in os.environ:
    _TRACKIO_SCRATCH = tempfile.TemporaryDirectory(prefix="quartet-trackio-")
    os.environ["TRACKIO_DIR"] = _TRACKIO_SCRATCH.name


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Every tracker local and offline; returns the MLflow store URI."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 wants an opt-in for file: stores
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    yield f"file:{tmp_path / 'mlruns'}"
    if importlib.util.find_spec("mlflow") is not None:
        import mlflow

        while mlflow.active_run() is not None:
            mlflow.end_run()


def tracking(tmp_path, uri, report_to=ALL, **kw) -> dict:
    return {"report_to": list(report_to), "project": f"q-{tmp_path.name}"[:60], "experiment": tmp_path.name,
            "tracking_uri": uri, **kw}


# --------------------------------------------------------------------------- reading each tracker back
def wandb_runs(root: Path) -> list[dict]:
    """Each offline run under `root`: its run record (name, group, job type, config) and its history rows.
    The .wandb file is a LevelDB-style log of protobuf records (7-byte header, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = []
    for path in sorted(root.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, buf = path.read_bytes(), 7, b""
        assert data[:4] == b":W&B"
        run = {"history": []}
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
            if left < 7 or (length == 0 and kind == 0):
                pos += left
                continue
            buf, pos = buf + data[pos + 7 : pos + 7 + length], pos + 7 + length
            if kind not in (1, 4):  # FIRST / MIDDLE pieces of a record that spans blocks
                continue
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            which = rec.WhichOneof("record_type")
            if which == "run":
                r = rec.run
                config = {u.key: json.loads(u.value_json) for u in r.config.update}
                run.update(name=r.display_name, group=r.run_group, job=r.job_type, config=config)
            elif which == "artifact":
                files = sorted(e.path for e in rec.artifact.manifest.contents)
                run.setdefault("artifacts", []).append((rec.artifact.name, files))
            elif which == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                run["history"].append({k: v for k, v in items.items() if not k.startswith("_") or k == "_step"})
        runs.append(run)
    return runs


def mlflow_client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def mlflow_series(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def trackio_logs(project: str, run: str) -> list[dict]:
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_logs(project, run)


def jsonl_series(run_dir, key: str, finite: bool = True) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in read_metrics(run_dir) if key in r and (math.isfinite(r[key]) or not finite)]


def same(got: list[tuple[int, float]], expected: list[tuple[int, float]]) -> bool:
    """Same steps, same values (to float32 rounding: some trackers store float32)."""
    return [s for s, _ in got] == [s for s, _ in expected] and [v for _, v in got] == pytest.approx(
        [v for _, v in expected], rel=1e-6, nan_ok=True)


def assert_same_metrics(run_dir, wb: dict, client, mlflow_run, tio: list[dict]):
    """Every key of metrics.jsonl reaches each tracker with the same values at the same steps (MLflow and
    trackio: the finite ones; W&B: all, NaN included)."""
    records = read_metrics(run_dir)
    keys = {k for r in records for k in r if k not in RESERVED}  # the record's header, not metrics
    assert keys
    for key in keys:
        expected = jsonl_series(run_dir, key)
        assert same(mlflow_series(client, mlflow_run.info.run_id, key), expected), key
        assert same(sorted((r["step"], r[key]) for r in tio if key in r), expected), key
        got = sorted((h["_step"], float(h[key])) for h in wb["history"] if key in h)
        assert same(got, jsonl_series(run_dir, key, finite=False)), key


# --------------------------------------------------------------------------- config
def test_report_to_follows_transformers_convention(monkeypatch):
    assert TrackingConfig().trackers == ["tensorboard"]
    assert TrackingConfig(report_to="none").trackers == []
    assert TrackingConfig(report_to=[]).trackers == []
    assert TrackingConfig(report_to="tensorboard").trackers == ["tensorboard"]
    cfg = load_config(SFTConfig, None, ["tracking.report_to=[tensorboard, wandb]", "tracking.project=p"])
    assert cfg.tracking.trackers == ["tensorboard", "wandb"] and cfg.tracking.project == "p"
    with pytest.raises(ConfigError, match=r"^tracking.report_to: unknown tracker 'wandbb' \(choose from"):
        load_config(SFTConfig, None, ["tracking.report_to=wandbb"])
    with pytest.raises(ConfigError, match=r"^tracking.report_to: unknown tracker 'none'"):
        load_config(SFTConfig, None, ["tracking.report_to=[none, wandb]"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        load_config(PPOConfig, None, ["tracking.report_to=[mlflow]"])
    assert str(e.value) == "tracking.report_to: mlflow is not installed: pip install 'quartet[mlflow]'"


def test_no_tracker_means_jsonl_only(tmp_path):
    with MetricsLogger(tmp_path, "sft", tracking=TrackingConfig(report_to="none")) as log:
        log.log(1, {"sft/loss": 1.0})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


# --------------------------------------------------------------------------- stages
def sft_cfg(tmp_path, uri, **track) -> SFTConfig:
    data = write_jsonl(tmp_path / "demo.jsonl", memorise_rows())
    return from_dict(SFTConfig, {
        "model": TINY, "data": {"path": str(data), "chat_template": False}, "eval_fraction": 0.25,
        "output_dir": str(tmp_path / "sft"), "max_steps": 6, "batch_size": 4, "log_every": 2, "eval_every": 3,
        "optim": {"lr": 1e-2, "warmup_steps": 1}, "precision": "fp32",
        "tracking": tracking(tmp_path, uri, **track),
    })


@needs_all
def test_sft_run_reaches_wandb_mlflow_and_trackio(tmp_path, offline):
    from quartet.trainers.sft import train_sft

    cfg = sft_cfg(tmp_path, offline, run_name="tiny-sft")
    train_sft(cfg)
    run = tmp_path / "sft"
    assert (run / "tb").is_dir()
    [wb] = wandb_runs(run)  # the offline W&B run lives in the run directory
    assert (wb["name"], wb["job"]) == ("tiny-sft", "sft")
    assert wb["config"]["max_steps"] == 6 and wb["config"]["optim"]["lr"] == 1e-2
    client = mlflow_client(offline)
    [ml] = client.search_runs([client.get_experiment_by_name(tmp_path.name).experiment_id])
    assert ml.info.run_name == "tiny-sft" and ml.info.status == "FINISHED"
    assert ml.data.params["max_steps"] == "6" and ml.data.params["optim.lr"] == "0.01"
    tio = trackio_logs(cfg.tracking.project, "tiny-sft")
    assert_same_metrics(run, wb, client, ml, tio)
    assert [s for s, _ in jsonl_series(run, "sft/loss")] == [2, 4, 6]


def ppo_cfg(tmp_path, uri, **track) -> PPOConfig:
    return tiny_ppo(tmp_path, iterations=2, rollout_batch_size=8, minibatch_size=8, micro_batch_size=8, ppo_epochs=1,
                    tracking=tracking(tmp_path, uri, **track),
                    **{"generation.max_new_tokens": 4, "generation.batch_size": 8, "optim.lr": 1e-3,
                       "optim.adam_eps": 1e-5})


def _ppo_passes_tracking() -> bool:
    import inspect

    from quartet.trainers.ppo import PPOTrainer

    return "tracking=" in inspect.getsource(PPOTrainer.train)


@needs_all
@pytest.mark.xfail(not _ppo_passes_tracking(), strict=True,
                   reason="trainers/ppo.py does not pass cfg.tracking to its MetricsLogger yet (issue 17)")
def test_ppo_run_reaches_wandb_mlflow_and_trackio(tmp_path, offline):
    from quartet.trainers.ppo import train_ppo

    cfg = ppo_cfg(tmp_path, offline, run_name="tiny-ppo")
    train_ppo(cfg, progress=False)
    run = tmp_path / "ppo"
    [wb] = wandb_runs(run)
    assert (wb["name"], wb["job"]) == ("tiny-ppo", "ppo") and wb["config"]["iterations"] == 2
    client = mlflow_client(offline)
    [ml] = client.search_runs([client.get_experiment_by_name(tmp_path.name).experiment_id])
    assert ml.data.params["kl_coef"] == "0.05" and ml.data.params["generation.max_new_tokens"] == "4"
    tio = trackio_logs(cfg.tracking.project, "tiny-ppo")
    assert_same_metrics(run, wb, client, ml, tio)
    assert [s for s, _ in jsonl_series(run, "objective/score")] == [1, 2]


@needs_all
def test_dpo_run_reaches_wandb_mlflow_and_trackio(tmp_path, offline):
    from quartet.config import DPOConfig
    from quartet.trainers.dpo import train_dpo

    pairs = write_jsonl(tmp_path / "pairs.jsonl", keyword_pairs(16))
    cfg = from_dict(DPOConfig, {
        "policy": TINY, "data": {"path": str(pairs)}, "eval_fraction": 0.25, "output_dir": str(tmp_path / "dpo"),
        "max_steps": 4, "batch_size": 4, "log_every": 2, "eval_every": 2, "kl_samples": 0, "precision": "fp32",
        "optim": {"lr": 1e-3}, "tracking": tracking(tmp_path, offline, run_name="tiny-dpo"),
    })
    train_dpo(cfg)
    run = tmp_path / "dpo"
    [wb] = wandb_runs(run)
    assert (wb["name"], wb["job"]) == ("tiny-dpo", "dpo") and wb["config"]["beta"] == 0.1
    client = mlflow_client(offline)
    [ml] = client.search_runs([client.get_experiment_by_name(tmp_path.name).experiment_id])
    assert ml.data.params["loss"] == "sigmoid"
    assert_same_metrics(run, wb, client, ml, trackio_logs(cfg.tracking.project, "tiny-dpo"))
    assert [s for s, _ in jsonl_series(run, "dpo/loss")] == [2, 4]


# --------------------------------------------------------------------------- failures and processes
@needs_all
def test_a_tracker_that_raises_mid_run_is_dropped_once_and_training_goes_on(tmp_path, offline, monkeypatch, caplog):
    import mlflow
    from mlflow.exceptions import MlflowException

    from quartet.trainers.sft import train_sft

    calls = []

    def quota(*args, **kwargs):
        calls.append(1)
        raise MlflowException("RESOURCE_EXHAUSTED: metric quota exceeded")

    monkeypatch.setattr(mlflow, "log_metrics", quota)
    cfg = sft_cfg(tmp_path, offline, report_to=["tensorboard", "mlflow", "wandb"])
    with caplog.at_level(logging.WARNING, logger="quartet"):
        result = train_sft(cfg)
    assert result.steps == 6 and (tmp_path / "sft" / "model").is_dir()
    assert len(calls) == 1  # tried once, then left alone
    warnings = [r.getMessage() for r in caplog.records if "mlflow failed" in r.getMessage()]
    assert len(warnings) == 1 and "RESOURCE_EXHAUSTED" in warnings[0]
    # the other sinks have every step
    assert [s for s, _ in jsonl_series(tmp_path / "sft", "sft/loss")] == [2, 4, 6]
    [wb] = wandb_runs(tmp_path / "sft")
    assert sorted(h["_step"] for h in wb["history"] if "sft/loss" in h) == [2, 4, 6]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "sft" / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("sft/loss")] == [2, 4, 6]


@needs_all
def test_a_tracker_that_cannot_start_is_one_config_error_before_training(tmp_path, offline, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # MLflow 3 then refuses the file: store
    with pytest.raises(ConfigError) as e:
        MetricsLogger(tmp_path, "sft", tracking=from_dict(TrackingConfig, tracking(tmp_path, offline)))
    msg = str(e.value)
    assert msg.startswith("tracking.report_to: mlflow could not start a run (MlflowException: ") and "\n" not in msg
    [wb] = wandb_runs(tmp_path)  # the W&B run opened before it was closed again
    assert wb["history"] == []


@needs_all
def test_a_run_that_raises_is_marked_failed(tmp_path, offline):
    cfg = from_dict(TrackingConfig, tracking(tmp_path, offline, report_to=["mlflow"], run_name="boom"))
    with pytest.raises(KeyboardInterrupt), MetricsLogger(tmp_path, "ppo", tracking=cfg) as log:
        log.log(1, {"objective/score": 0.5})
        raise KeyboardInterrupt
    client = mlflow_client(offline)
    [run] = client.search_runs([client.get_experiment_by_name(tmp_path.name).experiment_id])
    assert run.info.status == "FAILED" and run.data.metrics == {"objective/score": 0.5}


@needs_all
def test_only_the_main_process_reports(tmp_path, offline, monkeypatch):
    import quartet.monitor.tracking as tracking_module

    monkeypatch.setattr(tracking_module, "is_main_process", lambda: False)
    with MetricsLogger(tmp_path, "ppo", tracking=from_dict(TrackingConfig, tracking(tmp_path, offline))) as log:
        log.log(1, {"objective/score": 0.5})
        assert not log._trackers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "tb"]  # no wandb/, no mlruns/


# --------------------------------------------------------------------------- pipeline
@needs_all
def test_pipeline_stages_share_one_group_and_a_parent_run_with_the_report(tmp_path, offline, monkeypatch):
    from quartet.pipeline import load_pipeline, run_pipeline

    sft = write_jsonl(tmp_path / "demo.jsonl", memorise_rows())
    pairs = write_jsonl(tmp_path / "pairs.jsonl", keyword_pairs(16))
    (tmp_path / "pipe.yaml").write_text(json.dumps({
        "output_dir": str(tmp_path / "demo"), "task": "tiny-target", "stages": ["sft", "rm"],
        "tracking": tracking(tmp_path, offline),
        "sft": {"model": TINY, "data": {"path": str(sft), "chat_template": False}, "eval_fraction": 0.25,
                "max_steps": 2, "batch_size": 4, "log_every": 1, "precision": "fp32"},
        "rm": {"model": TINY, "data": {"path": str(pairs)}, "eval_fraction": 0.25, "max_steps": 2,
               "batch_size": 4, "log_every": 1, "precision": "fp32", "normalize_samples": 4,
               "normalize_generation": {"max_new_tokens": 4, "batch_size": 4}},
    }))
    cfg = load_pipeline(str(tmp_path / "pipe.yaml"))
    assert (cfg.sft.tracking.run_name, cfg.sft.tracking.group) == ("demo-sft", "demo")
    run_pipeline(cfg)
    out = tmp_path / "demo"

    client = mlflow_client(offline)
    runs = client.search_runs([client.get_experiment_by_name(tmp_path.name).experiment_id])
    by_name = {r.info.run_name: r for r in runs}
    assert set(by_name) == {"demo", "demo-sft", "demo-rm"}
    parent = by_name["demo"]
    for stage in ("sft", "rm"):
        child = by_name[f"demo-{stage}"]
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.tags["quartet.group"] == "demo"
    assert parent.data.params["stages"] == "['sft', 'rm']" and parent.data.params["sft.max_steps"] == "2"
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"report.html", "pipeline.yaml"} <= artifacts
    local = client.download_artifacts(parent.info.run_id, "report.html", str(tmp_path))
    assert Path(local).read_bytes() == (out / "report.html").read_bytes()
    assert same(mlflow_series(client, by_name["demo-rm"].info.run_id, "rm/loss"), jsonl_series(out / "rm", "rm/loss"))

    wb = {r["name"]: r for r in wandb_runs(out / "sft") + wandb_runs(out / "rm") + wandb_runs(out)}
    assert {n: (r["group"], r["job"]) for n, r in wb.items()} == {
        "demo-sft": ("demo", "sft"), "demo-rm": ("demo", "rm"), "demo": ("demo", "pipeline")}
    assert wb["demo"]["config"]["sft"]["max_steps"] == 2

    from trackio.sqlite_storage import SQLiteStorage

    project = cfg.tracking.project
    assert set(SQLiteStorage.get_runs(project)) == {"demo-sft", "demo-rm", "demo"}
    assert SQLiteStorage.get_run_config(project, "demo-rm")["_Group"] == "demo"


@needs_all
def test_pipeline_run_gets_the_eval_table_and_files_in_every_tracker(tmp_path, offline):
    from quartet.monitor.tracking import PipelineTracking

    cfg = from_dict(TrackingConfig, tracking(tmp_path, offline, run_name="p", group="p"))
    (tmp_path / "report.html").write_text("<html><body>report</body></html>")
    (tmp_path / "summary.md").write_text("# summary\n")
    table = (["checkpoint", "gold"], [["sft", 0.25], ["ppo", 0.75]])
    with PipelineTracking(cfg, tmp_path, params={"task": "tiny-target", "sft": {"max_steps": 2}}) as run:
        run.attach([tmp_path / "report.html", tmp_path / "summary.md", tmp_path / "missing.json"], table)

    client = mlflow_client(offline)
    [parent] = client.search_runs([client.get_experiment_by_name(tmp_path.name).experiment_id])
    assert parent.info.status == "FINISHED" and parent.data.params == {"task": "tiny-target", "sft.max_steps": "2"}
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {"report.html", "summary.md",
                                                                          "eval_table.json"}
    saved = client.download_artifacts(parent.info.run_id, "eval_table.json", str(tmp_path / "dl"))
    saved = json.loads(Path(saved).read_text())
    assert saved == {"columns": table[0], "data": table[1]}

    [wb] = wandb_runs(tmp_path)
    assert (wb["name"], wb["group"], wb["job"]) == ("p", "p", "pipeline")
    logged = {k for h in wb["history"] for k in h}
    assert {"eval/_type", "report/_type"} <= logged  # media are logged as references to files of the run
    assert ("p-outputs", ["report.html", "summary.md"]) in wb["artifacts"]
    media = list(tmp_path.glob("wandb/offline-run-*/files/media/table/eval_*.table.json"))
    assert [json.loads(m.read_text())["data"] for m in media] == [table[1]]

    tio = trackio_logs(cfg.project, "p")
    assert any("eval" in row for row in tio)
    from trackio.sqlite_storage import SQLiteStorage

    assert SQLiteStorage.get_run_config(cfg.project, "p")["task"] == "tiny-target"


def test_eval_table_is_one_row_per_checkpoint(tmp_path):
    from quartet.pipeline import eval_table

    path = tmp_path / "eval.json"
    ci = {"mean": 0.5, "lo": 0.4, "hi": 0.6}
    path.write_text(json.dumps({"checkpoints": {
        "runs/demo/sft/model": {"gold": ci, "rm": None, "eos_rate": 1.0},
        "runs/demo/ppo/model": {"gold": dict(ci, mean=0.7), "rm": None, "eos_rate": 0.5, "win_rate": 0.75},
        "smollm2-135m-instruct": {"gold": dict(ci, mean=0.1), "rm": None, "eos_rate": 0.25},
    }}))
    columns, rows = eval_table(path)
    assert columns == ["checkpoint", "eos_rate", "gold", "win_rate"]
    assert rows == [["sft", 1.0, 0.5, None], ["ppo", 0.5, 0.7, 0.75], ["smollm2-135m-instruct", 0.25, 0.1, None]]
    assert eval_table(tmp_path / "missing.json") is None
