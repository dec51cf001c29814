"""The constraints task: each check on hand-worked tricky cases, constraints read back from the prompt text, the
judges, and splits built by the seeded script with held-out topics and kind pairs."""

import pytest

from quartet.errors import DataError
from quartet.tasks import get_task
from quartet.tasks.constraints import build as c_build
from quartet.tasks.constraints import by_kind, constraints_of, judge, partial
from quartet.tasks.constraints.checks import (
    KINDS,
    check,
    ending,
    json_object,
    parse,
    render,
    sentences,
    words,
)
from quartet.tasks.constraints.combos import HELD_OUT, SLOTS, compatible, has_held_out_pair


def test_words_and_sentences_are_counted_as_documented():
    assert words("Don't stop: well-known *bold* text, 3.5 km!") == ["Don't", "stop", "well-known", "bold", "text",
                                                                   "3", "5", "km"]
    assert words("- **Item** \u2014 caf\u00e9 na\u00efve") == ["Item", "caf\u00e9", "na\u00efve"]
    assert len(sentences("It costs 3.5 dollars. Really?! Yes...")) == 3  # a decimal point ends none, ?! ends one
    assert len(sentences("One. Two")) == 2                               # a last fragment with a word counts
    assert len(sentences("Hello! ! ")) == 1                              # a mark alone is no sentence
    assert len(sentences("e.g. this one.")) == 2                         # an abbreviation ends one (documented)
    assert sentences("") == []


@pytest.mark.parametrize("constraint,response,met", [
    ({"kind": "max_words", "n": 3}, "Hello there, friend.", True),
    ({"kind": "max_words", "n": 3}, "Hello there, my friend.", False),
    ({"kind": "min_words", "n": 3}, "- one\n- two\n- three", True),        # bullet marks are not words
    ({"kind": "exact_words", "n": 3}, "It's well-known, truly!", True),    # apostrophe and hyphen join
    ({"kind": "exact_words", "n": 3}, "**Very good idea**", True),         # markdown is not a word
    ({"kind": "exact_sentences", "n": 2}, "Pi is 3.14. It is irrational!", True),
    ({"kind": "exact_sentences", "n": 1}, "Wait... what?", False),
    ({"kind": "include_word", "word": "blue"}, "BLUE skies.", True),       # any case
    ({"kind": "include_word", "word": "blue"}, "A blueberry.", False),     # the whole word
    ({"kind": "exclude_word", "word": "the"}, "Then there was rain.", True),
    ({"kind": "exclude_word", "word": "the"}, "In The end.", False),
    ({"kind": "letter_count", "letter": "z", "n": 3}, "Zig zag z", True),  # case-insensitive
    ({"kind": "letter_count", "letter": "z", "n": 3}, "zigzag", False),
    ({"kind": "exclude_letter", "letter": "e"}, "A cat sat.", True),
    ({"kind": "exclude_letter", "letter": "e"}, "END", False),
    ({"kind": "lowercase"}, "all lower case, 123!", True),
    ({"kind": "lowercase"}, "caf\u00c9", False),                           # Unicode upper case
    ({"kind": "lowercase"}, "123 !", False),                               # no letter at all
    ({"kind": "uppercase"}, "ALL CAPS, \u00c9T\u00c9 2024!", True),
    ({"kind": "uppercase"}, "ALL CAPs", False),
    ({"kind": "end_with", "mark": "?"}, 'She asked "why?"  ', True),       # closing quote and spaces skipped
    ({"kind": "end_with", "mark": "?"}, "Really?!", False),
    ({"kind": "end_with", "mark": "!"}, "**Go now!**", True),              # markdown emphasis skipped
    ({"kind": "end_with", "mark": "."}, "(The end.)", True),
    ({"kind": "end_with", "mark": "."}, "Done", False),
    ({"kind": "bullets", "n": 3}, "Intro:\n- one\n* two\n  \u2022 three\nBye", True),  # -, * and the bullet sign
    ({"kind": "bullets", "n": 2}, "**Bold** line\n- one\n---\n-two\n1. three\n- four", True),  # not bullets: **, ---, -two, 1.
    ({"kind": "bullets", "n": 2}, "- one", False),
    ({"kind": "json_keys", "keys": ["name", "mood"]}, '{"mood": "calm", "name": "Ada"}', True),  # any order
    ({"kind": "json_keys", "keys": ["name", "mood"]}, '```json\n{"name": "Ada", "mood": "calm"}\n```', True),
    ({"kind": "json_keys", "keys": ["name", "mood"]}, '```\n{"name": "Ada", "mood": "calm"}```', True),
    ({"kind": "json_keys", "keys": ["name", "mood"]}, 'Here: {"name": "Ada", "mood": "calm"}', False),  # text around
    ({"kind": "json_keys", "keys": ["name", "mood"]}, '{"name": "Ada"}', False),                        # a key missing
    ({"kind": "json_keys", "keys": ["name", "mood"]}, '{"name": 1, "mood": 2, "age": 3}', False),      # one more
    ({"kind": "json_keys", "keys": ["name", "mood"]}, '["name", "mood"]', False),                      # not an object
    ({"kind": "json_keys", "keys": ["name", "mood"]}, "{'name': 1, 'mood': 2}", False),                # not JSON
    ({"kind": "no_commas", }, "No commas here.", True),
    ({"kind": "no_commas", }, "One, two.", False),
    ({"kind": "no_commas", }, "Full-width\uff0c too.", False),
])
def test_check(constraint, response, met):
    assert check(constraint, response) is met


def test_helpers_on_edge_cases():
    assert ending("  ") == "" and ending("Hi?)\n") == "?"
    assert json_object('  {"a": 1}  ') == {"a": 1} and json_object("") is None
    assert json_object('```json\n{"a": 1}\n```\nmore') is None


def test_every_kind_renders_and_parses_back():
    examples = {"max_words": {"n": 15}, "min_words": {"n": 20}, "exact_words": {"n": 3}, "exact_sentences": {"n": 2},
                "include_word": {"word": "river"}, "exclude_word": {"word": "the"},
                "letter_count": {"letter": "k", "n": 2}, "exclude_letter": {"letter": "y"}, "lowercase": {},
                "uppercase": {}, "end_with": {"mark": "!"}, "bullets": {"n": 4},
                "json_keys": {"keys": ["title", "score"]}, "no_commas": {}}
    assert set(examples) == set(KINDS) == set(SLOTS)
    for kind, params in examples.items():
        spec = {"kind": kind, **params}
        assert parse("Describe a cat. " + render(spec)) == [spec], kind
    assert render({"kind": "exact_words", "n": 3}) == "Answer in exactly three words."
    assert render({"kind": "end_with", "mark": "?"}) == "End your answer with a question mark."
    assert render({"kind": "json_keys", "keys": ["a", "b"]}) == 'Answer with only a JSON object that has exactly the keys "a" and "b".'


def test_judges_read_the_constraints_from_the_prompt():
    prompt = "Describe a cat. Answer in at most five words. Write your whole answer in capital letters."
    assert constraints_of(prompt) == [{"kind": "max_words", "n": 5}, {"kind": "uppercase"}]
    responses = ["A SMALL SOFT CAT.", "A small soft cat.", "A VERY SMALL AND SOFT CAT."]
    assert judge([prompt] * 3, responses) == [1.0, 0.0, 0.0]
    assert partial([prompt] * 3, responses) == [1.0, 0.5, 0.5]
    assert by_kind([prompt], ["A small soft cat."]) == [{"max_words": 1.0, "uppercase": 0.0, "2 constraints": 0.0}]
    held = "Describe a cat. Write your whole answer in lowercase letters, with no capital letters. End your answer with a period."
    assert by_kind([held], ["a cat."]) == [{"lowercase": 1.0, "end_with": 1.0, "2 constraints": 1.0,
                                           "held-out pairs": 1.0}]
    with pytest.raises(DataError, match="task:constraints: the prompt states no constraint"):
        judge(["Describe a cat."], ["ok"])


def test_combinations_never_contradict_and_held_out_pairs_are_compatible():
    assert not compatible([{"kind": "lowercase"}, {"kind": "uppercase"}])           # one slot
    assert not compatible([{"kind": "json_keys", "keys": ["a", "b"]}, {"kind": "no_commas"}])
    assert not compatible([{"kind": "exclude_letter", "letter": "r"}, {"kind": "include_word", "word": "river"}])
    assert compatible([{"kind": "exclude_letter", "letter": "r"}, {"kind": "exclude_word", "word": "river"}])
    for pair in HELD_OUT:
        a, b = sorted(pair)
        assert SLOTS[a] != SLOTS[b]


def test_shipped_splits():
    task = get_task("constraints")
    assert task.binary and set(task.judges) == {"partial"}
    train, eval_ = task.rows("train"), task.rows("eval")
    assert (len(train), len(eval_)) == (2000, 300)
    for row in train + eval_:
        assert constraints_of(row["prompt"]) == row["constraints"]
        assert compatible(row["constraints"]) and has_held_out_pair(row["constraints"]) == row["held_out"]
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in eval_}
    assert {r["topic"] for r in eval_} == set(c_build.EVAL_TOPICS)
    assert not {r["topic"] for r in train} & set(c_build.EVAL_TOPICS)   # eval topics never seen in train
    assert not any(r["held_out"] for r in train) and sum(r["held_out"] for r in eval_) == 100
    seen_pairs = {frozenset((a["kind"], b["kind"])) for r in eval_ if r["held_out"] for a in r["constraints"]
                  for b in r["constraints"] if a is not b}
    assert HELD_OUT <= seen_pairs                                          # every held-out pair is measured
    assert {len(r["constraints"]) for r in train} == {1, 2, 3}


def test_shipped_files_are_what_the_builder_writes():
    task = get_task("constraints")
    for split, rows in c_build.build().items():
        assert task.rows(split) == rows, f"constraints/{split} differs from build.py; rerun it"
