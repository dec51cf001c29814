"""MetricsLogger, read_metrics, peak_rss_mb and Progress."""

import importlib.util
import io
import json
import math

import pytest
import torch

from quartet.config import TrackingConfig
from quartet.errors import ConfigError, DataError
from quartet.monitor.metrics import MetricsLogger, Progress, peak_rss_mb, read_metrics, stage_dirs


def test_log_appends_one_flushed_line_per_step(tmp_path):
    with MetricsLogger(tmp_path, "ppo", tensorboard=False) as log:
        log.log(1, {"objective/score": 0.5, "policy/clipfrac": torch.tensor(0.25), "rollout/eos_rate": 1})
        # flushed: readable before close
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 1
        rec = json.loads(lines[0])
        assert list(rec)[:3] == ["stage", "step", "time"]
        assert rec["stage"] == "ppo" and rec["step"] == 1 and rec["policy/clipfrac"] == 0.25
        assert isinstance(rec["time"], float)
        log.log(2, {"objective/score": float("nan")})
    recs = read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 2]
    assert math.isnan(recs[1]["objective/score"])


def test_reserved_names_are_rejected(tmp_path):
    with MetricsLogger(tmp_path, "sft", tensorboard=False) as log, pytest.raises(ValueError, match="reserved"):
        log.log(1, {"step": 3})


def test_resumed_run_appends_after_a_cut_line(tmp_path):
    with MetricsLogger(tmp_path, "ppo", tensorboard=False) as log:
        log.log(1, {"objective/kl": 0.1})
        log.log(2, {"objective/kl": 0.2})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"stage": "ppo", "step": 3, "objective/k')  # the crash
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]  # cut last line tolerated
    with MetricsLogger(tmp_path, "ppo", tensorboard=False) as log:  # resume from the checkpoint at step 2
        log.log(3, {"objective/kl": 0.3})
    assert [(r["step"], r["objective/kl"]) for r in read_metrics(tmp_path)] == [(1, 0.1), (2, 0.2), (3, 0.3)]


def test_read_metrics_drops_steps_a_resume_rewound(tmp_path):
    rows = [("ppo", 1), ("ppo", 2), ("ppo", 3), ("ppo", 4), ("ppo", 3), ("ppo", 4), ("ppo", 5)]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"stage": s, "step": k, "v": i}) + "\n" for i, (s, k) in enumerate(rows))
    )
    recs = read_metrics(tmp_path)
    assert [(r["step"], r["v"]) for r in recs] == [(1, 0), (2, 1), (3, 4), (4, 5), (5, 6)]


def test_read_metrics_filters_stage_and_rejects_a_broken_middle_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"stage": "sft", "step": 1}\n{"stage": "rm", "step": 1}\n')
    assert read_metrics(tmp_path, stage="rm") == [{"stage": "rm", "step": 1}]
    assert read_metrics(tmp_path / "missing") == []
    path.write_text('{"stage": "sft", "step": 1}\n[1, 2]\n{"stage": "sft", "step": 2}\n')
    with pytest.raises(DataError, match="line 2: not a JSON object"):
        read_metrics(path)


def test_tensorboard_events_hold_the_same_keys(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, "ppo") as log:
        for step in range(3):
            log.log(step, {"objective/score": step / 10, "objective/kl": 1.0})
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"objective/score", "objective/kl"}
    assert [round(e.value, 6) for e in acc.Scalars("objective/score")] == [0.0, 0.1, 0.2]


@pytest.mark.parametrize("extra", ["wandb", "mlflow", "trackio"])
def test_missing_extra_is_one_line_config_error(tmp_path, extra, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == extra else real(name, *a))
    with pytest.raises(ConfigError) as e:
        MetricsLogger(tmp_path, "ppo", tracking=TrackingConfig(report_to=["tensorboard", extra]))
    assert str(e.value) == f"tracking.report_to: {extra} is not installed: pip install 'quartet[{extra}]'"
    assert not (tmp_path / "tb").exists()


def test_stage_dirs_orders_a_pipeline(tmp_path):
    for name in ("ppo", "rm", "sft", "notes"):
        (tmp_path / name).mkdir()
    for name in ("ppo", "rm", "sft"):
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps({"stage": name, "step": 1}) + "\n")
    assert [n for n, _ in stage_dirs(tmp_path)] == ["sft", "rm", "ppo"]
    assert stage_dirs(tmp_path / "ppo") == [("ppo", tmp_path / "ppo")]
    with pytest.raises(DataError):
        stage_dirs(tmp_path / "missing")


def test_peak_rss_is_plausible():
    before = peak_rss_mb()
    block = bytearray(64 * 2**20)  # touch 64 MiB
    block[:: 4096] = b"x" * len(block[::4096])
    assert 10 < before <= peak_rss_mb() < 1_000_000


def test_progress_prints_one_line_per_n_steps_off_a_terminal():
    out = io.StringIO()
    with Progress(total=12, desc="ppo", every=5, file=out) as bar:
        for step in range(1, 13):
            bar.update(step, {"objective/score": 0.5, "objective/kl": 1.234, "policy/entropy": 2.0, "x": 1})
    lines = out.getvalue().splitlines()
    assert len(lines) == 3  # steps 5, 10 and the last one
    assert lines[0].startswith("ppo 5/12 [")
    assert lines[-1].startswith("ppo 12/12")
    assert "score 0.5 | kl 1.23 | entropy 2.00" in lines[-1] and "x" not in lines[-1].split("]")[1]


def test_progress_custom_keys_and_tty():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    with Progress(total=3, keys=["sft/loss"], file=out) as bar:
        for step in range(3):
            bar.update(step, {"sft/loss": 0.75})
    assert "loss 0.75" in out.getvalue()
    quiet = io.StringIO()
    Progress(file=quiet).close()
    assert quiet.getvalue() == ""


def test_progress_counts_updates_of_several_items():
    out = io.StringIO()
    with Progress(total=10, desc="label", every=4, file=out) as bar:
        for n in (3, 3, 3, 1):  # crosses 4 and 8, then reaches the total
            bar.update(None, {"label/pairs": 2}, n=n)
    assert [line.split(" [")[0] for line in out.getvalue().splitlines()] == ["label 6/10", "label 9/10", "label 10/10"]
