"""Write files and directories so that a crash never leaves half of one behind.

Everything is written under a temporary sibling name and renamed into place: a rename within
one filesystem is atomic, so readers see either the old complete output or the new one.
What appears gets the permissions of an ordinary file or folder (as `open` / `mkdir` give under
the process umask), not the private 0600 / 0700 of the temporary names.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from quartet.errors import ConfigError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: is a folder, cannot write a file there")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, merge: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``path`` only if the block succeeds.

    An existing ``path`` is kept until the new one is complete, then swapped out. With ``merge``, the
    new directory's entries are moved into the existing ``path`` one by one, replacing only entries of
    the same name (a folder of the user's that Quartet was told to write into keeps its other files).
    A ``path`` that exists and is not a folder is never replaced.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{path}: is a file, not a folder; it is not replaced")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.chmod(tmp, 0o777 & ~_umask())
    if merge and path.is_dir():
        for entry in sorted(tmp.iterdir()):
            _swap(entry, path / entry.name)
        tmp.rmdir()
    else:
        _swap(tmp, path)


def _swap(new: Path, path: Path) -> None:
    """Rename `new` onto `path`; an existing `path` is moved aside first and deleted once `new` is in place."""
    old = None
    if path.is_dir() and not path.is_symlink():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(new, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_stale_temporaries(folder: str | os.PathLike, depth: int = 2) -> list[Path]:
    """Delete the temporary siblings a killed writer left in `folder` (and its subfolders, `depth` deep):
    `.name.XXXX.tmp` and `.name.old-PID`. Call it only while holding the folder's run lock."""
    removed = []
    folder = Path(folder)
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        if entry.name.startswith(".") and (entry.name.endswith(".tmp") or ".old-" in entry.name):
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
            removed.append(entry)
        elif depth > 1 and entry.is_dir() and not entry.is_symlink():
            removed += remove_stale_temporaries(entry, depth - 1)
    return removed
