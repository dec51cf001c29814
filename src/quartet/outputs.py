"""Where a stage may write: the one output rule every stage follows, and the run lock.

A stage writes into an output that is new, empty, or a Quartet run of the same stage (recognised by the
`.quartet-run` marker it leaves, or for runs older than the marker by its config + metrics files). Anything
else (a user's folder, a file where a folder belongs, `.`) is refused with one line, before any work is
done. With `overwrite=True` (the CLI's `--overwrite`) a folder that holds other files is written into:
Quartet's own files are replaced, the user's files are left where they are.

While a stage runs it holds an exclusive lock on a hidden sibling `.<name>.lock` (an OS file lock, so a
killed process never leaves a stale one), and a second process writing the same output gets a clear error.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from quartet.errors import ConfigError

MARKER = ".quartet-run"


def write_marker(run_dir: str | os.PathLike, stage: str) -> None:
    """Mark `run_dir` as a Quartet run of `stage` (part of the run's own files)."""
    from quartet.atomic import atomic_write_text

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
    import yaml

    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and {"output_dir", "task", "stages"} <= set(data)


def check_output_dir(path: str | os.PathLike, stage: str, overwrite: bool = False, key: str = "output_dir") -> Path:
    """Refuse an output directory this stage must not write into; returns it as a Path.

    Allowed: a path that does not exist yet, an empty directory, a Quartet run of the same stage, or (with
    `overwrite`) any directory. Refused: a file, an unwritable parent, a directory of other files.
    """
    path = Path(path)
    where = f"{stage}.{key}"
    if str(path) in ("", "."):
        raise ConfigError(f"{where}: '{path}' is the current directory; name a new folder for the run")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{where}: {path} is a file, not a folder; choose another {key}")
    if path.is_dir():
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{where}: {path} is not writable")
        found = run_stage(path)
        if found == stage or overwrite or not any(path.iterdir()):
            return path
        what = f"a Quartet {found} run" if found else "files that are not a Quartet run"
        raise ConfigError(
            f"{where}: {path} already holds {what}; choose a new folder, or pass --overwrite to write the "
            f"{stage} run into it (only Quartet's own files are replaced)"
        )
    return _creatable(path, where)


def check_output_file(path: str | os.PathLike, owned: bool, where: str) -> Path:
    """Refuse an output file path that is a folder, or a user's file (`owned` = a Quartet stage wrote it)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{where}: {path} is a folder; name a file")
    if path.exists() and not owned:
        raise ConfigError(f"{where}: {path} exists and was not written by Quartet; choose another path or pass --overwrite")
    return _creatable(path, where)


def _creatable(path: Path, where: str) -> Path:
    """`path` itself, if its nearest existing ancestor is a folder this process may write into."""
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{where}: {parent} is a file, so {path} cannot be created")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{where}: cannot create {path}: {parent} is not writable")
    return path


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
