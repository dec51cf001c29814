"""Property: any bytes saved as .jsonl / .json / .csv give either valid examples or one DataError line.

Three kinds of input: raw bytes (mostly rejected at decoding or parsing), arbitrary JSON values laid
out as each format (reaching the row and field checks), and near-valid rows with one field spoiled.
An accepted file must give examples of the promised types; a rejected one a single-line DataError that
names the file. Any other exception (KeyError, TypeError, ...) fails the property.
"""

from __future__ import annotations

import csv
import io
import json
import math
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quartet.config import DataConfig
from quartet.data import load_preferences, load_prompts, load_sft
from quartet.data.readers import read_table
from quartet.errors import DataError

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_SCRATCH = tempfile.TemporaryDirectory(prefix="quartet-fuzz-readers-")  # removed when the session exits
WORK = Path(_SCRATCH.name)
EXTS = [".jsonl", ".json", ".csv"]
LOADERS = {"prompts": load_prompts, "sft": load_sft, "preferences": load_preferences}

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12))
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8,
)
roles = st.sampled_from(["user", "assistant", "system", "bot", "", None, 3])
messages = st.lists(
    st.fixed_dictionaries({}, optional={"role": roles, "content": st.one_of(st.text(max_size=10), json_scalars)}),
    max_size=4,
)
field_value = st.one_of(st.text(max_size=16), messages, json_values)
rows = st.lists(
    st.fixed_dictionaries({}, optional={
        "prompt": field_value, "completion": field_value, "messages": messages, "chosen": field_value,
        "rejected": field_value, "margin": st.one_of(st.floats(), st.text(max_size=5), json_scalars),
    }),
    min_size=0,
    max_size=4,
)


def layout(rows_: list, ext: str) -> bytes:
    """Rows as the bytes of a file of type `ext` (CSV cells: text, or JSON for lists and objects)."""
    if ext == ".jsonl":
        return "".join(json.dumps(r) + "\n" for r in rows_).encode()
    if ext == ".json":
        return json.dumps(rows_).encode()
    header = sorted({k for r in rows_ if isinstance(r, dict) for k in r})
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(header)
    for r in rows_:
        cells = r if isinstance(r, dict) else {}
        writer.writerow([c if isinstance(c := cells.get(h, ""), str) else json.dumps(c) for h in header])
    return out.getvalue().encode()


def is_prompt(p) -> bool:
    if isinstance(p, str):
        return bool(p.strip())
    return isinstance(p, list) and bool(p) and all(
        isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), str)
        for m in p
    ) and p[-1]["role"] != "assistant"


def check(path: Path, kind: str) -> None:
    try:
        examples = LOADERS[kind](DataConfig(path=str(path)))
    except DataError as e:
        message = str(e)
        assert "\n" not in message and path.name in message, message
        return
    assert examples, "an accepted file has rows"
    for ex in examples:
        assert is_prompt(ex.prompt), ex
        if kind == "sft":
            assert isinstance(ex.completion, str) and ex.completion.strip()
        if kind == "preferences":
            assert isinstance(ex.chosen, str) and isinstance(ex.rejected, str)
            assert ex.chosen.strip() != ex.rejected.strip()
            assert ex.margin is None or (isinstance(ex.margin, float) and math.isfinite(ex.margin))


@FUZZ
@given(data=st.binary(max_size=300), ext=st.sampled_from(EXTS), kind=st.sampled_from(list(LOADERS)))
def test_any_bytes_give_examples_or_one_data_error(data, ext, kind):
    path = WORK / f"bytes{ext}"
    path.write_bytes(data)
    check(path, kind)


@FUZZ
@given(value=json_values, ext=st.sampled_from(EXTS), kind=st.sampled_from(list(LOADERS)))
def test_any_json_value_gives_examples_or_one_data_error(value, ext, kind):
    path = WORK / f"value{ext}"
    rows_ = value if isinstance(value, list) else [value]
    path.write_bytes(layout(rows_, ext) if ext != ".json" else json.dumps(value).encode())
    check(path, kind)


@FUZZ
@given(rows_=rows, ext=st.sampled_from(EXTS), kind=st.sampled_from(list(LOADERS)))
def test_near_valid_rows_give_examples_or_one_data_error(rows_, ext, kind):
    path = WORK / f"rows{ext}"
    path.write_bytes(layout(rows_, ext))
    check(path, kind)


@FUZZ
@given(text=st.text(max_size=200), ext=st.sampled_from(EXTS))
def test_any_text_reads_as_a_table_or_one_data_error(text, ext):
    path = WORK / f"text{ext}"
    path.write_text(text, encoding="utf-8")
    try:
        table = read_table(path)
    except DataError as e:
        assert "\n" not in str(e) and path.name in str(e)
    else:
        assert table.rows and all(isinstance(r, dict) for r in table.rows)
        assert len(table.numbers) == len(table.rows)
