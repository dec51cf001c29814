"""Rankings -> preference pairs: a hand-worked ranking, ties / flags / identical / empty answers, several people,
the real preference reader on the file, and the folder -> files export with its output rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from quartet.annotate.export import ExportCounts, export, sidecars, write_export
from quartet.annotate.items import Item, item_id, save_items
from quartet.annotate.store import ITEMS, LOG, Judgment
from quartet.config import DataConfig
from quartet.data import load_preferences
from quartet.errors import ConfigError, DataError


def make_item(prompt, answers, scores=None) -> Item:
    return Item(item_id(prompt, answers), prompt, tuple(answers), tuple(scores or [None] * len(answers)))


def rank(item: Item, who: str, ranking, flags=None, n: list = [0]) -> Judgment:  # noqa: B006 (a counter for ids)
    n[0] += 1
    return Judgment(f"j{n[0]}", "rank", item.id, who, float(n[0]), tuple(map(tuple, ranking)), dict(flags or {}))


ITEM = make_item("Name a colour.", ["red", "the sea", "blue", "green"])


def test_hand_worked_ranking_gives_its_five_pairs_and_one_tie():
    rows, counts = export([ITEM], [rank(ITEM, "ann", [[0], [2, 3], [1]])])
    # 4 answers: 6 pairs, less the tie of 2 and 3; answer 0 beats all three, 2 and 3 beat 1
    expected = [("red", "blue"), ("red", "green"), ("red", "the sea"), ("blue", "the sea"), ("green", "the sea")]
    assert [(r["chosen"], r["rejected"]) for r in rows] == expected
    assert all(r == {"prompt": "Name a colour.", "chosen": r["chosen"], "rejected": r["rejected"], "item": ITEM.id,
                     "annotator": "ann", "group": ITEM.id} for r in rows)
    assert counts == ExportCounts(judgments=1, items=1, skips=0, pairs=5, tied=1)


def test_flagged_identical_and_empty_answers_make_no_pair():
    flagged, counts = export([ITEM], [rank(ITEM, "ann", [[3], [0]], {1: "off-topic", 2: "rude"})])
    assert [(r["chosen"], r["rejected"]) for r in flagged] == [("green", "red")]
    assert (counts.flagged, counts.pairs) == (2, 1)
    odd = make_item("p", ["same", " same\n", "  ", "other"])
    rows, counts = export([odd], [rank(odd, "ann", [[0], [1], [2], [3]])])
    # 0-1 identical once stripped; 0-2, 1-2, 2-3 hold an empty answer; 0-3 and 1-3 kept
    assert [(r["chosen"], r["rejected"]) for r in rows] == [("same", "other"), (" same\n", "other")]
    assert (counts.identical, counts.empty, counts.pairs) == (1, 3, 2)


def test_several_people_keep_their_own_pairs_or_the_majority():
    two = make_item("q", ["a", "b"])
    judgments = [rank(ITEM, "ann", [[0], [1], [2, 3]]), rank(ITEM, "bob", [[1], [0], [2], [3]]),
                 rank(ITEM, "cy", [[0], [1], [2], [3]]), rank(two, "ann", [[1], [0]]),
                 Judgment("s1", "skip", two.id, "bob", 0.0)]
    rows, counts = export([ITEM, two], judgments)
    assert (counts.judgments, counts.items, counts.skips, counts.tied, counts.pairs) == (4, 2, 1, 1, 5 + 6 + 6 + 1)
    assert sum(r["annotator"] == "bob" for r in rows) == 6
    rows, counts = export([ITEM, two], judgments, majority=True)
    # ITEM, 3 people: 0>1 ann+cy; 0>2, 0>3, 1>2, 1>3 all three; 2-3: ann tie, bob and cy 2>3 -> 2>3 by bob+cy
    got = {(r["chosen"], r["rejected"]): r["annotator"] for r in rows if r["item"] == ITEM.id}
    assert got == {("red", "the sea"): "ann,cy", ("red", "blue"): "ann,bob,cy", ("red", "green"): "ann,bob,cy",
                   ("the sea", "blue"): "ann,bob,cy", ("the sea", "green"): "ann,bob,cy",
                   ("blue", "green"): "bob,cy"}
    assert [(r["chosen"], r["annotator"]) for r in rows if r["item"] == two.id] == [("b", "ann")]  # one of one
    assert (counts.pairs, counts.no_majority, counts.tied) == (7, 0, 0)
    split = [rank(two, "ann", [[0], [1]]), rank(two, "bob", [[1], [0]])]
    assert export([two], split, majority=True)[1].no_majority == 1  # 1 against 1: no majority


def test_a_judgment_of_an_unknown_item_or_answer_is_an_error():
    other = make_item("other", ["x", "y"])
    with pytest.raises(DataError, match=f"judgments: ann's judgment j\\d+ names item {other.id}, which is not"):
        export([ITEM], [rank(other, "ann", [[0], [1]])])
    with pytest.raises(DataError, match="ranks answer 7 of item"):
        export([ITEM], [rank(ITEM, "ann", [[0], [7]])])


def test_the_preference_reader_takes_the_exported_rows(tmp_path):
    chat = make_item([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}], ["Hi.", "Hey"])
    rows, _ = export([ITEM, chat], [rank(ITEM, "ann", [[0], [2, 3], [1]]), rank(chat, "bob", [[1], [0]])])
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    pairs = load_preferences(DataConfig(path=str(path)))  # the reader quartet rm and quartet dpo use
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [(r["prompt"], r["chosen"], r["rejected"])
                                                                  for r in rows]
    assert pairs[-1].prompt == chat.prompt and pairs[-1].margin is None


def annotate_folder(tmp_path, items, judgments):
    folder = tmp_path / "ann"
    folder.mkdir()
    save_items(folder / ITEMS, items)
    (folder / LOG).write_text("".join(json.dumps(j.to_json()) + "\n" for j in judgments), encoding="utf-8")
    return folder


def test_write_export_writes_three_files_and_replaces_only_its_own(tmp_path):
    scored = make_item("Name a colour.", ["red", "the sea", "blue"], [3.0, 1.0, 2.0])
    folder = annotate_folder(tmp_path, [scored], [rank(scored, "ann", [[0], [1], [2]]),
                                                  rank(scored, "bob", [[0], [2], [1]])])
    out = tmp_path / "out" / "prefs.jsonl"
    counts = write_export(folder, out)
    assert counts.pairs == 6
    summary_path, agreement_path = sidecars(out)
    assert len(out.read_text().splitlines()) == 6
    data = json.loads(agreement_path.read_text())
    assert data["counts"]["pairs"] == 6 and data["people"]["agreement"] == pytest.approx(2 / 3)
    assert (data["judge_spec"], data["judge_source"]) == (None, "score")  # the items' score column: 3, 1, 2
    assert [(a["annotator"], a["pairs"], a["agree"]) for a in data["judge"]] == [("ann", 3, 2), ("bob", 3, 3)]
    text = summary_path.read_text()
    assert "pairwise agreement: 0.667" in text and "the samples' score column" in text
    write_export(folder, out, majority=True)  # its own files: replaced
    assert json.loads(agreement_path.read_text())["counts"]["pairs"] == 2  # 0>1, 0>2; 1-2 split 1 to 1

    user = tmp_path / "mine.jsonl"
    user.write_text("my file\n")
    with pytest.raises(ConfigError, match="exists and was not written by Quartet"):
        write_export(folder, user)
    assert user.read_text() == "my file\n" and not sidecars(user)[1].exists()
    with pytest.raises(ConfigError, match="is not a .jsonl file"):
        write_export(folder, tmp_path / "prefs.json")


def test_write_export_scores_answers_with_a_judge_spec(tmp_path):
    item = make_item("say", ["a", "bbb", "cc"])
    folder = annotate_folder(tmp_path, [item], [rank(item, "ann", [[1], [2], [0]])])
    write_export(folder, tmp_path / "p.jsonl", judge="judge_helpers:length")
    data = json.loads(sidecars(tmp_path / "p.jsonl")[1].read_text())
    # lengths 1, 3, 2: the judge orders bbb > cc > a, as ann did
    assert (data["judge_spec"], data["judge_source"]) == ("judge_helpers:length", "spec")
    assert [(a["annotator"], a["pairs"], a["share"]) for a in data["judge"]] == [("ann", 3, 1.0)]
    assert data["people"]["items"] == 0 and data["people"]["kappa"] is None


def test_nothing_to_export_is_an_error_and_writes_nothing(tmp_path):
    folder = annotate_folder(tmp_path, [ITEM], [Judgment("s", "skip", ITEM.id, "ann", 0.0)])
    with pytest.raises(DataError, match="no preference pairs to export .*0 rankings, 1 skips"):
        write_export(folder, tmp_path / "p.jsonl")
    assert not list(tmp_path.glob("p.*"))
    with pytest.raises(DataError, match="not a quartet annotate folder"):
        write_export(tmp_path / "nowhere", tmp_path / "p.jsonl")


def test_cli_export(tmp_path):
    folder = annotate_folder(tmp_path, [ITEM], [rank(ITEM, "ann", [[0], [2, 3], [1]]), rank(ITEM, "bob", [[0], [1]],
                                                                                            {2: "x", 3: "y"})])
    out = tmp_path / "prefs.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "quartet.cli", "annotate", "--out", str(folder), "--export", str(out)]
    done = subprocess.run([*cmd, "--majority"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    # ann and bob agree on 0 > 1, the only pair both ranked; ann alone is no majority of 2 on the other 4
    assert [json.loads(line)["annotator"] for line in out.read_text().splitlines()] == ["ann,bob"]
    assert "without a majority" in done.stdout and out.with_name("prefs.agreement.json").is_file()


def test_the_report_of_a_reward_model_trained_on_people_s_pairs_shows_their_agreement(tmp_path):
    from quartet.monitor.report import write_report

    folder = annotate_folder(tmp_path, [ITEM], [rank(ITEM, "ann", [[0], [2], [3], [1]]),
                                                 rank(ITEM, "bob", [[0], [3], [2], [1]])])
    out = tmp_path / "prefs.jsonl"
    write_export(folder, out)
    run = tmp_path / "rm"
    run.mkdir()
    (run / "config.yaml").write_text(f"model: minilm\ndata:\n  path: {out}\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "rm/loss": 0.69}\n')
    html = write_report(run).read_text()
    # 6 answer pairs, both people strict on all; they disagree on 2 > 3 only: agreement 5/6
    assert "People&#x27;s agreement" in html or "People's agreement" in html
    assert "ann, bob" in html and "0.8333" in html and "kappa (cohen)" in html.lower()
    (run / "config.yaml").write_text("model: minilm\ndata:\n  path: elsewhere.jsonl\n")
    assert "agreement" not in write_report(run).read_text().lower().split("<h2 id=\"findings\">")[1].split("configs")[0]
