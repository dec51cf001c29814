"""Metric sinks: metrics.jsonl (always), TensorBoard (default), W&B / MLflow / trackio (extras, tracking.py).

A run directory holds one JSON object per logged step in ``metrics.jsonl``:
``{"stage": "ppo", "step": 12, "time": 1732300000.0, "objective/score": 0.41, ...}`` (docs/CONTRACTS.md).
Lines are flushed as they are written, so a crashed run keeps everything up to its last step, and a resumed
run appends to the same file. Non-finite values are kept (written as ``NaN`` / ``Infinity``, which Python's
json reads back) because the doctor needs to see them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path

from quartet.atomic import write_failure
from quartet.config import TrackingConfig
from quartet.errors import DataError, OutputError
from quartet.monitor.tracking import open_trackers

log = logging.getLogger("quartet")

RESERVED = ("stage", "algorithm", "step", "time")
PIPELINE_ORDER = ("sft", "label", "rm", "ppo", "dpo", "eval")


def _to_number(value):
    """Python number from a float / int / bool / 0-d tensor / numpy scalar; anything else is returned as is."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    item = getattr(value, "item", None)
    if item is not None and getattr(value, "ndim", 0) == 0:
        return item()
    return value


class MetricsLogger:
    """Write each step's metrics to metrics.jsonl and to the trackers of `tracking.report_to`.

    ``tracking`` (a TrackingConfig; default: TensorBoard only) picks the sinks; ``tensorboard`` overrides
    its choice of TensorBoard. ``params`` (the stage config) is logged as the trackers' run parameters.
    W&B / MLflow / trackio live in quartet.monitor.tracking: imported only when named, on the main process
    only, and a tracker that fails while logging is dropped with one warning while the others go on.
    """

    def __init__(self, run_dir, stage: str, tensorboard: bool | None = None, tracking=None, params=None,
                 algorithm: str | None = None):
        self.run_dir = Path(run_dir)
        self.stage = str(stage)
        self.algorithm = algorithm
        """written into each record beside `stage` when the stage runs one of several algorithms (the ppo stage:
        ppo, grpo, rloo, ...): `stage` stays what code keys on, `algorithm` is what ran"""
        tracking = tracking if tracking is not None else TrackingConfig()
        tracking.validate()
        if tensorboard is None:
            tensorboard = "tensorboard" in tracking.trackers
        self.path = self.run_dir / "metrics.jsonl"
        self._tensorboard, self._file, self._tb, self._closed = tensorboard, None, None, False
        # the trackers start now, so one that cannot fails before any training; metrics.jsonl and tb/ are opened
        # by the first record, so a run that fails before its first result leaves neither (quartet.outputs)
        self._trackers = open_trackers(tracking, self.stage, self.run_dir, params)

    def _open(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        needs_newline = _ends_mid_line(self.path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        if needs_newline:  # a crash mid-write left a partial last line: start ours on a fresh one
            self._file.write("\n")
        if self._tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tb"), flush_secs=10)

    def log(self, step: int, metrics: dict) -> dict:
        """Append one record for ``step``; returns the record as written."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log() after close()")
        clash = [k for k in metrics if k in RESERVED]
        if clash:
            raise ValueError(f"metric names {clash} are reserved for the record header")
        values = {str(k): _to_number(v) for k, v in metrics.items()}
        header = {"stage": self.stage} if self.algorithm is None else {"stage": self.stage, "algorithm": self.algorithm}
        record = {**header, "step": int(step), "time": time.time(), **values}
        try:
            if self._file is None:
                self._open()
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as e:  # a full disk: one line naming the file (the lines before it are whole)
            if (reason := write_failure(e)) is None:
                raise
            raise OutputError(self.path, reason) from None
        numbers = {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, int(step))
        self._trackers.log(numbers, int(step))
        return record

    def close(self, failed: bool = False) -> None:
        """Flush and close every sink; `failed` marks the tracker runs failed (W&B, MLflow)."""
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self._trackers.finish(failed)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failed=exc_type is not None)


def _ends_mid_line(path: Path) -> bool:
    if not path.is_file() or path.stat().st_size == 0:
        return False
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def read_metrics(run_dir, stage: str | None = None, warn: bool = True) -> list[dict]:
    """Records of ``run_dir/metrics.jsonl`` in file order, optionally only one stage's.

    A last line cut short by a crash is skipped; a broken line elsewhere is a DataError naming it.
    When a resumed run logs a step lower than one already logged for its stage, the earlier records
    from that step on are dropped: they belong to iterations the resume discarded.
    A missing file gives an empty list. Values of the wrong type (text or lists where numbers belong, a
    step that is not a whole number) are left out with one warning naming them (``warn``), so the
    report and the doctor only ever see numbers.
    """
    path = Path(run_dir)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records: list[dict] = []
    notes: list[str] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("not an object")
        except ValueError:
            if i == last or (i + 1 < len(lines) and _is_cut_line(line, lines[i + 1])):
                continue
            raise DataError(f"{path} line {i + 1}: not a JSON object") from None
        rec = _clean_record(rec, i + 1, notes)
        if rec is not None:
            records.append(rec)
    if notes and warn:
        shown = "; ".join(notes[:3]) + (f"; and {len(notes) - 3} more" if len(notes) > 3 else "")
        log.warning("%s: ignored %d value(s) of the wrong type: %s", path, len(notes), shown)
    records = _drop_rewound(records)
    if stage is not None:
        records = [r for r in records if r.get("stage") == stage]
    return records


MAX_STEP = 2**53
"""steps are integers a float holds exactly"""


def _clean_record(rec: dict, lineno: int, notes: list[str]) -> dict | None:
    """``rec`` with every value of the wrong type left out and noted: a metric is a number or null, `stage`
    (and `algorithm`) is text, `step` a whole number in [0, 2**53]. A record whose stage or step is unusable is left out whole."""
    stage, step = rec.get("stage"), rec.get("step")
    if "stage" in rec and not isinstance(stage, str):
        notes.append(f"line {lineno}: stage {_short(stage)} is not text (record left out)")
        return None
    if "step" in rec and not (_is_number(step) and float(step).is_integer() and 0 <= step <= MAX_STEP):
        notes.append(f"line {lineno}: step {_short(step)} is not a whole number >= 0 (record left out)")
        return None
    out = {}
    for key, value in rec.items():
        if key in ("stage", "step") or value is None or _is_number(value) or (
                key == "algorithm" and isinstance(value, str)):
            out[key] = value
        else:
            notes.append(f"line {lineno}: {key} = {_short(value)} is not a number")
    return out


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_cut_line(line: str, following: str) -> bool:
    # a line cut by a crash, after which a resumed run wrote a fresh line
    cut = line.lstrip().startswith("{") and not line.rstrip().endswith("}")
    return cut and following.lstrip().startswith("{")


def _drop_rewound(records: list[dict]) -> list[dict]:
    out: list[dict] = []
    top: dict = {}
    for rec in records:
        stage, step = rec.get("stage"), rec.get("step")
        if isinstance(step, (int, float)):
            if stage in top and step < top[stage]:
                out = [r for r in out if not (r.get("stage") == stage and r.get("step", -1) >= step)]
                top[stage] = step
            else:
                top[stage] = max(top.get(stage, step), step)
        out.append(rec)
    return out


def stage_dirs(run_dir) -> list[tuple[str, Path]]:
    """The run directories under ``run_dir``: itself when it holds metrics.jsonl, plus each direct
    subdirectory that does (a pipeline directory: sft/, rm/, ppo/), then those of a pipeline's later rounds
    (rounds/2/rm/, ...). Pipeline stages come first, in order."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DataError(f"{run_dir}: run directory not found")
    found = []
    if (run_dir / "metrics.jsonl").is_file():
        found.append((_stage_name(run_dir), run_dir))
    subs = [d for d in sorted(run_dir.iterdir()) if d.is_dir() and (d / "metrics.jsonl").is_file()]
    order = {name: i for i, name in enumerate(PIPELINE_ORDER)}
    subs.sort(key=lambda d: (order.get(d.name, len(order)), d.name))
    found.extend((d.name, d) for d in subs)
    # a pipeline's rounds after the first (`rounds: N`): rounds/<k>/<stage>, named `<stage> (round <k>)`
    rounds = run_dir / "rounds"
    ks = sorted(int(d.name) for d in rounds.iterdir() if d.is_dir() and d.name.isdigit()) if rounds.is_dir() else []
    for k in ks:
        subs = [d for d in (rounds / str(k)).iterdir() if d.is_dir() and (d / "metrics.jsonl").is_file()]
        subs.sort(key=lambda d: (order.get(d.name, len(order)), d.name))
        found.extend((f"{d.name} (round {k})", d) for d in subs)
    return found


def _stage_name(run_dir: Path) -> str:
    for rec in read_metrics(run_dir, warn=False)[:1]:
        if rec.get("stage"):
            return str(rec["stage"])
    return run_dir.name


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB (getrusage; psutil where `resource` is missing)."""
    try:
        import resource
    except ImportError:  # Windows
        import psutil

        info = psutil.Process().memory_info()
        return float(getattr(info, "peak_wset", info.rss)) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


# --------------------------------------------------------------------------- progress line
DEFAULT_PROGRESS_KEYS = {
    "objective/score": "score",
    "objective/kl": "kl",
    "rollout/length_mean": "len",
    "policy/entropy": "entropy",
}


def _fmt(value) -> str:
    if not isinstance(value, (int, float)):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


class Progress:
    """A progress bar with the few numbers a person watches (score, kl, len, entropy by default).

    On a terminal it is a tqdm bar. Anywhere else (CI logs, files) it prints one plain line every
    ``every`` updates, and at the last one, so logs stay short. ``keys`` maps metric key -> short label.
    """

    def __init__(self, total: int | None = None, desc: str = "", keys=None, every: int = 10, file=None):
        self.total = total
        self.desc = desc
        if keys is None:
            keys = DEFAULT_PROGRESS_KEYS
        # metric key -> short label; a plain list of keys is labelled by each key's last part
        self.keys = dict(keys) if isinstance(keys, dict) else {k: k.rsplit("/", 1)[-1] for k in keys}
        self.every = max(1, int(every))
        self.file = file if file is not None else sys.stderr
        self.count = 0
        self.start = time.time()
        self._last_line = -1
        self._last: tuple = (None, {})
        self._bar = None
        if getattr(self.file, "isatty", lambda: False)():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, file=self.file, dynamic_ncols=True)

    def summary(self, metrics: dict) -> str:
        parts = []
        for key, label in self.keys.items():
            if key in metrics:
                parts.append(f"{label} {_fmt(_to_number(metrics[key]))}")
        return " | ".join(parts)

    def update(self, step: int | None = None, metrics: dict | None = None, n: int = 1) -> None:
        self.count += n
        self._last = (step, metrics or {})
        text = self.summary(metrics or {})
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(n)
        elif self.count // self.every > (self.count - n) // self.every or (
            self.total is not None and self.count >= self.total
        ):  # crossed a multiple of `every` (updates may advance by more than one), or reached the end
            self._print_line()

    def _print_line(self) -> None:
        step, metrics = self._last
        where = f"{self.count}/{self.total}" if self.total else f"{self.count}"
        label = f"{self.desc} " if self.desc else ""
        text = self.summary(metrics)
        elapsed = time.time() - self.start
        print(f"{label}{where} [{elapsed:.0f}s]" + (f" {text}" if text else ""), file=self.file, flush=True)
        self._last_line = self.count

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.count > 0 and self._last_line != self.count:
            self._print_line()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
