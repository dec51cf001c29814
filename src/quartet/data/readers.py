"""Read rows (plain dicts) from a dataset file, a `save_to_disk` directory, or a built-in task.

Formats, chosen by extension:

- ``.jsonl``: one JSON object per line; blank lines are skipped. Row numbers are 1-based *line* numbers.
- ``.json``: a top-level list of objects, or an object with a ``"data"`` list (the
  ``load_dataset("json", field="data")`` convention). Row numbers are 1-based list positions.
- ``.csv``: a header row then one row per line (UTF-8, comma-separated); every cell is a string,
  except a cell that holds a JSON list of objects (chat messages), which is decoded. Row numbers are
  1-based data rows (the header is not counted).
- ``.parquet``: read with pyarrow.
- a directory written by ``datasets.Dataset.save_to_disk`` (or a ``DatasetDict`` with one split).
- ``task:<name>/<split>``: the JSONL file a built-in task ships, e.g. ``task:positive-review/train``.
- ``memory:<name>``: rows given to the Python API (a list of dicts or a ``datasets.Dataset``, quartet.handles).

Every failure is a :class:`~quartet.errors.DataError` whose one-line message names the file (and row).

Reading is bounded, so a hostile path cannot hang or flood a run: only regular files are opened (a FIFO would
block until some writer came, a device such as /dev/zero never ends), a JSONL or CSV line may be at most
``max_line_mb`` (a field of every data section; a ``.json`` file is one document, whose lines may legitimately
be long), and a row may nest lists and objects at most ``MAX_JSON_DEPTH`` deep.
"""

from __future__ import annotations

import csv
import io
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from quartet import handles
from quartet.config import DataConfig
from quartet.errors import DataError
from quartet.tasks import get_task

EXTENSIONS = (".jsonl", ".json", ".csv", ".parquet")
MAX_JSON_DEPTH = 64
"""lists and objects nested deeper than this in one row are refused: real rows nest 3 deep (a row, its list of
chat messages, a message), and CPython's JSON parser recurses once per level until a RecursionError"""


@dataclass
class Table:
    """Rows plus where each came from, so later validation can say ``<source> row <n>``."""

    source: str
    rows: list[dict]
    numbers: list[int]
    """1-based row number of each row in ``source`` (the line number for JSONL)"""

    def where(self, i: int) -> str:
        return f"{self.source} row {self.numbers[i]}"


def read_rows(path: str) -> list[dict]:
    """Read every row of ``path`` as a dict (see module docstring for formats)."""
    return read_table(path).rows


def read_table(path: str | os.PathLike, max_line_mb: float = DataConfig.max_line_mb) -> Table:
    """Read ``path`` into a :class:`Table`; errors name ``path`` (or the ``task:`` spec) and the row.

    The one reader of user data files: every stage's data (through `quartet.data.schemas`), a ``task:`` path
    included, comes through here, so the limits in the module docstring hold for all of them. (`Task.rows` reads
    its own shipped files, which are package data, not user input.)"""
    source = str(path)
    if handles.is_handle(source):
        return _read_memory(source)
    p = _task_file(source) if source.startswith("task:") else Path(source)
    mode = _mode(p, source)
    if stat.S_ISDIR(mode):
        table = _read_saved_dataset(p, source)
    else:
        ext = p.suffix.lower()
        if ext == ".parquet":
            table = _read_parquet(p, source)
        elif ext in (".jsonl", ".json", ".csv"):
            limit = None if ext == ".json" else max_line_mb
            text = _read_text(p, source, limit, "row" if ext == ".jsonl" else "line")
            reader = {".jsonl": _parse_jsonl, ".json": _parse_json, ".csv": _parse_csv}[ext]
            table = reader(text, source)
        else:
            raise DataError(
                f"{source}: unknown file type '{p.suffix or '(none)'}' "
                f"(expected {', '.join(EXTENSIONS)}, a save_to_disk directory, or task:<name>/<split>)"
            )
    if not table.rows:
        raise DataError(f"{source}: no rows (the file is empty or has only a header)")
    return table


def check_data_path(path: str | os.PathLike) -> None:
    """Fail now if ``path`` cannot be read as a dataset, without reading it: an empty path, an unknown
    task or split, a missing file, an unknown file type. The rows are checked when a stage reads them."""
    source = str(path)
    if not source:
        raise DataError("data path is empty: set `path:` to a file, a directory or task:<name>/<split>")
    if handles.is_handle(source):
        handles.lookup(source, "data", DataError)
        return
    p = _task_file(source) if source.startswith("task:") else Path(source)
    if stat.S_ISREG(_mode(p, source)) and p.suffix.lower() not in EXTENSIONS:
        raise DataError(
            f"{source}: unknown file type '{p.suffix or '(none)'}' "
            f"(expected {', '.join(EXTENSIONS)}, a save_to_disk directory, or task:<name>/<split>)"
        )


def _task_file(spec: str) -> Path:
    name, _, split = spec[len("task:") :].partition("/")
    return get_task(name).split_path(split or "train")


_SPECIAL = {stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
            stat.S_IFSOCK: "a socket"}


def _mode(p: Path, source: str) -> int:
    """The file type bits of ``p`` (a symlink followed), or a DataError when it is neither a regular file nor a
    directory: a FIFO blocks the reader until a writer comes, and a device (/dev/zero) never ends."""
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        raise DataError(f"{source}: file not found") from None
    except OSError as e:
        raise DataError(f"{source}: cannot be read ({e.strerror})") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise _not_regular(mode, source)
    return mode


def _not_regular(mode: int, source: str) -> DataError:
    what = _SPECIAL.get(stat.S_IFMT(mode), "not a regular file")
    return DataError(f"{source}: is {what}, not a data file; data is read from regular files only")


def _open_regular(p: Path, source: str):
    """``p`` opened for binary reading, refused unless the opened file is regular. `_mode` checked the path;
    this checks what was opened, in case the path was swapped since. O_NONBLOCK keeps the open of a FIFO from
    waiting for a writer, so it too reaches the check."""
    nonblock = getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(p, os.O_RDONLY | nonblock)
    except OSError as e:
        raise DataError(f"{source}: cannot be read ({e.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(mode, source)
        if nonblock:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def _read_bounded(f, source: str, max_line_mb: float, unit: str) -> bytes:
    """Every byte of ``f``, refusing a line longer than ``max_line_mb`` before reading the rest of it."""
    chunks, max_line = [], max(1, int(max_line_mb * 2**20))
    while line := f.readline(max_line + 1):
        if len(line) > max_line and not line.endswith(b"\n"):
            raise DataError(
                f"{source} {unit} {len(chunks) + 1}: line longer than the {max_line_mb:g} MB limit "
                f"(max_line_mb); a data row is rarely this long: check the file, or raise max_line_mb"
            )
        chunks.append(line)
    return b"".join(chunks)


def _read_text(p: Path, source: str, max_line_mb: float | None = None, unit: str = "line") -> str:
    """The UTF-8 text of regular file ``p``; with ``max_line_mb``, no line may be longer than that."""
    with _open_regular(p, source) as f:
        data = f.read() if max_line_mb is None else _read_bounded(f, source, max_line_mb, unit)
    if b"\x00" in data[:65536]:  # UTF-8 text never holds NUL; UTF-16 text and binaries do
        raise DataError(f"{source}: is a binary file (NUL bytes), not UTF-8 text; re-save it as UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataError(
            f"{source}: not UTF-8 text (byte 0x{data[e.start]:02x} on line {line}); re-save the file as UTF-8"
        ) from None


def _parse_jsonl(text: str, source: str) -> Table:
    rows, numbers = [], []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = _loads(line, f"{source} row {lineno}", shallow=_few_brackets(line))
        except json.JSONDecodeError as e:
            raise DataError(f"{source} row {lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise DataError(f"{source} row {lineno}: expected a JSON object, got {_json_type(row)}")
        rows.append(row)
        numbers.append(lineno)
    return Table(source, rows, numbers)


def _parse_json(text: str, source: str) -> Table:
    try:
        data = _loads(text, source) if text.strip() else []
    except json.JSONDecodeError as e:
        raise DataError(f"{source}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if isinstance(data, dict):
        if not isinstance(data.get("data"), list):
            raise DataError(f"{source}: expected a list of objects or an object with a \"data\" list")
        data = data["data"]
    if not isinstance(data, list):
        raise DataError(f"{source}: expected a list of objects, got {_json_type(data)}")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise DataError(f"{source} row {i + 1}: expected a JSON object, got {_json_type(row)}")
    return _checked_depth(Table(source, data, list(range(1, len(data) + 1))))


def _parse_csv(text: str, source: str) -> Table:
    try:
        records = list(csv.reader(io.StringIO(text, newline="")))
    except csv.Error as e:
        raise DataError(f"{source}: not valid CSV ({e})") from None
    records = [r for r in records if r]
    if not records:
        return Table(source, [], [])
    header, body = records[0], records[1:]
    if len(set(header)) != len(header) or any(not h.strip() for h in header):
        raise DataError(f"{source}: the header row needs unique, non-empty column names, got {header}")
    rows = []
    for i, record in enumerate(body):
        if len(record) != len(header):
            raise DataError(
                f"{source} row {i + 1}: has {len(record)} cells but the header has {len(header)} columns"
            )
        rows.append({h: _csv_cell(v, f"{source} row {i + 1}: field '{h}'") for h, v in zip(header, record)})
    return Table(source, rows, list(range(1, len(rows) + 1)))


def _csv_cell(value: str, where: str):
    """A cell holding a JSON list of objects (chat messages) is decoded; everything else stays text."""
    s = value.strip()
    if s.startswith("[{") and s.endswith("}]"):
        try:
            decoded = _loads(s, where, shallow=_few_brackets(s))
        except json.JSONDecodeError:
            return value
        if isinstance(decoded, list) and all(isinstance(m, dict) for m in decoded):
            return decoded
    return value


def _loads(text: str, where: str, shallow: bool = True):
    """json.loads, with nesting deeper than MAX_JSON_DEPTH a DataError naming ``where``: beyond the parser's
    recursion limit instead of its RecursionError, below it by a look at the result unless ``shallow`` (the
    caller knows the text cannot nest that deep)."""
    try:
        value = json.loads(text)
    except RecursionError:
        deep = True
    else:
        deep = not shallow and _too_deep(value)
    if deep:
        raise DataError(f"{where}: lists and objects nested more than {MAX_JSON_DEPTH} levels deep")
    return value


def _few_brackets(text: str) -> bool:
    """Whether ``text`` holds too few brackets to nest past MAX_JSON_DEPTH (a cheap test that spares most rows
    the walk of `_too_deep`)."""
    return text.count("[") + text.count("{") <= MAX_JSON_DEPTH


def _checked_depth(table: Table) -> Table:
    for i, row in enumerate(table.rows):
        if _too_deep(row):
            raise DataError(f"{table.where(i)}: lists and objects nested more than {MAX_JSON_DEPTH} levels deep")
    return table


def _too_deep(value) -> bool:
    """Whether ``value`` nests lists and dicts more than MAX_JSON_DEPTH deep (a loop, not recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > MAX_JSON_DEPTH:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _read_parquet(p: Path, source: str) -> Table:
    import pyarrow.parquet as pq

    with _open_regular(p, source) as f:
        try:
            rows = pq.read_table(f).to_pylist()
        except Exception as e:  # pyarrow raises several types for a corrupt file
            raise DataError(f"{source}: not a readable parquet file ({type(e).__name__}: {e})") from None
    return _checked_depth(Table(source, rows, list(range(1, len(rows) + 1))))


def _read_memory(source: str) -> Table:
    """Rows given in Python: a list of dicts, or anything with datasets' ``to_list`` (a ``datasets.Dataset``)."""
    data = handles.lookup(source, "data", DataError)
    rows = data.to_list() if hasattr(data, "to_list") else list(data)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{source} row {i + 1}: expected a dict, got {type(row).__name__}")
    if not rows:
        raise DataError(f"{source}: no rows")
    return _checked_depth(Table(source, rows, list(range(1, len(rows) + 1))))


def _read_saved_dataset(p: Path, source: str) -> Table:
    if not ((p / "state.json").exists() or (p / "dataset_dict.json").exists()):
        raise DataError(
            f"{source}: is a directory but not one written by datasets' save_to_disk "
            f"(no state.json or dataset_dict.json)"
        )
    for entry in [*p.iterdir(), *(e for d in p.iterdir() if d.is_dir() for e in d.iterdir())]:  # splits are subdirs
        _mode(entry, str(entry))
    import datasets

    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:
        raise DataError(f"{source}: cannot load the saved dataset ({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if len(splits) != 1:
            raise DataError(
                f"{source}: holds splits {', '.join(splits)}; point the path at one, e.g. {p / splits[0]}"
            )
        ds = ds[splits[0]]
    rows = ds.to_list()
    return _checked_depth(Table(source, rows, list(range(1, len(rows) + 1))))


def _json_type(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )
