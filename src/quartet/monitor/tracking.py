"""Experiment trackers: W&B, MLflow and trackio behind one small interface (TensorBoard lives in metrics.py).

Each library is imported here, and only when a config names it in `tracking.report_to`.

- A stage's `MetricsLogger` opens one run per tracker: the stage config as its parameters, then every
  logged step under the same keys as metrics.jsonl (MLflow and trackio get the finite values only).
- `quartet run` puts the stages of one pipeline together: W&B and trackio runs share a group; MLflow
  runs nest under a parent run. A pipeline run (the MLflow parent, a W&B / trackio run of job "pipeline")
  holds the resolved pipeline config, the eval table and the HTML report.
- Only the main process of a multi-process launch reports.
- A tracker that cannot start raises ConfigError before training; one that raises later (network,
  quota) is reported once and dropped, and metrics.jsonl / TensorBoard go on.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from pathlib import Path

from quartet.config import TrackingConfig
from quartet.errors import ConfigError

log = logging.getLogger("quartet")
Table = tuple[list[str], list[list]]
"""(columns, rows): a small table such as the eval summary, one row per checkpoint"""


def import_tracker(name: str):
    try:
        return __import__(name)
    except ImportError:
        raise ConfigError(f"tracking.report_to: {name} is not installed: pip install 'quartet[{name}]'") from None


def is_main_process() -> bool:
    """True off a multi-process launch, and on its rank 0 (accelerate's view of the launch)."""
    from accelerate import PartialState

    return PartialState().is_main_process


# --------------------------------------------------------------------------- one tracker's run
class _Run:
    """One run in one tracker. `log` gets plain floats; `attach` files and a table (pipeline runs)."""

    name = ""

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def attach(self, files: list[Path], table: Table | None) -> None:
        raise NotImplementedError

    def finish(self, failed: bool = False) -> None:
        raise NotImplementedError


class _WandbRun(_Run):
    name = "wandb"

    def __init__(self, tracking: TrackingConfig, job: str, run_dir: Path | None, params: dict | None):
        self.wandb = import_tracker("wandb")
        kwargs = dict(
            project=tracking.project or os.environ.get("WANDB_PROJECT") or "quartet",
            name=tracking.run_name, group=tracking.group, job_type=job, config=params,
            reinit="create_new",  # a pipeline's stage runs and its pipeline run are separate runs
        )
        if run_dir is not None and not os.environ.get("WANDB_DIR"):
            kwargs["dir"] = str(run_dir)
        self.run = self.wandb.init(**kwargs)

    def log(self, metrics, step):
        self.run.log(metrics, step=step)

    def attach(self, files, table):
        if table is not None:
            self.run.log({"eval": self.wandb.Table(columns=table[0], data=table[1])})
        html = [f for f in files if f.suffix == ".html"]
        if html:
            self.run.log({"report": self.wandb.Html(html[0].read_text(encoding="utf-8"))})
        artifact = self.wandb.Artifact(_artifact_name(self.run.name or "quartet", "outputs"), type="report")
        for f in files:
            artifact.add_file(str(f))
        self.run.log_artifact(artifact)

    def finish(self, failed=False):
        self.run.finish(exit_code=1 if failed else 0)


class _MlflowRun(_Run):
    name = "mlflow"

    def __init__(self, tracking: TrackingConfig, job: str, run_dir: Path | None, params: dict | None):
        self.mlflow = mlflow = import_tracker("mlflow")
        if tracking.tracking_uri:
            mlflow.set_tracking_uri(tracking.tracking_uri)
        if tracking.experiment:
            mlflow.set_experiment(tracking.experiment)
        tags = {"quartet.job": job}
        if tracking.group:
            tags["quartet.group"] = tracking.group
        # the fluent API keeps a stack of active runs: a stage started inside `quartet run` nests under it
        parent = mlflow.active_run()
        self.run = mlflow.start_run(run_name=tracking.run_name, nested=parent is not None, tags=tags)
        self.run_id = self.run.info.run_id
        flat = _flatten(params or {})
        items = list(flat.items())
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per call
            mlflow.log_params(dict(items[i : i + 100]), run_id=self.run_id)

    def log(self, metrics, step):
        finite = {k: v for k, v in metrics.items() if math.isfinite(v)}
        if finite:
            self.mlflow.log_metrics(finite, step=step, run_id=self.run_id)

    def attach(self, files, table):
        if table is not None:
            self.mlflow.log_dict({"columns": table[0], "data": table[1]}, "eval_table.json", run_id=self.run_id)
        for f in files:
            self.mlflow.log_artifact(str(f), run_id=self.run_id)

    def finish(self, failed=False):
        status = "FAILED" if failed else "FINISHED"
        active = self.mlflow.active_run()
        if active is not None and active.info.run_id == self.run_id:
            self.mlflow.end_run(status)
        else:
            self.mlflow.MlflowClient().set_terminated(self.run_id, status)


class _TrackioRun(_Run):
    name = "trackio"

    def __init__(self, tracking: TrackingConfig, job: str, run_dir: Path | None, params: dict | None):
        self.trackio = import_tracker("trackio")
        project = tracking.project or os.environ.get("TRACKIO_PROJECT") or "quartet"
        self.run = self.trackio.init(project=project, name=tracking.run_name, group=tracking.group,
                                     config=params, embed=False)

    def log(self, metrics, step):
        finite = {k: v for k, v in metrics.items() if math.isfinite(v)}
        if finite:
            self.run.log(finite, step=step)

    def attach(self, files, table):
        if table is not None:
            self.run.log({"eval": self.trackio.Table(columns=table[0], data=table[1])})
        for f in files:
            self.run.log_artifact(str(f), name=_artifact_name(self.run.name or "quartet", f.name), type="report")

    def finish(self, failed=False):  # trackio runs have no status
        if self.trackio.context_vars.current_run.get() is self.run:
            self.trackio.finish()  # also clears trackio's current run, so the next init starts clean
        else:
            self.run.finish()


RUNS = {"wandb": _WandbRun, "mlflow": _MlflowRun, "trackio": _TrackioRun}


# --------------------------------------------------------------------------- the set of a stage's runs
class Trackers:
    """The tracker runs of one stage (or pipeline). Every call goes to each live run; a run that raises
    is reported once, as a warning, and dropped for the rest of the run."""

    def __init__(self, runs: list[_Run] | None = None):
        self.runs = list(runs or [])

    def __bool__(self) -> bool:
        return bool(self.runs)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._each("log", metrics, step)

    def attach(self, files: list[Path], table: Table | None = None) -> None:
        self._each("attach", [Path(f) for f in files if Path(f).is_file()], table)

    def finish(self, failed: bool = False) -> None:
        """End every run; `failed` marks them failed where the tracker has a status (W&B, MLflow)."""
        self._each("finish", failed)
        self.runs = []

    def _each(self, method: str, *args) -> None:
        for run in list(self.runs):
            try:
                getattr(run, method)(*args)
            except Exception as e:  # a tracker's failure (network, quota, disk) must not end training
                self.runs.remove(run)
                log.warning(
                    "warning: %s failed in %s (%s: %s); it is off for the rest of this run, "
                    "metrics.jsonl and TensorBoard go on", run.name, method, type(e).__name__, _first_line(e),
                )


def open_trackers(tracking: TrackingConfig | None, job: str, run_dir=None, params=None) -> Trackers:
    """A run in each tracker of `tracking.report_to` (TensorBoard excepted), on the main process only.

    `job` names the stage ("sft", "ppo", ..., "pipeline"); `params` (a config dataclass or a dict) is
    logged as the run's parameters. Raises ConfigError, closing what it opened, when one cannot start.
    """
    if tracking is None:
        return Trackers()
    names = [n for n in tracking.trackers if n in RUNS]
    if not names or not is_main_process():
        return Trackers()
    if dataclasses.is_dataclass(params):
        params = dataclasses.asdict(params)
    runs: list[_Run] = []
    for name in names:
        try:
            runs.append(RUNS[name](tracking, job, Path(run_dir) if run_dir is not None else None, params))
        except ConfigError:
            Trackers(runs).finish()
            raise
        except Exception as e:
            Trackers(runs).finish()
            raise ConfigError(f"tracking.report_to: {name} could not start a run ({type(e).__name__}: "
                              f"{_first_line(e)}){_start_hint(name, tracking)}") from None
    return Trackers(runs)


def _start_hint(name: str, tracking: TrackingConfig) -> str:
    """The usual way out when a tracker cannot start, for the cases a user meets first."""
    if name == "mlflow" and not (tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")):
        return ("; set tracking.tracking_uri or $MLFLOW_TRACKING_URI to a server (http://...) or a file: store "
                "(with MLFLOW_ALLOW_FILE_STORE=true), or pip install mlflow for its local sqlite default")
    if name == "wandb" and os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
        return "; log in (wandb login / $WANDB_API_KEY) or log locally with WANDB_MODE=offline"
    return ""


# --------------------------------------------------------------------------- a pipeline's run
class PipelineTracking:
    """The pipeline-level run of `quartet run`: `tracking.run_name`, with the resolved pipeline config.

    MLflow's is opened on entry so that the stages' runs nest under it. W&B and trackio group runs by name
    instead, and trackio keeps one run at a time per process, so theirs is opened by `attach`, after the
    stages, in the stages' group.
    """

    def __init__(self, tracking: TrackingConfig, out: Path, params=None):
        self.tracking, self.out, self.params = tracking, Path(out), params
        self.parent = Trackers()

    def __enter__(self) -> PipelineTracking:
        if "mlflow" in self.tracking.trackers:
            mlflow_only = dataclasses.replace(self.tracking, report_to=["mlflow"])
            self.parent = open_trackers(mlflow_only, "pipeline", self.out, self.params)
        return self

    def attach(self, files: list[Path], table: Table | None = None) -> None:
        """The eval table and output files go to the MLflow parent and a W&B / trackio pipeline run."""
        self.parent.attach(files, table)
        others = [n for n in self.tracking.trackers if n in RUNS and n != "mlflow"]
        if not others:
            return
        try:
            runs = open_trackers(dataclasses.replace(self.tracking, report_to=others), "pipeline", self.out,
                                 self.params)
        except ConfigError as e:  # the stages are done: a tracker down now costs only its copy of the report
            log.warning("warning: %s", e)
            return
        runs.attach(files, table)
        runs.finish()

    def __exit__(self, exc_type, *exc) -> None:
        self.parent.finish(failed=exc_type is not None)


# --------------------------------------------------------------------------- helpers
def _flatten(params: dict, prefix: str = "") -> dict[str, str]:
    """{"optim": {"lr": 1e-5}} -> {"optim.lr": "1e-05"}: MLflow params are flat strings."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = str(value)[:6000]  # MLflow's limit on a param value
    return flat


def _artifact_name(run: str, what: str) -> str:
    """W&B / trackio artifact names: letters, digits, dashes, underscores and dots only."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{run}-{what}").strip("-")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "no message"
