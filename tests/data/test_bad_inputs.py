"""Every malformed input a user can hand Quartet fails with a one-line QuartetError saying where.

Each case builds its input in tmp_path, runs the public call that would read it, and checks the
error class, that the message is a single line, and that it names the file / row / field (or spec).
The last tests show that a writer failing midway leaves no partial output behind.
"""

from __future__ import annotations

import json
import os
import types

import pytest

import quartet.atomic
from quartet.atomic import atomic_dir, atomic_write_text
from quartet.config import DataConfig
from quartet.data import encode_prompts, encode_sft, load_preferences, load_prompts, load_sft
from quartet.data.readers import check_data_path
from quartet.data.schemas import SFTExample
from quartet.errors import ConfigError, DataError, ModelError, QuartetError
from quartet.models import resolve_model
from quartet.models.loading import check_context
from quartet.models.reward import check_trained_reward_model
from quartet.models.tiny import build_tiny_tokenizer
from quartet.rollout.rewards import load_reward_fn
from quartet.rollout.scoring import Scorer


def _jsonl(tmp, rows, name="data.jsonl"):
    path = tmp / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _bytes(tmp, name, data: bytes):
    path = tmp / name
    path.write_bytes(data)
    return str(path)


def _parquet(tmp, rows, name="data.parquet"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp / name
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def prefs(path, **kw):
    return lambda: load_preferences(DataConfig(path=path, **kw))


def prompts(path, **kw):
    return lambda: load_prompts(DataConfig(path=path, **kw))


def sft(path, **kw):
    return lambda: load_sft(DataConfig(path=path, **kw))


TOK = build_tiny_tokenizer()


def _model_dir(tmp, config='{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}', weights=b""):
    """A model dir with this config.json text and model.safetensors bytes (None: no weights file)."""
    path = tmp / "model"
    path.mkdir()
    (path / "config.json").write_text(config)
    if weights is not None:
        (path / "model.safetensors").write_bytes(weights)
    return str(path)


def _with_context(n):
    return types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=n))


def _user_reward(tmp, body):
    """A module:function spec for a reward function with ``body``, importable from tmp."""
    (tmp / "user_reward_mod.py").write_text(f"def score(prompts, responses):\n    {body}\n")
    return "user_reward_mod:score"


# id: (build(tmp) -> callable that must raise, error class, parts the message must contain)
CASES = {
    "missing-column": (
        lambda t: prefs(_jsonl(t, [{"prompt": "p", "chosen": "a"}])),
        DataError, ["data.jsonl row 1", "missing field 'rejected'", "fields in the row: prompt, chosen"],
    ),
    "empty-string": (
        lambda t: prompts(_jsonl(t, [{"prompt": "ok"}, {"prompt": "  "}])),
        DataError, ["data.jsonl row 2", "field 'prompt' is empty"],
    ),
    "wrong-type": (
        lambda t: sft(_jsonl(t, [{"prompt": "p", "completion": 42}])),
        DataError, ["data.jsonl row 1", "field 'completion' must be text, got a number (42)"],
    ),
    "chosen-equals-rejected": (
        lambda t: prefs(_jsonl(t, [{"prompt": "p", "chosen": "same", "rejected": "same "}])),
        DataError, ["data.jsonl row 1", "'chosen' and 'rejected' are identical"],
    ),
    "binary-file": (
        lambda t: prompts(_bytes(t, "data.jsonl", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")),
        DataError, ["data.jsonl", "binary file"],
    ),
    "undecodable-text": (
        lambda t: prompts(_bytes(t, "data.csv", b"prompt\ncaf\xe9\n")),
        DataError, ["data.csv", "not UTF-8 text (byte 0xe9 on line 2)"],
    ),
    "invalid-json-line": (
        lambda t: prompts(_jsonl(t, [{"prompt": "a"}, {"prompt": "b"}, '{"prompt": "c",'])),
        DataError, ["data.jsonl row 3", "not valid JSON"],
    ),
    "jsonl-line-not-an-object": (
        lambda t: prompts(_jsonl(t, [{"prompt": "a"}, "[1, 2]"])),
        DataError, ["data.jsonl row 2", "expected a JSON object, got a list"],
    ),
    "json-top-level-not-a-list": (
        lambda t: prompts(_bytes(t, "data.json", b'{"rows": []}')),
        DataError, ["data.json", 'an object with a "data" list'],
    ),
    "unknown-extension": (
        lambda t: prompts(_bytes(t, "data.txt", b"hello")),
        DataError, ["data.txt", "unknown file type '.txt'"],
    ),
    "missing-file": (
        lambda t: prompts(str(t / "nope.jsonl")),
        DataError, ["nope.jsonl", "file not found"],
    ),
    "empty-file": (
        lambda t: prompts(_bytes(t, "data.jsonl", b"\n \n")),
        DataError, ["data.jsonl", "no rows"],
    ),
    "csv-header-only": (
        lambda t: prompts(_bytes(t, "data.csv", b"prompt\n")),
        DataError, ["data.csv", "no rows"],
    ),
    "messages-without-user-turn": (
        lambda t: sft(_jsonl(t, [{"messages": [{"role": "system", "content": "s"},
                                               {"role": "assistant", "content": "a"}]}])),
        DataError, ["data.jsonl row 1", "field 'messages' has no user turn"],
    ),
    "bad-role": (
        lambda t: sft(_jsonl(t, [{"messages": [{"role": "bot", "content": "hi"}]}])),
        DataError, ["data.jsonl row 1", "field 'messages' message 1", "unknown role 'bot'"],
    ),
    "message-with-empty-content": (
        lambda t: prompts(_jsonl(t, [{"prompt": [{"role": "user", "content": ""}]}])),
        DataError, ["data.jsonl row 1", "field 'prompt' message 1", "'content' is empty"],
    ),
    "prompt-ends-with-assistant": (
        lambda t: prompts(_jsonl(t, [{"prompt": [{"role": "user", "content": "q"},
                                                 {"role": "assistant", "content": "a"}]}])),
        DataError, ["data.jsonl row 1", "field 'prompt' ends with an assistant turn"],
    ),
    "csv-wrong-header": (
        lambda t: sft(_bytes(t, "data.csv", b"question,answer\nq,a\n")),
        DataError, ["data.csv row 1", "missing field 'prompt'", "fields in the row: question, answer"],
    ),
    "csv-ragged-row": (
        lambda t: prompts(_bytes(t, "data.csv", b"prompt\nok\n\"a\",\"b\",\"c\"\n")),
        DataError, ["data.csv row 2", "has 3 cells but the header has 1"],
    ),
    "parquet-wrong-columns": (
        lambda t: prefs(_parquet(t, [{"prompt": "p", "good": "a", "bad": "b"}])),
        DataError, ["data.parquet row 1", "missing field 'chosen'"],
    ),
    "parquet-corrupt": (
        lambda t: prompts(_bytes(t, "data.parquet", b"this is not parquet at all")),
        DataError, ["data.parquet", "not a readable parquet file"],
    ),
    "plain-directory": (
        lambda t: (t / "somedir").mkdir() or prompts(str(t / "somedir")),
        DataError, ["somedir", "not one written by datasets' save_to_disk"],
    ),
    "margin-not-a-number": (
        lambda t: prefs(_jsonl(t, [{"prompt": "p", "chosen": "a", "rejected": "b", "margin": "lots"}])),
        DataError, ["data.jsonl row 1", "field 'margin' must be a number"],
    ),
    "hh-text-without-prompt": (
        lambda t: prefs(_jsonl(t, [{"chosen": "just text", "rejected": "other text"}])),
        DataError, ["data.jsonl row 1", "field 'chosen' is text but there is no `prompt` field"],
    ),
    "column-remap-to-missing-column": (
        lambda t: prompts(_jsonl(t, [{"prompt": "p"}]), columns={"prompt": "question"}),
        DataError, ["data.jsonl row 1", "columns maps 'prompt' to field 'question', which is missing"],
    ),
    "column-remap-unknown-field": (
        lambda t: prompts(_jsonl(t, [{"prompt": "p"}]), columns={"answer": "a"}),
        DataError, ["data.jsonl", "columns: 'answer' is not a prompts field"],
    ),
    "empty-data-path": (
        lambda t: prompts(""),
        DataError, ["data path is empty"],
    ),
    "unknown-task": (
        lambda t: prompts("task:positive-reveiw/train"),
        DataError, ["task:positive-reveiw", "unknown task", "did you mean 'positive-review'?"],
    ),
    "unknown-task-split": (
        lambda t: prompts("task:positive-review/test"),
        DataError, ["task:positive-review/test", "unknown split", "train, eval, sft"],
    ),
    "prompts-all-dropped": (
        lambda t: lambda: encode_prompts(TOK, ["x" * 100, "y" * 200], 16, truncation="drop", where="data.jsonl"),
        DataError, ["data.jsonl", "all 2 prompts are longer than max_prompt_tokens=16"],
    ),
    "prompt-template-leaves-no-room": (
        lambda t: lambda: encode_prompts(TOK, ["fits", [{"role": "system", "content": "s" * 40},
                                                       {"role": "user", "content": "x"}]], 30, where="data.jsonl"),
        DataError, ["data.jsonl #2", "leaves no room for the prompt text within max_prompt_tokens=30"],
    ),
    "sft-all-rows-too-long": (
        lambda t: lambda: encode_sft(TOK, [SFTExample("x" * 50, "y")], max_seq_len=20),
        DataError, ["SFT data", "max_seq_len=20"],
    ),
    "reward-missing-attribute": (
        lambda t: lambda: load_reward_fn("json:no_such_function"),
        ConfigError, ["json:no_such_function", "module 'json' has no attribute 'no_such_function'"],
    ),
    "reward-missing-module": (
        lambda t: lambda: load_reward_fn("no_such_module_xyz:score"),
        ConfigError, ["no_such_module_xyz:score", "no module named 'no_such_module_xyz'"],
    ),
    "reward-not-callable": (
        lambda t: lambda: load_reward_fn("json:__doc__"),
        ConfigError, ["json:__doc__", "not a callable"],
    ),
    "reward-model-dir-spec": (
        lambda t: lambda: load_reward_fn("runs/rm/model"),
        ModelError, ["reward 'runs/rm/model'", "not a reward function spec", "quartet.models.load_reward_model"],
    ),
    "reward-unknown-task": (
        lambda t: lambda: load_reward_fn("task:nope"),
        DataError, ["task:nope", "unknown task"],
    ),
    "reward-returns-wrong-count": (
        lambda t: lambda: load_reward_fn(_user_reward(t, "return [1.0]"))(["p", "q"], ["a", "b"]),
        ConfigError, ["user_reward_mod:score", "returned 1 scores for 2 responses"],
    ),
    "reward-dir-missing": (
        lambda t: lambda: Scorer(str(t / "runs" / "rm")),
        ConfigError, ["runs/rm", "no such reward-model directory"],
    ),
    "reward-plain-language-model": (
        lambda t: lambda: check_trained_reward_model(_model_dir(t, weights=None)),
        ModelError, ["reward model", "no trained reward head"],
    ),
    "model-config-json-not-an-object": (
        lambda t: lambda: resolve_model(_model_dir(t, config="[1, 2]")),
        ModelError, ["model/config.json", "expected a JSON object, got list"],
    ),
    "model-config-json-not-json": (
        lambda t: lambda: resolve_model(_model_dir(t, config="{oops")),
        ModelError, ["model/config.json", "not readable JSON"],
    ),
    "model-weights-not-safetensors": (
        lambda t: lambda: resolve_model(_model_dir(t, weights=b"\x00" * 7)),
        ModelError, ["model/model.safetensors", "damaged weights file"],
    ),
    "data-path-unknown-type": (
        lambda t: lambda: check_data_path(_bytes(t, "data.txt", b"hello")),
        DataError, ["data.txt", "unknown file type '.txt'"],
    ),
    "prompt-longer-than-context": (
        lambda t: lambda: check_context(_with_context(8), [[1] * 6, [1] * 3], 4, "label.policy 'p'", "lower one"),
        ConfigError, ["label.policy 'p'", "longest prompt (6 tokens) + max_new_tokens (4) = 10", "context of 8 tokens"],
    ),
    # ---- reading is bounded: line length, nesting depth (FIFOs and devices: tests/cli/test_hostile_inputs.py)
    "jsonl-line-longer-than-max-line-mb": (
        lambda t: prompts(_jsonl(t, [{"prompt": "ok"}, {"prompt": "x" * 3000}]), max_line_mb=0.001),
        DataError, ["data.jsonl row 2", "line longer than the 0.001 MB limit (max_line_mb)", "raise max_line_mb"],
    ),
    "csv-line-longer-than-max-line-mb": (
        lambda t: prompts(_bytes(t, "data.csv", b"prompt\nok\n" + b"y" * 3000 + b"\n"), max_line_mb=0.001),
        DataError, ["data.csv line 3", "line longer than the 0.001 MB limit"],
    ),
    "jsonl-nested-deeper-than-the-bound": (
        lambda t: prompts(_jsonl(t, [{"prompt": "ok"}, '{"prompt": "p", "x": ' + "[" * 70 + "]" * 70 + "}"])),
        DataError, ["data.jsonl row 2", "nested more than 64 levels deep"],
    ),
    "jsonl-nested-past-the-parsers-recursion": (  # json.loads alone raises RecursionError here
        lambda t: prompts(_jsonl(t, ['{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"])),
        DataError, ["data.jsonl row 1", "nested more than 64 levels deep"],
    ),
    "json-row-nested-deeper-than-the-bound": (
        lambda t: prompts(_bytes(t, "data.json", ('[{"prompt": "a"}, {"prompt": ' + "{\"a\": " * 70 + "1"
                                                   + "}" * 70 + "}]").encode())),
        DataError, ["data.json row 2", "nested more than 64 levels deep"],
    ),
    "csv-cell-nested-past-the-parsers-recursion": (
        lambda t: prompts(_bytes(t, "data.csv", b'prompt\n"[{""a"": ' + b"[" * 10_000 + b"]" * 10_000 + b'}]"\n')),
        DataError, ["data.csv row 1: field 'prompt'", "nested more than 64 levels deep"],
    ),
    "data-path-is-a-device": (
        lambda t: lambda: check_data_path("/dev/zero"),
        DataError, ["/dev/zero", "is a character device, not a data file"],
    ),
    "reward-returns-nan": (
        lambda t: lambda: load_reward_fn(_user_reward(t, "return [0.0, float('nan')]"))(["p", "q"], ["a", "b"]),
        ConfigError, ["user_reward_mod:score", "score 1 is nan, not finite"],
    ),
}


@pytest.fixture
def importable_tmp(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    import sys

    sys.modules.pop("user_reward_mod", None)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_error_naming_the_place(case, importable_tmp):
    build, error, parts = CASES[case]
    call = build(importable_tmp)
    with pytest.raises(QuartetError) as info:
        call()
    err = info.value
    message = str(err)
    assert isinstance(err, error), f"{case}: {type(err).__name__}: {message}"
    assert "\n" not in message and message == message.strip()
    for part in parts:
        assert part in message, f"{case}: {part!r} not in {message!r}"


def test_at_least_twenty_cases():
    assert len(CASES) >= 20


def test_a_line_at_the_limit_is_read_and_one_byte_more_is_refused(tmp_path):
    """The bound is on the line's bytes without its newline: exactly max_line_mb passes, one byte more does not."""
    limit = int(0.001 * 2**20)
    row = '{"prompt": "' + "x" * (limit - len('{"prompt": ""}')) + '"}'
    assert len(row.encode()) == limit
    assert load_prompts(DataConfig(path=_jsonl(tmp_path, [row]), max_line_mb=0.001))[0].prompt.startswith("xx")
    longer = _jsonl(tmp_path, [row.replace("xx", "xxx", 1)], name="longer.jsonl")
    with pytest.raises(DataError, match="longer.jsonl row 1: line longer than"):
        load_prompts(DataConfig(path=longer, max_line_mb=0.001))
    assert DataConfig().max_line_mb == 16  # a real row, however long its chat, is far below the default


def test_every_loader_reads_through_the_bounded_reader(tmp_path):
    """Prompts, SFT rows, preference pairs and a label stage's samples: each applies its data section's
    max_line_mb (and so every stage, whose data comes through these loaders)."""
    from quartet.data import load_samples

    rows = [{"prompt": "p", "completion": "c", "chosen": "a", "rejected": "b"}]
    path = _jsonl(tmp_path, [*rows, {**rows[0], "prompt": "x" * 3000}])
    for load in (load_prompts, load_sft, load_preferences, load_samples):
        assert load(DataConfig(path=path))
        with pytest.raises(DataError, match="data.jsonl row 2: line longer than the 0.001 MB limit"):
            load(DataConfig(path=path, max_line_mb=0.001))


# --------------------------------------------------------------------------- no partial output
def test_failed_atomic_write_leaves_no_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    target = tmp_path / "out" / "preferences.jsonl"

    def fail_fsync(fd):  # the bytes are written, then the disk "fails" before the rename
        raise OSError("disk full")

    monkeypatch.setattr(quartet.atomic.os, "fsync", fail_fsync)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(target, '{"prompt": "p"}\n' * 1000)
    assert not target.exists() and os.listdir(target.parent) == []

    monkeypatch.undo()
    atomic_write_text(target, "old\n")
    monkeypatch.setattr(quartet.atomic.os, "fsync", fail_fsync)
    with pytest.raises(OSError):
        atomic_write_text(target, "new\n")
    assert target.read_text() == "old\n" and os.listdir(target.parent) == ["preferences.jsonl"]


def test_failed_atomic_dir_leaves_nothing(tmp_path):
    target = tmp_path / "model"
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as tmp:
            (tmp / "config.json").write_text("{}")
            raise RuntimeError("crashed while saving weights")
    assert not target.exists() and os.listdir(tmp_path) == []
