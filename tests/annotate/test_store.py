"""The judgment log and the queue (quartet.annotate.store) and the items they are about (items.py): nothing
acknowledged is lost, a torn last line is skipped, undo takes back one's own newest judgment, per_item people see
each item, two people never overwrite each other, and a restart resumes where everyone was."""

import json
import logging
import os

import pytest

from quartet.annotate.items import item_id, load_items, read_saved_items
from quartet.annotate.store import ITEMS, LOG, Refused, Store, load_session, read_judgments
from quartet.errors import ConfigError, DataError


def write_samples(path, prompts=3, k=3, score=True):
    rows = [{"prompt": f"prompt {p}", "completion": f"answer {p}.{a}", "sample": a, **({"score": a / 10} if score
                                                                                          else {})}
            for p in range(prompts) for a in range(k)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def items(tmp_path):
    return load_items(write_samples(tmp_path / "s.samples.jsonl"))


# ---------------------------------------------------------------------- items
def test_items_group_rows_by_prompt_in_file_order(tmp_path):
    rows = [{"prompt": "b", "completion": "b0", "score": 1}, {"prompt": "a", "completion": "a0"},
            {"prompt": "b", "completion": ""}, {"prompt": "a", "completion": "a0", "score": None},
            {"prompt": [{"role": "user", "content": "hi"}], "completion": "c0"},
            {"prompt": [{"role": "user", "content": "hi"}], "completion": "c1"}]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = load_items(path)
    assert [it.prompt for it in items] == ["b", "a", [{"role": "user", "content": "hi"}]]
    assert items[0].answers == ("b0", "") and items[0].scores == (1.0, None)
    assert items[1].answers == ("a0", "a0")  # duplicates stay: the person sees what the policy gave
    assert items[0].id == item_id("b", ["b0", ""]) == load_items(path)[0].id  # same file, same ids
    assert len({it.id for it in items}) == 3


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "p"}, {"prompt": "q"}], "no field 'completion': a prompts file has no answers to rank"),
    ([{"prompt": "p", "completion": "x"}, {"prompt": "q", "completion": "y"}], "row 1: field 'prompt' has one answer"),
    ([{"prompt": "p", "completion": "x"}, {"prompt": "p", "completion": "y", "score": "high"}],
     "row 2: field 'score' must be a finite number or null"),
    ([{"prompt": "p", "completion": 3}], "row 1: field 'completion' must be text"),
])
def test_items_bad_rows_name_file_row_and_field(tmp_path, rows, message):
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=message.replace("(", r"\(")):
        load_items(path)


# ---------------------------------------------------------------------- durability
def test_a_judgment_is_written_and_synced_before_judge_returns(tmp_path, items, monkeypatch):
    calls = []
    real_write, real_fsync = os.write, os.fsync
    monkeypatch.setattr(os, "write", lambda fd, data: calls.append(("write", data)) or real_write(fd, data))
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(("fsync", fd)) or real_fsync(fd))
    with Store(tmp_path / "out", items) as store:
        calls.clear()
        j = store.judge("ann", items[0].id, [[2], [0, 1]], {})
        # one write of the whole line, then fsync, and only then the return: what was acknowledged is on disk
        assert [c[0] for c in calls] == ["write", "fsync"]
        assert calls[0][1].endswith(b"\n") and calls[0][1].count(b"\n") == 1
        line = json.loads((tmp_path / "out" / LOG).read_text())  # read while the store is still open
    assert line == {"v": 1, "event": "rank", "id": j.id, "item": items[0].id, "annotator": "ann", "time": j.time,
                    "ranking": [[2], [0, 1]], "flags": {}}
    assert read_saved_items(tmp_path / "out" / ITEMS) == items  # the folder alone can be exported


@pytest.mark.parametrize("cut", ["mid-line", "before its newline"])
def test_a_torn_last_line_is_skipped_with_a_warning_and_the_next_write_starts_fresh(tmp_path, items, caplog, cut):
    out = tmp_path / "out"
    with Store(out, items) as store:
        kept = store.judge("ann", items[0].id, [[0], [1], [2]], {})
    log_path = out / LOG
    line = json.dumps({"v": 1, "event": "rank", "id": "cut", "item": items[1].id, "annotator": "ann", "time": 2.0,
                       "ranking": [[0], [1], [2]], "flags": {}})
    with open(log_path, "ab") as f:  # what a kill in the middle of os.write would leave
        f.write(line[: 40 if cut == "mid-line" else None].encode())
    with caplog.at_level(logging.WARNING):
        assert [j.id for j in read_judgments(log_path)] == [kept.id]
    assert "line 2 is an incomplete line" in caplog.text
    with Store(out, items) as store:
        later = store.skip("ann", items[1].id)
    lines = log_path.read_bytes().split(b"\n")
    assert lines[1].startswith(b'{"v": 1, "event": "rank", "id": "cut"') and json.loads(lines[2])["id"] == later.id
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the same line is skipped the same way once it is no longer the last
        assert [j.id for j in read_judgments(log_path)] == [kept.id, later.id]
    assert "line 2 is an incomplete line" in caplog.text


def test_a_failed_write_is_not_acknowledged_and_leaves_the_log_readable(tmp_path, items, monkeypatch):
    out = tmp_path / "out"
    with Store(out, items) as store:
        real_write = os.write
        monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, data[:10]))  # the disk filled mid-line
        with pytest.raises(Refused, match="the judgment was not saved") as e:
            store.judge("ann", items[0].id, [[0], [1], [2]], {})
        assert e.value.status == 507
        monkeypatch.undo()
        assert store.judgments() == []
        j = store.judge("ann", items[0].id, [[1], [0], [2]], {})
    assert [x.id for x in read_judgments(out / LOG)] == [j.id]


def test_an_edited_log_is_refused_not_guessed(tmp_path, items):
    out = tmp_path / "out"
    with Store(out, items) as store:
        store.skip("ann", items[0].id)
    with open(out / LOG, "a") as f:
        f.write(json.dumps({"v": 1, "event": "rank", "id": "x", "item": items[1].id, "annotator": "ann",
                            "time": 1.0, "ranking": "0>1>2", "flags": {}}) + "\n")
    with pytest.raises(DataError, match=r"judgments.jsonl line 2: field 'ranking' must be a list"):
        read_judgments(out / LOG)


# ---------------------------------------------------------------------- undo, overwrite, resume
def test_undo_takes_back_ones_own_newest_judgment_only(tmp_path, items):
    with Store(tmp_path / "out", items, per_item=2) as store:
        a1 = store.judge("ann", items[0].id, [[0], [1], [2]], {})
        b1 = store.judge("bob", items[0].id, [[2], [1], [0]], {})
        a2 = store.skip("ann", items[1].id)
        assert store.undo("ann") == a2
        assert store.undo("ann") == a1
        with pytest.raises(Refused, match="ann has no judgment to undo"):
            store.undo("ann")
        assert store.judgments() == [b1]  # ann's undos never touch bob's judgment of the same item
        assert store.next("ann") == items[0]  # the undone item comes back
    live = read_judgments(tmp_path / "out" / LOG)
    assert live == [b1]
    events = [json.loads(line) for line in (tmp_path / "out" / LOG).read_text().splitlines()]
    assert [e["event"] for e in events] == ["rank", "rank", "skip", "undo", "undo"]
    assert [e["undoes"] for e in events[3:]] == [a2.id, a1.id]


def test_two_annotators_on_one_item_add_two_judgments(tmp_path, items):
    with Store(tmp_path / "out", items, per_item=2) as store:
        a = store.judge("ann", items[0].id, [[0], [1, 2]], {})
        b = store.judge("bob", items[0].id, [[1], [0]], {"2": "rude"})
        with pytest.raises(Refused, match="ann already judged item") as e:
            store.judge("ann", items[0].id, [[2], [1], [0]], {})
        assert e.value.status == 409
    assert read_judgments(tmp_path / "out" / LOG) == [a, b]
    assert b.flags == {2: "rude"}


def test_a_restart_resumes_where_each_annotator_was(tmp_path, items):
    out = tmp_path / "out"
    with Store(out, items, per_item=2) as store:
        store.judge("ann", items[0].id, [[0], [1], [2]], {})
        store.skip("ann", items[1].id)
        store.judge("bob", items[0].id, [[0], [1], [2]], {})
        before = (out / LOG).read_bytes()
    with Store(out, items, per_item=2) as store:
        assert (out / LOG).read_bytes() == before  # reopening writes nothing
        assert store.next("ann") == items[2]
        assert store.next("bob") == items[1]
        assert store.progress("ann") == {"items": 3, "per_item": 2, "complete": 1, "judgments": 2, "mine": 1,
                                         "skipped": 1, "annotators": {"ann": 1, "bob": 1}, "shared": 1}
    assert load_session(out) == (items, read_judgments(out / LOG))


# ---------------------------------------------------------------------- the queue
def test_per_item_people_get_each_item_and_a_hold_expires(tmp_path, items):
    now = [0.0]
    with Store(tmp_path / "out", items, per_item=2, lease_s=60, clock=lambda: now[0]) as store:
        assert store.next("ann") == items[0]
        assert store.next("bob") == items[0]  # the second of its two slots
        assert store.next("cy") == items[1]  # items[0]'s slots are held by ann and bob
        assert store.next("ann") == items[0]  # asking again (a reload) keeps one's own item
        now[0] = 61.0  # bob wandered off: his hold ran out, and cy refreshes
        assert store.next("cy") == items[0]
        store.judge("ann", items[0].id, [[0], [1], [2]], {})
        store.judge("cy", items[0].id, [[0], [1], [2]], {})
        # bob comes back after his hold ran out: his judgment is still taken (a person's work is never refused)
        store.judge("bob", items[0].id, [[0], [1], [2]], {})
        assert store.progress()["complete"] == 1 and store.progress()["judgments"] == 3
        assert store.next("bob") == items[1]


def test_no_item_left_for_an_annotator(tmp_path, items):
    with Store(tmp_path / "out", items) as store:
        for it in items:
            store.judge("ann", it.id, [[0], [1], [2]], {})
        assert store.next("ann") is None and store.next("bob") is None
        assert store.progress("bob")["complete"] == 3


@pytest.mark.parametrize("ranking, flags, message", [
    ([[0], [1]], {}, r"must hold every answer that is not flagged, once \(missing \[2\]\)"),
    ([[0], [1], [2]], {"1": "bad"}, r"flagged but ranked \[1\]"),
    ([[0], [0], [1], [2]], {}, "an answer appears twice"),
    ([[0], [3], [1], [2]], {}, r"answer indices are 0..2"),
    ([[0], [], [1, 2]], {}, "a list of groups"),
    ([[0], [1, 2]], {"7": "bad"}, r"'7' is not an answer index"),
    ([[0], [1, 2]], {"1": " "}, "the reason for answer 1 must be text"),
])
def test_a_ranking_must_be_a_partition_of_the_unflagged_answers(tmp_path, items, ranking, flags, message):
    with Store(tmp_path / "out", items) as store:
        with pytest.raises(Refused, match=message) as e:
            store.judge("ann", items[0].id, ranking, flags)
        assert e.value.status == 422
        with pytest.raises(Refused, match="unknown item 'nope'"):
            store.judge("ann", "nope", [[0], [1], [2]], {})
        with pytest.raises(Refused, match="annotator: give your name"):
            store.skip(" ", items[0].id)
        store.judge("ann", items[0].id, [[0, 1, 2]], {})  # all tied is a ranking too (it gives no pairs)
        store.judge("ann", items[1].id, [], {"0": "a", "1": "b", "2": "c"})  # all flagged: nothing to rank
    assert not any(len(j.ranking) > 1 for j in read_judgments(tmp_path / "out" / LOG))


# ---------------------------------------------------------------------- the folder
def test_one_server_per_folder_and_one_samples_file_per_folder(tmp_path, items):
    out = tmp_path / "out"
    with Store(out, items):
        with pytest.raises(ConfigError, match="annotate.out: another quartet process is writing"):
            Store(out, items)
    other = load_items(write_samples(tmp_path / "other.jsonl", prompts=2))
    with pytest.raises(ConfigError, match="holds judgments of other answers"):
        Store(out, other)
    (tmp_path / "file").write_text("mine")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        Store(tmp_path / "file", items)
    assert (tmp_path / "file").read_text() == "mine"
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / ITEMS).write_text("a user's notes\n")
    with pytest.raises(DataError, match="not an item written by quartet annotate"):
        Store(theirs, items)
    assert (theirs / ITEMS).read_text() == "a user's notes\n"
    assert not (theirs / LOG).exists()
