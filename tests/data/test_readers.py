"""Every input format reads to the same rows, with row numbers that point back into the file."""

import json

import pytest

from quartet.data import read_rows, read_table
from quartet.errors import DataError

ROWS = [
    {"prompt": "Say hi", "completion": "Hi!"},
    {"prompt": "Say bye", "completion": "Bye."},
]


def write_jsonl(path, rows, blank_lines=False):
    sep = "\n\n" if blank_lines else "\n"
    path.write_text(sep.join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


def test_jsonl_rows_and_line_numbers(tmp_path):
    table = read_table(write_jsonl(tmp_path / "d.jsonl", ROWS, blank_lines=True))
    assert table.rows == ROWS
    assert table.numbers == [1, 3]  # blank lines are skipped, numbers stay file line numbers
    assert table.where(1) == f"{tmp_path / 'd.jsonl'} row 3"


def test_jsonl_with_utf8_bom_and_unicode(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "caf\u00e9 \u2615"}, ensure_ascii=False).encode())
    assert read_rows(path) == [{"prompt": "caf\u00e9 \u2615"}]


@pytest.mark.parametrize("wrap", [False, True])
def test_json_list_or_data_field(tmp_path, wrap):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"data": ROWS} if wrap else ROWS))
    table = read_table(path)
    assert table.rows == ROWS and table.numbers == [1, 2]


def test_csv_cells_are_text_and_message_lists_are_decoded(tmp_path):
    path = tmp_path / "d.csv"
    msgs = [{"role": "user", "content": "hi, you"}, {"role": "assistant", "content": "hello"}]
    import csv

    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "completion", "margin", "messages"])
        w.writerow(["Say, hi", "Hi!\nthere", "1.5", json.dumps(msgs)])
    (row,) = read_rows(path)
    assert row == {"prompt": "Say, hi", "completion": "Hi!\nthere", "margin": "1.5", "messages": msgs}


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert read_rows(path) == ROWS


def test_parquet_with_message_lists(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert read_rows(path) == rows


def test_save_to_disk_dataset_and_single_split_dict(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "ds"))
    assert read_rows(tmp_path / "ds") == ROWS
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dd"))
    assert read_rows(tmp_path / "dd") == ROWS


def test_dataset_dict_with_several_splits_names_them(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"holds splits train, test; point the path at one"):
        read_table(tmp_path / "dd")
    assert read_rows(tmp_path / "dd" / "test") == ROWS


def test_extension_is_case_insensitive(tmp_path):
    assert read_rows(write_jsonl(tmp_path / "D.JSONL", ROWS)) == ROWS


def test_task_spec_reads_packaged_file_and_names_itself_in_errors():
    table = read_table("task:positive-review/eval")
    assert len(table.rows) == 96 and table.source == "task:positive-review/eval"
    assert table.where(0) == "task:positive-review/eval row 1"
    assert read_table("task:tiny-target").source == "task:tiny-target"  # default split: train
    assert len(read_rows("task:tiny-target")) == 256
