"""Write files and directories so that a crash never leaves half of one behind.

Everything is written under a temporary sibling name and renamed into place: a rename within
one filesystem is atomic, so readers see either the old complete output or the new one.
What appears gets the permissions of an ordinary file or folder (as `open` / `mkdir` give under
the process umask), not the private 0600 / 0700 of the temporary names, nor the 0600 that a writer
may give its own files (safetensors 0.8 writes weights through a private temporary file of its own).
A write that fails because the disk is full, the quota spent or the filesystem read-only is an
OutputError naming the output, and what was there before is left whole.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Collection, Iterator
from pathlib import Path

from quartet.errors import ConfigError, OutputError, QuartetError

# errors that can only mean "the disk cannot take this output", whatever was being done: one `error:` line, not a
# traceback. (A folder that refuses writes, EACCES / EPERM, is found at start-up: quartet.outputs; those errnos
# are not mapped here, as a read of some input can raise them too.)
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
# safetensors (Rust) raises its own exception type; the OS error is in its text: "... (os error 28)"
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def write_failure(e: BaseException) -> str | None:
    """Why an output could not be written, when `e` is one of WRITE_ERRNOS (an OSError, or an OS error carried in
    another library's exception text); None for anything else."""
    code = getattr(e, "errno", None) if isinstance(e, OSError) else None
    if not isinstance(e, OSError) and (m := _RUST_OS_ERROR.search(str(e))):
        code = int(m.group(1))
    return os.strerror(code) if code in WRITE_ERRNOS else None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write_files({path: data})[0]


def atomic_write_files(files: dict) -> list[Path]:
    """Write several files ({path: text or bytes}) as one: each to a temporary sibling first, then all renamed into
    place in the order given (the last can mark the set complete). A failure while writing (a full disk) leaves
    every one of them as it was."""
    temps: list[tuple[str, Path]] = []
    path = None
    try:
        for path, data in files.items():
            path = Path(path)
            temps.append((_write_temp(path, data.encode("utf-8") if isinstance(data, str) else data), path))
        for tmp, path in temps:
            os.replace(tmp, path)
    except BaseException as e:
        for tmp, _ in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        reason = write_failure(e)
        if reason is None:
            raise
        raise OutputError(path, reason) from None
    return [path for _, path in temps]


def _write_temp(path: Path, data: bytes) -> str:
    """`data` in a complete, synced temporary sibling of `path` with ordinary permissions; returns its name."""
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
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return tmp


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, replace: Collection[str] | None = None) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``path`` only if the block succeeds.

    An existing ``path`` is kept until the new one is complete, then swapped out. ``replace`` names the entries
    the new directory owns (a stage's own files, quartet.outputs.WRITES): when the existing ``path`` holds
    anything else, it is not swapped out whole; the new entries are moved in one by one and the named entries the
    new directory lacks are removed, so the other files (a user's) stay where they are. A ``path`` that exists
    and is not a folder, or is a symbolic link, is never replaced.
    """
    path = Path(path)
    if path.is_symlink():
        raise ConfigError(f"{path}: is a symbolic link; it is not replaced (write into the folder it points to)")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{path}: is a file, not a folder; it is not replaced")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        ordinary_modes(tmp)
        if replace is not None and path.is_dir() and any(e.name not in replace for e in path.iterdir()):
            new = {entry.name for entry in tmp.iterdir()}
            for name in sorted(new):
                _swap(tmp / name, path / name)
            for name in sorted(set(replace) - new):  # what an earlier run of the same stage wrote, not this one
                _remove(path / name)
            tmp.rmdir()
        else:
            _swap(tmp, path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OutputError):  # from a writer inside the block: name the output, not the temporary
            inner = Path(e.path)
            raise OutputError(path / inner.relative_to(tmp) if inner.is_relative_to(tmp) else inner,
                              e.reason) from None
        if isinstance(e, QuartetError) and str(tmp) in str(e):  # a check inside the block named the temporary
            raise _renamed(e, str(tmp), str(path)) from None
        reason = write_failure(e)
        if reason is None:
            raise
        raise OutputError(path, reason) from None


def _renamed(error: QuartetError, old: str, new: str) -> BaseException:
    """`error` with `old` (a temporary folder's name) replaced by `new` (the output's) in its message; the error
    itself where its type does not take a bare message."""
    try:
        return type(error)(str(error).replace(old, new))
    except TypeError:
        return error


def ordinary_modes(root: Path) -> None:
    """Give `root` and everything under it the mode `open` / `mkdir` give under the umask (execute bits kept)."""
    mask = _umask()
    os.chmod(root, 0o777 & ~mask)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                continue
            full = 0o777 if stat.S_ISDIR(st.st_mode) or st.st_mode & 0o111 else 0o666
            if stat.S_IMODE(st.st_mode) != full & ~mask:
                os.chmod(p, full & ~mask)


def _swap(new: Path, path: Path) -> None:
    """Rename `new` onto `path`; an existing folder (or an entry of the other kind) is moved aside first and
    deleted once `new` is in place."""
    old = None
    if not path.is_symlink() and (path.is_dir() or (path.exists() and new.is_dir())):
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        _remove(old)
        os.replace(path, old)
    os.replace(new, path)
    if old is not None:
        _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


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
