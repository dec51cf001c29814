"""Where a stage may write: the one output rule every stage follows, and the run lock.

A stage writes into an output that is new, empty, or a Quartet run of the same stage (recognised by the
`.quartet-run` marker it leaves, or for runs older than the marker by its config + metrics files). Anything
else (a user's folder, a file where a folder belongs, `.`, a symbolic link, a place the process cannot write
such as /sys) is refused with one line, before any work is done. With `overwrite=True` (the CLI's
`--overwrite`) a folder of other files is written into only when none of the paths the stage writes (`WRITES`)
exists there: the stage's files go beside the user's, and nothing of the user's is replaced. A run of the
same stage has its own files (those in `WRITES`) replaced and any other file in it kept.

A stage whose output is one folder writes it through `staged_output`: everything goes into a temporary folder
that takes its place only once the stage succeeded, so a run that fails leaves nothing (or the previous run,
whole). PPO, which must keep its checkpoints in place, writes nothing before its first iteration's result.

While a stage runs it holds an exclusive lock on a hidden sibling `.<name>.lock` (an OS file lock, so a
killed process never leaves a stale one), and a second process writing the same output gets a clear error.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import yaml

from quartet.atomic import atomic_dir, atomic_write_text
from quartet.config import load_yaml
from quartet.errors import ConfigError

MARKER = ".quartet-run"

_RUN = (MARKER, "config.yaml", "metrics.jsonl", "tb", "summary.md", "wandb")  # wandb: W&B's files (monitor/tracking)
WRITES = {
    "sft": (*_RUN, "model"),
    "rm": (*_RUN, "model", "calibration.json"),
    "dpo": (*_RUN, "model"),
    "ppo": (*_RUN, "model", "samples.jsonl", "checkpoints", "best", "critic", "value_head.safetensors",
            "findings.jsonl"),
    "eval": (MARKER, "samples.jsonl", "eval.json", "bad_cases.jsonl", "tasks"),
    "pipeline": (MARKER, "pipeline.yaml", "sft", "label", "rm", "ppo", "dpo", "eval", "summary.md", "report.html",
                 "plots", "wandb", "rounds"),
}
"""every name a stage writes directly inside its output folder (tests/trainers/test_reliability.py holds each
stage to its list): `--overwrite` into a folder that is not the stage's run needs all of them absent, and a
staged re-run (`staged_output`) replaces exactly these"""


def write_marker(run_dir: str | os.PathLike, stage: str) -> None:
    """Mark `run_dir` as a Quartet run of `stage` (part of the run's own files)."""
    atomic_write_text(Path(run_dir) / MARKER, json.dumps({"stage": stage}) + "\n")


def run_stage(path: str | os.PathLike) -> str | None:
    """The stage of the Quartet run in directory `path`, or None when it is not one."""
    path = Path(path)
    marker = path / MARKER
    if marker.is_file():
        try:
            stage = json.loads(marker.read_text(encoding="utf-8")).get("stage")
        except (OSError, ValueError, AttributeError):
            return None
        return stage if isinstance(stage, str) else None
    # runs written before the marker existed: a pipeline's pipeline.yaml, or config.yaml + metrics.jsonl
    # whose first record names the stage
    if (path / "pipeline.yaml").is_file():
        return "pipeline" if _is_pipeline_config(path / "pipeline.yaml") else None
    metrics = path / "metrics.jsonl"
    if not (path / "config.yaml").is_file() or not metrics.is_file():
        return None
    try:
        with open(metrics, encoding="utf-8") as f:
            stage = json.loads(f.readline()).get("stage")
    except (OSError, ValueError, AttributeError):
        return None
    return stage if isinstance(stage, str) else None


def _is_pipeline_config(file: Path) -> bool:
    try:
        data = load_yaml(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and {"output_dir", "task", "stages"} <= set(data)


def check_output_dir(path: str | os.PathLike, stage: str, overwrite: bool = False, key: str = "output_dir",
                     overwritable: bool = True) -> Path:
    """Refuse an output directory this stage must not write into; returns it as a Path.

    Allowed: a path that does not exist yet (in a folder this process can write), an empty directory, a Quartet
    run of the same stage, or (with `overwrite`) a directory where none of the stage's `WRITES` exists. Refused: a
    file, a symbolic link, an unwritable place, a directory of other files, a link at one of the stage's paths.
    `overwritable`: whether the command has --overwrite (`quartet run` has not), for the error's advice.
    """
    path = Path(path)
    where = f"{stage}.{key}"
    if str(path) in ("", "."):
        raise ConfigError(f"{where}: '{path}' is the current directory; name a new folder for the run")
    _refuse_link(path, where)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{where}: {path} is a file, not a folder; choose another {key}")
    if not path.is_dir():
        return _creatable(path, where)
    found = run_stage(path)
    if found == stage:
        # its own files are replaced by renaming; a link among them was put there by hand, and would be replaced
        link = next((path / n for n in WRITES[stage] if (path / n).is_symlink()), None)
        if link is not None:
            raise ConfigError(f"{where}: {link} is a symbolic link; a run replaces its own files and never a link: "
                              f"remove it or choose another {key}")
    elif not all(_transient(entry.name) for entry in path.iterdir()):
        what = f"a Quartet {found} run" if found else "files that are not a Quartet run"
        if not overwrite:
            hint = f", or pass --overwrite to write the {stage} run beside them" if overwritable else ""
            raise ConfigError(f"{where}: {path} already holds {what}; choose a new folder{hint}")
        clash = next((path / n for n in WRITES[stage] if os.path.lexists(path / n)), None)
        if clash is not None:
            raise ConfigError(
                f"{where}: {path} already holds {what}, and {clash} is a path the {stage} stage writes: "
                f"--overwrite writes beside what a folder holds, never over it; move it away or choose another {key}"
            )
    _writable(path, path, where)  # last: a folder refused above is not touched at all, not even its mtime
    return path


def _transient(name: str) -> bool:
    """A name Quartet gives a file only while writing (a temporary, a folder moved aside, a lock, a probe): left by a
    killed run, it does not make the folder a user's."""
    return name.startswith(".") and (name.endswith((".tmp", ".lock")) or ".old-" in name
                                     or name.startswith(".quartet-probe-"))


def check_output_file(path: str | os.PathLike, owned: bool, where: str) -> Path:
    """Refuse an output file path that is a folder, a link, or a user's file (`owned` = a Quartet stage wrote it)."""
    path = Path(path)
    _refuse_link(path, where)
    if path.is_dir():
        raise ConfigError(f"{where}: {path} is a folder; name a file")
    if path.exists() and not owned:
        raise ConfigError(f"{where}: {path} exists and was not written by Quartet; choose another path (Quartet "
                          f"never replaces a file it did not write)")
    return _creatable(path, where)


def _refuse_link(path: Path, where: str) -> None:
    """An output is replaced by renaming a new one onto its name, which would replace a link rather than write where
    it points; refused before any work, with the place to name instead."""
    if path.is_symlink():
        raise ConfigError(f"{where}: {path} is a symbolic link (to {os.path.realpath(path)}); name that path itself")


def _creatable(path: Path, where: str) -> Path:
    """`path` itself, if its nearest existing ancestor is a folder this process may write into."""
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{where}: {parent} is a file, so {path} cannot be created")
    _writable(parent, path, where)
    return path


def _writable(folder: Path, path: Path, where: str) -> None:
    """Refuse `path` unless a folder can be made and removed in `folder`. A real try, not `os.access`: that says yes
    to root in /sys and /proc, where nothing can be created."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".quartet-probe-", dir=folder))
    except OSError as e:
        raise ConfigError(f"{where}: cannot write {path}: {folder} is not writable ({e.strerror})") from None


@contextlib.contextmanager
def staged_output(path: str | os.PathLike, stage: str, overwrite: bool = False, key: str = "output_dir",
                  ) -> Iterator[Path]:
    """A stage's output folder written as one: checked by the output rule, under the run lock, into a temporary
    folder (marked as the stage's run) whose entries replace the stage's own files in `path` only when the block
    succeeds. A block that fails leaves `path` as it was, or absent (quartet.atomic.atomic_dir)."""
    path = check_output_dir(path, stage, overwrite, key)
    with run_lock(path, f"{stage}.{key}"), atomic_dir(path, replace=WRITES[stage]) as tmp:
        write_marker(tmp, stage)
        yield tmp


@contextlib.contextmanager
def run_lock(path: str | os.PathLike, where: str) -> Iterator[None]:
    """Hold an exclusive lock for writing `path`; a second holder gets a ConfigError naming it."""
    import fcntl

    path = Path(path).absolute()
    created = [p for p in [path.parent, *path.parent.parents] if not p.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_name(f".{path.name}.lock")
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(f"{where}: another quartet process is writing {path} (lock {lock})") from None
        # the file may have been unlinked by a holder that finished between our open and our lock
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
        os.close(fd)
        for folder in created:  # a run that wrote nothing leaves no empty folders behind
            with contextlib.suppress(OSError):
                folder.rmdir()
