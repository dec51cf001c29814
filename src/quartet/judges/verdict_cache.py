"""Verdicts on disk, so a rerun or a resumed run pays for no pair twice.

`VerdictCache` is one SQLite file (the standard library's sqlite3) of key -> log-odds, the key a SHA-256 of (judge
name, rubric, prompt, first answer, second answer): the order of the answers is part of it, as the two orders are
two verdicts. Why it survives a kill -9: the file runs in WAL mode and each `put_many` is one transaction; a
transaction's rows are in the write-ahead log when its COMMIT returns, and SQLite replays the log when the next
connection opens, so every committed row is there and an uncommitted one is absent, never half of one
(https://sqlite.org/wal.html). `synchronous=NORMAL` skips the fsync per commit: a power cut may lose the last
transactions (they are judged again), a process kill loses none.

The file is created whole (in a temporary sibling, then linked into place) and marked with SQLite's
`application_id`, so a file at the path that is not one of these caches (another program's database, a corrupt or
empty file) is refused with one error line naming it, and never written to, replaced or deleted.

`CachedJudge` wraps a judge: it asks the inner judge only for the rows the cache lacks, a chunk at a time, each
chunk committed before the next is asked, so a crash loses at most one chunk of work.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import sqlite3
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

from quartet.errors import DataError, ModelError, OutputError
from quartet.judges.pairwise import PairwiseJudge

APPLICATION_ID = 0x51564443
"""SQLite `application_id` of a verdict cache ("QVDC"): what tells our file from another program's"""
SCHEMA = 1
"""`user_version` of the table layout below"""
BUSY_TIMEOUT = 60.0
"""seconds a connection waits for another process's write to finish (two runs sharing one cache)"""
_QUERY_ROWS = 500
"""keys per SELECT: under SQLite's oldest limit of 999 bound variables"""


def verdict_key(judge: str, rubric: str, prompt: str, first: str, second: str) -> str:
    """SHA-256 (hex) of the five texts, each length-prefixed, so no two different tuples share an encoding."""
    h = hashlib.sha256()
    for part in (judge, rubric, prompt, first, second):
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


class VerdictCache:
    """key -> log-odds in the SQLite file `path`; `where` is how errors name the setting (`label.llm_judge.cache`)."""

    def __init__(self, path: str | os.PathLike, where: str):
        self.path, self.where = Path(path), where
        if not os.path.lexists(self.path):
            _create(self.path)
        self._check()
        self.conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT)
        with self._errors():
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")

    def _refuse(self, why: str) -> DataError:
        return DataError(f"{self.path}: {why}; it is left as it is (move it away, or point {self.where} at "
                         f"another file, or set it to null for no cache)")

    def _check(self) -> None:
        """Refuse anything at the path but a cache this module wrote, before opening it for writing."""
        st = os.lstat(self.path)
        if not stat.S_ISREG(st.st_mode):
            raise self._refuse("is not a regular file (a folder, a link or a device)")
        if st.st_size == 0:
            raise self._refuse("is an empty file, not a verdict cache")
        try:
            with contextlib.closing(sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True)) as conn:
                app = conn.execute("PRAGMA application_id").fetchone()[0]
                version = conn.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError as e:
            raise self._refuse(f"is not a verdict cache (SQLite: {e})") from None
        if app != APPLICATION_ID:
            raise self._refuse("is an SQLite file of another program, not a verdict cache")
        if version != SCHEMA:
            raise self._refuse(f"is a verdict cache of layout {version}, this Quartet reads layout {SCHEMA}")

    @contextlib.contextmanager
    def _errors(self):
        try:
            yield
        except sqlite3.DatabaseError as e:
            if "full" in str(e):  # SQLITE_FULL: "database or disk is full"
                raise OutputError(self.path, str(e)) from None
            raise DataError(f"{self.path}: the verdict cache cannot be used (SQLite: {e}); move it away, or set "
                            f"{self.where}: null") from None

    def get_many(self, keys: Iterable[str]) -> dict[str, float]:
        """The cached verdicts among `keys`, as {key: log-odds}."""
        keys = list(dict.fromkeys(keys))
        found: dict[str, float] = {}
        with self._errors():
            for start in range(0, len(keys), _QUERY_ROWS):
                chunk = keys[start : start + _QUERY_ROWS]
                marks = ",".join("?" * len(chunk))
                found.update(self.conn.execute(f"SELECT key, value FROM verdicts WHERE key IN ({marks})", chunk))
        return found

    def put_many(self, items: Iterable[tuple[str, float]]) -> None:
        """Store every (key, log-odds) in one transaction, committed before this returns."""
        with self._errors(), self.conn:
            self.conn.executemany("INSERT OR REPLACE INTO verdicts (key, value) VALUES (?, ?)", list(items))

    def __len__(self) -> int:
        with self._errors():
            return self.conn.execute("SELECT COUNT(*) FROM verdicts").fetchone()[0]

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> VerdictCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _create(path: Path) -> None:
    """A new empty cache at `path`, built in a temporary sibling and linked into place whole: a kill while it is
    set up leaves only the temporary (`.name.XXXX.tmp`, which quartet.atomic.remove_stale_temporaries clears), and
    a file another process put at `path` meanwhile is kept, never replaced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with contextlib.closing(sqlite3.connect(tmp)) as conn, conn:
            conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
            conn.execute(f"PRAGMA user_version={SCHEMA}")
            conn.execute("CREATE TABLE verdicts (key TEXT PRIMARY KEY, value REAL NOT NULL) WITHOUT ROWID")
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # an ordinary file's mode, not mkstemp's private 0600
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process created it first: that one is checked and used
        except OSError:  # a filesystem without hard links
            if not os.path.lexists(path):
                os.replace(tmp, path)
    except sqlite3.DatabaseError as e:
        raise OutputError(path, str(e)) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


class CachedJudge:
    """A judge whose verdicts go through a cache (or none: `cache` None still counts and drops repeated rows).

    `calls`: rows the inner judge was asked (verdicts paid for); `hits`: rows answered without it (from the cache,
    or a repeat of a row asked in the same call). Every compare adds its rows to one of the two."""

    def __init__(self, judge: PairwiseJudge, cache: VerdictCache | None, rubric: str, chunk_size: int = 64):
        self.judge, self.cache, self.rubric, self.chunk_size = judge, cache, rubric, chunk_size
        self.name = judge.name
        self.calls = self.hits = 0

    def compare(self, prompts: list[str], firsts: list[str], seconds: list[str]) -> list[float]:
        keys = [verdict_key(self.name, self.rubric, p, f, s) for p, f, s in zip(prompts, firsts, seconds)]
        known = self.cache.get_many(keys) if self.cache is not None else {}
        todo: dict[str, int] = {}  # key -> the first row asking for it
        for row, key in enumerate(keys):
            if key not in known and key not in todo:
                todo[key] = row
        pending = list(todo.items())
        for start in range(0, len(pending), self.chunk_size):
            chunk = pending[start : start + self.chunk_size]
            rows = [row for _, row in chunk]
            try:
                values = self.judge.compare([prompts[r] for r in rows], [firsts[r] for r in rows],
                                            [seconds[r] for r in rows])
            except Exception as e:
                # a judge that fails part-way may say which rows it finished (quartet.judges.llm_http's
                # JudgeUnavailable.finished: {row of the call: verdict}): those are kept for the rerun
                finished = getattr(e, "finished", None)
                if isinstance(finished, dict):
                    self._store([(chunk[i][0], float(v)) for i, v in finished.items()
                                 if 0 <= i < len(chunk) and math.isfinite(float(v))])
                raise
            if len(values) != len(rows):
                raise ModelError(f"judge {self.name}: gave {len(values)} verdicts for {len(rows)} pairs")
            for (key, row), value in zip(chunk, values):
                if not math.isfinite(float(value)):
                    raise ModelError(f"judge {self.name}: verdict {value} for pair #{row + 1} is not finite")
                known[key] = float(value)
            self._store([(key, known[key]) for key, _ in chunk])
        self.hits += len(keys) - len(pending)
        return [known[k] for k in keys]

    def _store(self, items: list[tuple[str, float]]) -> None:
        """Commit verdicts just paid for (and count them)."""
        if self.cache is not None and items:
            self.cache.put_many(items)
        self.calls += len(items)


__all__ = ["APPLICATION_ID", "CachedJudge", "VerdictCache", "verdict_key"]
