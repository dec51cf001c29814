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

Every failure is a :class:`~quartet.errors.DataError` whose one-line message names the file (and row).
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

from quartet.errors import DataError

EXTENSIONS = (".jsonl", ".json", ".csv", ".parquet")


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


def read_table(path: str | os.PathLike) -> Table:
    """Read ``path`` into a :class:`Table`; errors name ``path`` (or the ``task:`` spec) and the row."""
    source = str(path)
    p = _task_file(source) if source.startswith("task:") else Path(source)
    if not p.exists():
        raise DataError(f"{source}: file not found")
    if p.is_dir():
        table = _read_saved_dataset(p, source)
    else:
        ext = p.suffix.lower()
        if ext == ".parquet":
            table = _read_parquet(p, source)
        elif ext in (".jsonl", ".json", ".csv"):
            text = _read_text(p, source)
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
    p = _task_file(source) if source.startswith("task:") else Path(source)
    if not p.exists():
        raise DataError(f"{source}: file not found")
    if p.is_file() and p.suffix.lower() not in EXTENSIONS:
        raise DataError(
            f"{source}: unknown file type '{p.suffix or '(none)'}' "
            f"(expected {', '.join(EXTENSIONS)}, a save_to_disk directory, or task:<name>/<split>)"
        )


def _task_file(spec: str) -> Path:
    from quartet.tasks import get_task  # the tasks package reads its files through this module

    name, _, split = spec[len("task:") :].partition("/")
    return get_task(name).split_path(split or "train")


def _read_text(p: Path, source: str) -> str:
    data = p.read_bytes()
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
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{source} row {lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise DataError(f"{source} row {lineno}: expected a JSON object, got {_json_type(row)}")
        rows.append(row)
        numbers.append(lineno)
    return Table(source, rows, numbers)


def _parse_json(text: str, source: str) -> Table:
    try:
        data = json.loads(text) if text.strip() else []
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
    return Table(source, data, list(range(1, len(data) + 1)))


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
        rows.append({h: _csv_cell(v) for h, v in zip(header, record)})
    return Table(source, rows, list(range(1, len(rows) + 1)))


def _csv_cell(value: str):
    """A cell holding a JSON list of objects (chat messages) is decoded; everything else stays text."""
    s = value.strip()
    if s.startswith("[{") and s.endswith("}]"):
        try:
            decoded = json.loads(s)
        except json.JSONDecodeError:
            return value
        if isinstance(decoded, list) and all(isinstance(m, dict) for m in decoded):
            return decoded
    return value


def _read_parquet(p: Path, source: str) -> Table:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(p).to_pylist()
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise DataError(f"{source}: not a readable parquet file ({type(e).__name__}: {e})") from None
    return Table(source, rows, list(range(1, len(rows) + 1)))


def _read_saved_dataset(p: Path, source: str) -> Table:
    if not ((p / "state.json").exists() or (p / "dataset_dict.json").exists()):
        raise DataError(
            f"{source}: is a directory but not one written by datasets' save_to_disk "
            f"(no state.json or dataset_dict.json)"
        )
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
    return Table(source, rows, list(range(1, len(rows) + 1)))


def _json_type(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )
