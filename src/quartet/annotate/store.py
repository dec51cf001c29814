"""The judgment log and the queue of items: nothing a person gives is lost, and no one overwrites anyone.

`<out>/judgments.jsonl` is append-only, one JSON object a line, never rewritten. Each line goes to the file with one
`os.write` on a descriptor opened O_APPEND, then `os.fsync`, before the server answers the request: a judgment the
page was told about survives `kill -9` and a power cut. A line a kill cut short (no newline at the end of the file)
was never acknowledged; it is ignored on read with a warning, and the next write first ends it with CLOSE, text that
no JSON object ends with, so the torn bytes stay a line of their own that every later read skips the same way (even
a line cut just before its newline, whole JSON otherwise, stays unacknowledged).

Events (`v` 1):
  rank  {"id", "item", "annotator", "time", "ranking": [[0], [2, 3], [1]], "flags": {"1": "off-topic"}}
        ranking: answer indices best first, an inner list of 2+ is a tie; flagged answers are not in it, and the
        ranking is a partition of the others
  skip  {"id", "item", "annotator", "time"}
  undo  {"id", "undoes", "annotator", "time"}: takes back that annotator's newest live rank or skip
A judgment is its own event named by its annotator, so two people judging one item add two lines and cannot touch
each other's; the state (who judged what, where each person is) is rebuilt from the log on every start.

The queue gives an annotator the first item, in file order, they have neither judged nor skipped and that has fewer
than `per_item` live rank judgments. An item shown to someone is held for them for `lease_s` seconds, so two people
do not both get its last slot; a judgment that comes after its hold ran out is still taken (a person's work is never
refused for being slow), so an item can end with more than `per_item` judgments.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from quartet.annotate.items import Item, read_saved_items, save_items
from quartet.errors import ConfigError, DataError, QuartetError
from quartet.outputs import run_lock

log = logging.getLogger(__name__)

LOG = "judgments.jsonl"
ITEMS = "items.jsonl"
"""the served items, written beside the log when a folder is first used: the folder alone can be exported, and a
restart with another samples file is refused rather than mixing judgments of different answers"""
LEASE_S = 300.0
CLOSE = b" <- cut short, never acknowledged\n"
"""ends a torn last line before the next event: the line can no longer parse, whatever part of it was written"""
MAX_NAME = 64
MAX_REASON = 500


@dataclass(frozen=True)
class Judgment:
    id: str
    event: str
    """"rank" or "skip" (undos are applied when the log is read)"""
    item: str
    annotator: str
    time: float
    """unix seconds when the server wrote it"""
    ranking: tuple[tuple[int, ...], ...] = ()
    """answer indices best first; a group of 2+ is a tie; () for a skip"""
    flags: dict[int, str] = field(default_factory=dict)
    """answer index -> why it is unusable (str keys in the JSON line)"""

    def to_json(self) -> dict:
        out = {"v": 1, "event": self.event, "id": self.id, "item": self.item, "annotator": self.annotator,
               "time": self.time}
        if self.event == "rank":
            out["ranking"] = [list(g) for g in self.ranking]
            out["flags"] = {str(k): v for k, v in sorted(self.flags.items())}
        return out


class Refused(QuartetError):
    """A request the log does not take; `status` is the HTTP code the server answers with."""

    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(message)


def read_judgments(path: str | os.PathLike) -> list[Judgment]:
    """The live rank and skip events of log `path` (undos applied), in the order they were written."""
    return list(_replay(_read_events(Path(path)))[0].values())


def load_session(out_dir: str | os.PathLike) -> tuple[list[Item], list[Judgment]]:
    """The items an annotate folder served and its live judgments: all an export needs."""
    out = Path(out_dir)
    if not (out / ITEMS).is_file():
        raise DataError(f"{out}: not a quartet annotate folder (no {ITEMS}); give the --out of `quartet annotate`")
    judgments = read_judgments(out / LOG) if (out / LOG).exists() else []
    return read_saved_items(out / ITEMS), judgments


class Store:
    """The log of one annotate folder, owned by one process (a lock refuses a second), shared by the threads of the
    server: every read and append happens under one lock, so appends are serialised and the queue sees them all."""

    def __init__(self, out_dir: str | os.PathLike, items: list[Item], per_item: int = 1, lease_s: float = LEASE_S,
                 clock: Callable[[], float] = time.monotonic):
        if per_item < 1:
            raise ConfigError(f"annotate.per_item: must be at least 1, got {per_item}")
        self.items, self.per_item, self.lease_s, self._clock = items, per_item, lease_s, clock
        self._index = {it.id: it for it in items}
        self.path = Path(out_dir) / LOG
        self._lock = threading.Lock()
        self._exit = contextlib.ExitStack()
        _check_folder(Path(out_dir))
        self._exit.enter_context(run_lock(self.path, "annotate.out"))  # creates the folder
        try:
            self._check_items(Path(out_dir) / ITEMS)
            self._live, self._mine = _replay(_read_events(self.path)) if self.path.exists() else ({}, {})
            self._done: dict[str, dict[str, Judgment]] = {}  # item -> annotator -> live judgment
            for j in self._live.values():
                self._done.setdefault(j.item, {})[j.annotator] = j
            self._held: dict[str, tuple[str, float]] = {}  # annotator -> (item, lease end)
            self._fd = self._open()
        except BaseException:
            self._exit.close()
            raise
        self._exit.callback(os.close, self._fd)
        unknown = sum(j.item not in self._index for j in self._live.values())
        if unknown:
            log.warning("annotate: %d judgments in %s name items not in the samples file", unknown, self.path)

    def close(self) -> None:
        self._exit.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ requests
    def next(self, annotator: str) -> Item | None:
        """The item `annotator` judges next (held for them), or None when none is left for them now."""
        name = _name(annotator)
        with self._lock:
            now = self._clock()
            held = Counter(item for who, (item, end) in self._held.items() if who != name and end > now)
            for it in self.items:
                done = self._done.get(it.id, {})
                if name in done:
                    continue
                if sum(j.event == "rank" for j in done.values()) + held[it.id] < self.per_item:
                    self._held[name] = (it.id, now + self.lease_s)
                    return it
            self._held.pop(name, None)
            return None

    def judge(self, annotator: str, item: str, ranking, flags) -> Judgment:
        """Write `annotator`'s ranking of `item`'s answers (validated first: a 4xx Refused names what is wrong)."""
        name, it = _name(annotator), self._item(item)
        flags = _flags(flags, len(it.answers))
        groups = _ranking(ranking, len(it.answers), flags)
        return self._write(Judgment(uuid.uuid4().hex, "rank", it.id, name, time.time(), groups, flags))

    def skip(self, annotator: str, item: str) -> Judgment:
        name, it = _name(annotator), self._item(item)
        return self._write(Judgment(uuid.uuid4().hex, "skip", it.id, name, time.time()))

    def undo(self, annotator: str) -> Judgment:
        """Take back `annotator`'s newest live rank or skip; returns it."""
        name = _name(annotator)
        with self._lock:
            mine = self._mine.get(name)
            if not mine:
                raise Refused(409, f"{name} has no judgment to undo")
            target = self._live[mine[-1]]
            self._append({"v": 1, "event": "undo", "id": uuid.uuid4().hex, "undoes": target.id, "annotator": name,
                          "time": time.time()})
            mine.pop()
            del self._live[target.id]
            del self._done[target.item][name]
            return target

    def progress(self, annotator: str | None = None) -> dict:
        name = _name(annotator) if annotator else None
        with self._lock:
            ranks = Counter(j.item for j in self._live.values() if j.event == "rank" and j.item in self._index)
            per_person = Counter(j.annotator for j in self._live.values() if j.event == "rank")
            skips = sum(j.event == "skip" and j.annotator == name for j in self._live.values())
            return {"items": len(self.items), "per_item": self.per_item,
                    "complete": sum(n >= self.per_item for n in ranks.values()),
                    "judgments": sum(ranks.values()), "mine": per_person.get(name, 0), "skipped": skips,
                    "annotators": dict(sorted(per_person.items())),
                    "shared": sum(n >= 2 for n in ranks.values())}

    def judgments(self) -> list[Judgment]:
        """The live rank and skip events, in log order."""
        with self._lock:
            return list(self._live.values())

    # ------------------------------------------------------------------ the log
    def _item(self, item_id) -> Item:
        if not isinstance(item_id, str) or item_id not in self._index:
            raise Refused(404, f"unknown item {str(item_id)[:40]!r}")
        return self._index[item_id]

    def _write(self, j: Judgment) -> Judgment:
        with self._lock:
            if j.annotator in self._done.get(j.item, {}):
                raise Refused(409, f"{j.annotator} already judged item {j.item}; undo it first to judge it again")
            self._append(j.to_json())
            self._live[j.id] = j
            self._mine.setdefault(j.annotator, []).append(j.id)
            self._done.setdefault(j.item, {})[j.annotator] = j
            if self._held.get(j.annotator, ("",))[0] == j.item:
                del self._held[j.annotator]
            return j

    def _append(self, event: dict) -> None:
        """One line, one write, then fsync: when this returns the event is on disk."""
        data = (json.dumps(event, ensure_ascii=False) + "\n").encode()
        if self._torn:  # close the cut line first, in the same write
            data = CLOSE + data
        try:
            written = os.write(self._fd, data)
            if written != len(data):  # a regular file writes short only when the disk fills up mid-line
                self._torn = True
                raise OSError(28, "No space left on device")
            os.fsync(self._fd)
        except OSError as e:
            self._torn = True  # whatever reached the file is not acknowledged; a later line starts fresh
            raise Refused(507, f"could not write {self.path}: {e.strerror}; the judgment was not saved") from None
        self._torn = False

    def _open(self) -> int:
        new = not self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        size = os.fstat(fd).st_size
        self._torn = False
        if size:
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                self._torn = f.read(1) != b"\n"
        if new:  # the file's name must survive a crash as well as its lines
            folder = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(folder)
            finally:
                os.close(folder)
        return fd

    def _check_items(self, path: Path) -> None:
        if not path.exists():
            save_items(path, self.items)
            return
        saved = read_saved_items(path)
        if [it.id for it in saved] != [it.id for it in self.items]:
            raise ConfigError(f"annotate.out: {path.parent} holds judgments of other answers ({path} differs from the "
                              f"items of this samples file); choose a new --out for it")


def _check_folder(out: Path) -> None:
    if str(out) in ("", "."):
        raise ConfigError("annotate.out: name a folder for the judgments, not the current directory")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"annotate.out: {out} is a file, not a folder; choose another --out")
    for name in (LOG, ITEMS):
        path = out / name
        if path.is_symlink() or (path.exists() and not stat.S_ISREG(path.stat().st_mode)):
            raise ConfigError(f"annotate.out: {path} is not a regular file (a link or a folder); the log is only "
                              f"ever appended to a file of its own: choose another --out")


def _read_events(path: Path) -> list[dict]:
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    events = []
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        last = n == len(lines)  # no newline after it: its write was cut short
        try:
            event = None if last else json.loads(raw)
        except ValueError:
            event = None
        if not isinstance(event, dict):
            log.warning("annotate: %s line %d is an incomplete line (a write cut short by a kill, never "
                        "acknowledged); ignored", path, n)
            continue
        events.append(_checked(event, f"{path} line {n}"))
    return events


def _checked(e: dict, where: str) -> dict:
    """An event line as the server writes it; anything else means the log was edited, and is refused."""
    kind = e.get("event")
    need = {"rank": ("item", "ranking", "flags"), "skip": ("item",), "undo": ("undoes",)}.get(kind)
    if e.get("v") != 1 or need is None:
        raise DataError(f"{where}: not a judgment event (v 1, event rank/skip/undo); the log was edited")
    for key in ("id", "annotator", *need):
        if key not in e:
            raise DataError(f"{where}: {kind} event without field '{key}'; the log was edited")
    bad = next((k for k in ("id", "annotator", "item", "undoes") if k in e and not isinstance(e[k], str)), None)
    if bad or not isinstance(e.get("time"), (int, float)):
        raise DataError(f"{where}: field '{bad or 'time'}' has the wrong type; the log was edited")
    if kind == "rank":
        groups = e["ranking"]
        flags = e["flags"]
        if not (isinstance(groups, list) and all(isinstance(g, list) and g and
                                                 all(isinstance(i, int) and not isinstance(i, bool) for i in g)
                                                 for g in groups)):
            raise DataError(f"{where}: field 'ranking' must be a list of lists of answer indices; the log was edited")
        if not (isinstance(flags, dict) and all(k.isdigit() and isinstance(v, str) for k, v in flags.items())):
            raise DataError(f"{where}: field 'flags' must map answer indices to reasons; the log was edited")
    return e


def _replay(events: list[dict]) -> tuple[dict[str, Judgment], dict[str, list[str]]]:
    """Live judgments by id (log order) and each annotator's live ids, oldest first, after applying the undos."""
    live: dict[str, Judgment] = {}
    mine: dict[str, list[str]] = {}
    for e in events:
        who = e["annotator"]
        if e["event"] == "undo":
            target = live.get(e["undoes"])
            if target is None or target.annotator != who:
                log.warning("annotate: undo %s names no live judgment of %s; ignored", e["id"], who)
                continue
            del live[target.id]
            mine[who].remove(target.id)
            continue
        ranking = tuple(tuple(g) for g in e.get("ranking", ()))
        flags = {int(k): v for k, v in e.get("flags", {}).items()}
        live[e["id"]] = Judgment(e["id"], e["event"], e["item"], who, float(e["time"]), ranking, flags)
        mine.setdefault(who, []).append(e["id"])
    return live, mine


# ---------------------------------------------------------------------- request checks
def _name(annotator) -> str:
    if not isinstance(annotator, str) or not annotator.strip():
        raise Refused(422, "annotator: give your name")
    name = annotator.strip()
    if len(name) > MAX_NAME or not name.isprintable():
        raise Refused(422, f"annotator: a name of at most {MAX_NAME} printable characters")
    return name


def _flags(flags, k: int) -> dict[int, str]:
    if flags is None:
        return {}
    if not isinstance(flags, dict):
        raise Refused(422, "flags: an object of answer index -> reason")
    out = {}
    for key, reason in flags.items():
        index = int(key) if isinstance(key, str) and key.isdigit() else key
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < k:
            raise Refused(422, f"flags: {str(key)[:20]!r} is not an answer index (0..{k - 1})")
        if not isinstance(reason, str) or not reason.strip() or len(reason) > MAX_REASON:
            raise Refused(422, f"flags: the reason for answer {index} must be text of 1..{MAX_REASON} characters")
        out[index] = reason.strip()
    return out


def _ranking(ranking, k: int, flags: dict[int, str]) -> tuple[tuple[int, ...], ...]:
    if not isinstance(ranking, list) or not all(isinstance(g, list) and g for g in ranking):
        raise Refused(422, "ranking: a list of groups (non-empty lists of answer indices), best first")
    seen: list[int] = [i for g in ranking for i in g]
    if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < k for i in seen):
        raise Refused(422, f"ranking: answer indices are 0..{k - 1}")
    if len(set(seen)) != len(seen):
        raise Refused(422, "ranking: an answer appears twice")
    wanted = set(range(k)) - set(flags)
    if set(seen) != wanted:
        missing, extra = sorted(wanted - set(seen)), sorted(set(seen) - wanted)
        raise Refused(422, "ranking: must hold every answer that is not flagged, once"
                      + (f" (missing {missing})" if missing else "") + (f" (flagged but ranked {extra})" if extra else ""))
    return tuple(tuple(g) for g in ranking)
