"""The verdict cache: a rerun pays for nothing, committed rows survive a kill -9, and a file that is not a cache is
refused with one line and left exactly as it was."""

from __future__ import annotations

import os
import signal
import sqlite3
import stat

import pytest

from quartet.errors import DataError, ModelError
from quartet.judges.verdict_cache import CachedJudge, VerdictCache, verdict_key


class CountingJudge:
    """A pairwise judge whose verdict is len(first) - len(second); records every row it is asked."""

    name = "counting"

    def __init__(self, fail_on_call: int | None = None, finished: dict | None = None):
        self.asked: list[tuple[str, str, str]] = []
        self.calls, self.fail_on_call, self.finished = 0, fail_on_call, finished

    def compare(self, prompts, firsts, seconds):
        self.calls += 1
        if self.calls == self.fail_on_call:
            error = RuntimeError("server went away")
            if self.finished is not None:
                error.finished = self.finished
            raise error
        self.asked += list(zip(prompts, firsts, seconds))
        return [float(len(f) - len(s)) for f, s in zip(firsts, seconds)]


ROWS = (["p1", "p1", "p2", "p3"], ["aa", "b", "cccc", "d"], ["b", "aa", "c", "dd"])


def test_key_is_ordered_and_unambiguous():
    assert verdict_key("j", "r", "p", "a", "b") != verdict_key("j", "r", "p", "b", "a")
    # length-prefixed: moving a character across a boundary is another key
    assert verdict_key("j", "r", "p", "ab", "c") != verdict_key("j", "r", "p", "a", "bc")
    assert verdict_key("j", "r", "p", "a", "b") != verdict_key("j", "r2", "p", "a", "b")


def test_second_run_pays_for_nothing(tmp_path):
    path = tmp_path / "verdicts.sqlite"
    inner = CountingJudge()
    first = CachedJudge(inner, VerdictCache(path, "label.llm_judge.cache"), "rubric")
    values = first.compare(*ROWS)
    assert values == [1.0, -1.0, 3.0, -1.0]
    assert (first.calls, first.hits) == (4, 0)
    first.cache.close()

    again = CountingJudge()
    second = CachedJudge(again, VerdictCache(path, "label.llm_judge.cache"), "rubric")
    assert second.compare(*ROWS) == values
    assert (second.calls, second.hits, again.calls) == (0, 4, 0)
    # another rubric is another question: nothing is read back
    other = CachedJudge(CountingJudge(), second.cache, "another rubric")
    other.compare(*ROWS)
    assert (other.calls, other.hits) == (4, 0)


def test_only_missing_rows_are_asked_and_repeats_once(tmp_path):
    cache = VerdictCache(tmp_path / "c.sqlite", "cache")
    CachedJudge(CountingJudge(), cache, "r").compare(["p1"], ["aa"], ["b"])
    inner = CountingJudge()
    judge = CachedJudge(inner, cache, "r")
    out = judge.compare(["p1", "p2", "p2"], ["aa", "x", "x"], ["b", "yy", "yy"])
    assert out == [1.0, -1.0, -1.0]
    assert inner.asked == [("p2", "x", "yy")]
    assert (judge.calls, judge.hits) == (1, 2)


def test_no_cache_still_counts_and_drops_repeats():
    inner = CountingJudge()
    judge = CachedJudge(inner, None, "r")
    assert judge.compare(["p", "p"], ["a", "a"], ["bb", "bb"]) == [-1.0, -1.0]
    assert (judge.calls, judge.hits, len(inner.asked)) == (1, 1, 1)


def test_chunks_committed_before_a_failure(tmp_path):
    """A judge failing on its second chunk: the first chunk's verdicts are on disk for the rerun, and so are the
    rows the failing call said it finished (llm_http's JudgeUnavailable.finished)."""
    path = tmp_path / "c.sqlite"
    judge = CachedJudge(CountingJudge(fail_on_call=2, finished={1: 7.0}), VerdictCache(path, "cache"), "r",
                        chunk_size=2)
    with pytest.raises(RuntimeError, match="went away"):
        judge.compare(*ROWS)
    assert judge.calls == 3
    rerun = CountingJudge()
    resumed = CachedJudge(rerun, VerdictCache(path, "cache"), "r", chunk_size=2)
    assert resumed.compare(*ROWS) == [1.0, -1.0, 3.0, 7.0]  # row 4 as the failed call reported it
    assert rerun.asked == [("p2", "cccc", "c")]


def test_non_finite_verdict_is_refused_and_not_stored(tmp_path):
    class NaNJudge(CountingJudge):
        def compare(self, prompts, firsts, seconds):
            return [float("nan")] * len(prompts)

    cache = VerdictCache(tmp_path / "c.sqlite", "cache")
    with pytest.raises(ModelError, match="pair #1 is not finite"):
        CachedJudge(NaNJudge(), cache, "r").compare(["p"], ["a"], ["b"])
    assert len(cache) == 0


def test_committed_rows_survive_kill_9(tmp_path):
    """A child process commits rows, then is killed with SIGKILL while its connection is open (no close, no
    checkpoint: the rows are only in the write-ahead log); a new connection finds every committed row."""
    path = tmp_path / "c.sqlite"
    VerdictCache(path, "cache").close()
    pid = os.fork()
    if pid == 0:  # the child: commit, start a second transaction it never finishes, die
        try:
            cache = VerdictCache(path, "cache")
            cache.put_many([("k1", 1.5), ("k2", -2.0)])
            cache.conn.execute("INSERT INTO verdicts VALUES ('uncommitted', 0.0)")
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert (tmp_path / "c.sqlite-wal").stat().st_size > 0  # the rows were not checkpointed into the main file
    cache = VerdictCache(path, "cache")
    assert cache.get_many(["k1", "k2", "uncommitted"]) == {"k1": 1.5, "k2": -2.0}


def test_new_cache_is_an_ordinary_file_and_leaves_no_temporaries(tmp_path):
    old = os.umask(0o022)
    try:
        VerdictCache(tmp_path / "sub" / "c.sqlite", "cache").close()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "sub" / "c.sqlite").stat().st_mode) == 0o644
    assert not [p for p in (tmp_path / "sub").iterdir() if p.name.endswith(".tmp")]


def _sqlite_of_another_program(path):
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE t (x)")
        conn.execute("INSERT INTO t VALUES (1)")
    conn.close()


@pytest.mark.parametrize("kind, message", [
    ("text", "is not a verdict cache"),
    ("empty", "is an empty file"),
    ("other sqlite", "SQLite file of another program"),
    ("folder", "is not a regular file"),
    ("link", "is not a regular file"),
])
def test_a_file_that_is_not_a_cache_is_refused_and_kept(tmp_path, kind, message):
    path = tmp_path / "verdicts.sqlite"
    if kind == "text":
        path.write_text("my notes\n" * 100)
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "other sqlite":
        _sqlite_of_another_program(path)
    elif kind == "folder":
        path.mkdir()
    else:
        (tmp_path / "target.txt").write_text("mine")
        path.symlink_to(tmp_path / "target.txt")
    before = None if path.is_dir() else path.read_bytes()
    listing = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(DataError) as e:
        VerdictCache(path, "label.llm_judge.cache")
    assert str(path) in str(e.value) and message in str(e.value) and "label.llm_judge.cache" in str(e.value)
    assert "\n" not in str(e.value)
    assert before is None or path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == listing  # no -wal, -shm or temporary left beside it


def test_a_cache_of_another_layout_is_refused(tmp_path):
    path = tmp_path / "c.sqlite"
    VerdictCache(path, "cache").close()
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA user_version=7")
    conn.close()
    with pytest.raises(DataError, match="layout 7, this Quartet reads layout 1"):
        VerdictCache(path, "cache")
