"""Agreement between people and with a judge: pair labels, Cohen's and Fleiss' kappa, Wilson intervals, all by hand."""

from __future__ import annotations

import json
import math

import pytest

from quartet.annotate import agreement as ag
from quartet.annotate.items import Item
from quartet.annotate.store import Judgment


def rank(item: str, who: str, ranking, flags=None, n: list = [0]) -> Judgment:  # noqa: B006 (a counter for ids)
    n[0] += 1
    return Judgment(f"j{n[0]}", "rank", item, who, float(n[0]), tuple(map(tuple, ranking)), dict(flags or {}))


def skip(item: str, who: str) -> Judgment:
    return Judgment(f"s-{item}-{who}", "skip", item, who, 0.0)


def test_a_ranking_as_pairs():
    ranking = [[0], [2, 3], [1]]
    assert ag.strict_pairs(ranking) == [(0, 2), (0, 3), (0, 1), (2, 1), (3, 1)]  # 4*3/2 = 6 less 1 tie
    assert ag.tied_pairs(ranking) == 1
    assert ag.pair_labels(ranking) == {(0, 1): "first", (0, 2): "first", (0, 3): "first", (1, 2): "second",
                                       (1, 3): "second", (2, 3): "tie"}
    assert ag.pair_labels([[2], [0]]) == {(0, 2): "second"}  # a flagged answer (1) is in no pair


def test_cohen_kappa_textbook_example():
    # 50 units: 20 yes/yes, 5 yes/no, 10 no/yes, 15 no/no. p_o = 0.7; p_e = 0.5*0.6 + 0.5*0.4 = 0.5; kappa = 0.4
    a = ["yes"] * 25 + ["no"] * 25
    b = ["yes"] * 20 + ["no"] * 5 + ["yes"] * 10 + ["no"] * 15
    assert ag.cohen_kappa(a, b) == pytest.approx(0.4)
    assert ag.cohen_kappa(["tie"] * 3, ["tie"] * 3) is None  # p_e = 1: undefined
    assert ag.cohen_kappa([], []) is None


def test_fleiss_kappa_of_fleiss_paper_table():
    # the worked example on Fleiss' kappa (10 subjects, 14 raters, 5 categories): P = 0.378, P_e = 0.213, k = 0.210
    table = [[0, 0, 0, 0, 14], [0, 2, 6, 4, 2], [0, 0, 3, 5, 6], [0, 3, 9, 2, 0], [2, 2, 8, 1, 1],
             [7, 7, 0, 0, 0], [3, 2, 6, 3, 0], [2, 5, 3, 2, 2], [6, 5, 2, 1, 0], [0, 2, 2, 3, 7]]
    assert ag.fleiss_kappa(table) == pytest.approx(0.20993, abs=1e-5)
    assert ag.fleiss_kappa([[3, 0, 0], [3, 0, 0]]) is None
    assert ag.fleiss_kappa([[1, 0, 0]]) is None  # one rating: no unit


def test_two_people_pairwise_agreement_and_cohen_kappa_by_hand():
    judgments = [
        rank("X", "alice", [[0], [1], [2]]), rank("X", "bob", [[1], [0], [2]]),
        rank("Y", "alice", [[0, 1], [2]]), rank("Y", "bob", [[0], [1], [2]]),
        rank("Z", "alice", [[2], [0], [1]]), rank("Z", "bob", [[0], [1]], {2: "off-topic"}),
        rank("W", "alice", [[1], [0]]),  # one person: not shared
        skip("X", "carol"),
    ]
    r = ag.rater_agreement(judgments)
    # strict comparisons: X 3 (0-1 differs), Y 2 (0-1 is alice's tie), Z 1 (bob flagged 2): 5 of 6 the same
    assert (r.items, r.annotators, r.comparisons) == (3, ["alice", "bob"], 6)
    assert r.agreement == pytest.approx(5 / 6)
    # Cohen over the 7 answer pairs both labelled: p_o = 5/7; alice first 6/7, tie 1/7; bob first 6/7, second 1/7;
    # p_e = 36/49; kappa = (35/49 - 36/49) / (13/49) = -1/13: agreeing on "first" is what chance gives here
    assert (r.kappa_kind, r.units) == ("cohen", 7)
    assert r.kappa == pytest.approx(-1 / 13)


def test_three_people_fleiss_kappa_by_hand():
    judgments = [rank("X", "a", [[0], [1], [2]]), rank("X", "b", [[0], [1], [2]]), rank("X", "c", [[2], [1], [0]])]
    r = ag.rater_agreement(judgments)
    # every answer pair: 2 first, 1 second -> P_i = (4 + 1 - 3) / 6 = 1/3; p = (2/3, 1/3, 0), P_e = 5/9;
    # kappa = (1/3 - 5/9) / (4/9) = -1/2. Pairwise: a-b agree on 3, a-c and b-c on none: 3 of 9
    assert r.kappa_kind == "fleiss" and r.kappa == pytest.approx(-0.5)
    assert r.agreement == pytest.approx(1 / 3) and r.comparisons == 9


def test_no_shared_item_gives_no_kappa():
    r = ag.rater_agreement([rank("X", "a", [[0], [1]]), rank("Y", "b", [[1], [0]])])
    assert (r.items, r.agreement, r.kappa, r.kappa_kind) == (0, None, None, None)


def test_wilson_interval_closed_form():
    lo, hi = ag.wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.27753, abs=1e-5)
    lo, hi = ag.wilson_interval(5, 10)  # centre 1/2; half = z / (1 + z^2/10) * sqrt(1/40 + z^2/400)
    z = 1.959963984540054
    half = z / (1 + z * z / 10) * math.sqrt(0.025 + z * z / 400)
    assert (lo, hi) == (pytest.approx(0.5 - half), pytest.approx(0.5 + half))
    assert lo == pytest.approx(0.2366, abs=1e-4)
    assert all(math.isnan(x) for x in ag.wilson_interval(0, 0))


def test_agreement_with_a_judge_per_person():
    scores = {"X": [3.0, 1.0, 2.0], "Y": [1.0, 1.0, None], "W": [2.0, 2.0, 0.0]}
    judgments = [
        rank("X", "alice", [[0], [1], [2]]),  # 0>1 yes, 0>2 yes, 1>2 no
        rank("Y", "alice", [[0, 1], [2]]),    # 0>2, 1>2: answer 2 unscored
        rank("W", "alice", [[0], [1], [2]]),  # 0>1 judge tie, 0>2 yes, 1>2 yes
        rank("X", "bob", [[1], [2], [0]]),    # all three against the judge (its order: 0, 2, 1)
    ]
    alice, bob = ag.judge_agreement(judgments, scores)
    assert (alice.annotator, alice.pairs, alice.agree, alice.judge_ties, alice.unscored) == ("alice", 5, 4, 1, 2)
    assert alice.share == pytest.approx(0.8)
    assert (alice.ci_low, alice.ci_high) == pytest.approx(ag.wilson_interval(4, 5))
    assert (bob.pairs, bob.agree, bob.share) == (3, 0, 0.0)


def test_summary_is_json_and_uses_the_samples_scores():
    items = [Item("X", "p", ("a", "b"), (1.0, 0.0)), Item("Y", "q", ("c", "d"), (None, None))]
    judgments = [rank("X", "alice", [[0], [1]]), rank("X", "bob", [[1], [0]]), skip("Y", "alice")]
    s = ag.summary(items, judgments)
    json.dumps(s, allow_nan=False)
    assert s["judgments"] == 2 and s["annotators"] == ["alice", "bob"]
    assert s["people"]["agreement"] == 0.0 and s["people"]["kappa_kind"] == "cohen"
    assert [(a["annotator"], a["share"]) for a in s["judge"]] == [("alice", 1.0), ("bob", 0.0)]
    assert ag.summary([Item("Y", "q", ("c", "d"), (None, None))], [])["judge"] is None
