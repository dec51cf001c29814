"""The arithmetic task: answers read as documented (hand-worked cases), expressions computed, levels recognised,
splits built by the seeded script and disjoint."""

from decimal import Decimal

import pytest

from quartet.errors import DataError
from quartet.tasks import get_task
from quartet.tasks.arithmetic import answer_format, by_level, judge, problem
from quartet.tasks.arithmetic import build as ar_build
from quartet.tasks.arithmetic.answer import (
    LEVELS,
    evaluate,
    extract_answer,
    has_answer_format,
    level_of,
    shape,
)


@pytest.mark.parametrize("response,value", [
    ("Answer: 42", 42),
    ("4 + 3 = 7\nAnswer: 7.", 7),                          # a full stop ends the sentence, not a decimal
    ("Answer: -1,234.", -1234),                            # sign and thousands commas
    ("answer: \u221212", -12),                             # the Unicode minus, any case
    ("**Answer:** 85", 85),                                # markdown around the marker
    ("The answer is: 5", 5),
    ("Answer: $1,000", 1000),
    ("Answer: 85.0", 85),                                  # the same number
    ("Answer: 3 then Answer: 9", 9),                       # the last marker
    ("Answer: 12 and 7 more", 12),                         # the marker wins over the last number
    ("so \\boxed{1,000} it is; 17 apples", 1000),           # \boxed before the last number
    ("\\boxed{x = 56}", 56),                               # the box's last number
    ("\\boxed{12} Answer: 13", 13),                        # Answer: before \boxed
    ("4 * 7 = 28.", 28),                                   # the last number
    ("12-5", 5),                                           # a hyphen after a digit is subtraction
    ("x = 3 - 7 = -4", -4),                                # a sign after a space
    ("3.5 and 2.", 2),
    ("12,34", 34),                                         # not a thousands group: two numbers
    ("version v2 then 7", 7),
    ("1,234,567", 1234567),
])
def test_answer_is_read_as_documented(response, value):
    assert extract_answer(response) == Decimal(value)


def test_no_number_no_answer():
    assert extract_answer("I do not know.") is None
    assert extract_answer("") is None
    assert extract_answer("Answer: N") is None


@pytest.mark.parametrize("response,marked", [
    ("Answer: 7", True), ("answer: -3.", True), ("\\boxed{7}", True), ("4 + 3 = 7", False),
    ("The answer is 7", False), ("Answer: N", False), ("\\boxed{}", False),
])
def test_format_reward_needs_a_marked_number(response, marked):
    assert has_answer_format(response) is marked
    assert answer_format(["p"], [response]) == [float(marked)]


def test_expressions_are_computed_with_precedence_and_nothing_else():
    assert evaluate("4 * 7 + 9") == 37
    assert evaluate("9 - 4 * 2") == 1
    assert evaluate("2 - 3 - 4") == -5                     # left to right
    assert evaluate("(3 + 4) \u00d7 2") == 14
    assert evaluate("-3 + 5") == 2
    for bad in ("2 ** 3", "__import__('os')", "3 +", "(1 + 2", "1 / 2"):
        with pytest.raises(ValueError):
            evaluate(bad)


def test_levels_are_recognised_by_shape():
    assert shape("37 * 4 + 12") == "2 * 1 + 2"
    assert [level_of(e) for e in ("3 + 4", "8 * 9", "57 - 6", "57 + 26", "57 * 6", "4 * 4 + 5", "100 + 1")] == [
        1, 1, 2, 3, 3, 4, None]
    shapes = [s for level in LEVELS.values() for s in level]
    assert len(shapes) == len(set(shapes))                 # a shape belongs to one level


def test_judge_reads_the_problem_from_the_prompt():
    prompts = ['What is 23 * 6? End your reply with "Answer: " and the number.', "Compute (3 + 4) * 2 please."]
    assert judge(prompts, ["23 * 6 = 138\nAnswer: 138", "Answer: 14"]) == [1.0, 1.0]
    assert judge(prompts, ["Answer: 150", "it is 14, no 15"]) == [0.0, 0.0]
    assert by_level(prompts, ["Answer: 138", "Answer: 1"]) == [{"level 3": 1.0}, {"other": 0.0}]
    assert problem(prompts[0]) == ("23 * 6", 138)
    with pytest.raises(DataError, match="task:arithmetic: the prompt holds no integer expression"):
        judge(["Write a poem."], ["Answer: 1"])


def test_shipped_rows_are_right_and_their_splits_disjoint():
    task = get_task("arithmetic")
    assert task.binary and task.judges == {"format": answer_format}
    train, eval_ = task.rows("train"), task.rows("eval")
    for row in train + eval_:
        assert problem(row["prompt"]) == (row["expression"], row["answer"])
        assert level_of(row["expression"]) == row["level"]
    expressions = [r["expression"] for r in train + eval_]
    assert len(expressions) == len(set(expressions))       # no problem twice, none in both splits
    assert [r["level"] for r in eval_[:8]] == [1, 2, 3, 4, 1, 2, 3, 4]  # interleaved: the first 4k hold k of each
    assert {lv: sum(r["level"] == lv for r in eval_) for lv in LEVELS} == {1: 75, 2: 75, 3: 75, 4: 75}
    assert sum(r["level"] == 1 for r in train) == 9 * 9 * 3 - 75  # level 1's every other problem
    assert judge([r["prompt"] for r in eval_], [f"Answer: {r['answer']}" for r in eval_]) == [1.0] * len(eval_)


def test_shipped_files_are_what_the_builder_writes():
    task = get_task("arithmetic")
    for split, rows in ar_build.build().items():
        assert task.rows(split) == rows, f"arithmetic/{split} differs from build.py; rerun it"
