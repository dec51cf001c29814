"""label with an `llm:` judge: K answers ranked by their pairwise wins in both orders (checked against a slow loop), the
same files as any judge, a verdict cache that makes a rerun after a crash pay only for the rest, position bias and
ties in the summary, and one-line errors before any model loads. A fake judge stands in for the model (it prefers
the longer answer, with a pull toward the answer shown first); the real local judge runs once, through the CLI."""

from __future__ import annotations

import itertools
import json

import pytest
from trainer_helpers import TINY, run_cli, single_thread  # noqa: F401

import quartet.judges.llm
from quartet.config import LabelConfig, from_dict
from quartet.errors import QuartetError
from quartet.tasks import get_task
from quartet.trainers import label as label_module
from quartet.trainers.label import label

JUDGE = "llm:" + TINY  # resolves without loading anything; the fake judge below answers in its place
BIAS = 2.5
"""the fake judge's pull toward the answer shown first, in characters"""


class LengthJudge:
    """Stands in for quartet.judges.llm_local.LocalLLMJudge: log-odds len(first) - len(second) + BIAS. A pair more
    than BIAS characters apart goes to the longer answer in both orders; a closer one goes to whichever is shown
    first, in both orders: position bias, a tie."""

    rows: list[int] = []
    """rows asked per call, over every instance"""
    rubrics: list[str] = []
    fail_after: int | None = None
    """raise once a call would take the rows asked past this"""

    def __init__(self, model, rubric, mode="pairwise", batch_size=16, where="judge", dtype="auto"):
        self.name = f"llm:{model}|length"
        LengthJudge.rubrics.append(rubric)

    def compare(self, prompts, firsts, seconds):
        if LengthJudge.fail_after is not None and sum(LengthJudge.rows) + len(firsts) > LengthJudge.fail_after:
            raise RuntimeError("the judge died")
        LengthJudge.rows.append(len(firsts))
        return [len(a) - len(b) + BIAS for a, b in zip(firsts, seconds)]


@pytest.fixture
def fake(monkeypatch):
    LengthJudge.rows, LengthJudge.rubrics, LengthJudge.fail_after = [], [], None
    monkeypatch.setattr(quartet.judges.llm, "LocalLLMJudge", LengthJudge)
    return LengthJudge


def make_cfg(tmp_path, **overrides) -> LabelConfig:
    base = {
        "policy": TINY,
        "prompts": {"path": "task:tiny-target/train", "limit": 12, "max_prompt_tokens": 32},
        "judge": JUDGE,
        "llm_judge": {"batch_size": 2},  # the cache commits every 2 * 4 = 8 verdicts
        "num_samples": 4,
        "generation": {"max_new_tokens": 12, "batch_size": 24},
        "pairing": "all-pairs",
        "min_gap": 0.0,
        "output": str(tmp_path / "label" / "prefs.jsonl"),
    }
    base.update(overrides)
    return from_dict(LabelConfig, base)


def slow_ranking(answers: list[str], orders: str = "agree") -> tuple[dict[str, float], int, int]:
    """Win fractions of one prompt's distinct non-empty answers under the fake judge, by hand. agree: i beats j when
    it is more than BIAS characters longer, else a tie (both orders went to the first-shown answer). average: the
    mean log-odds ((d + BIAS) - (-d + BIAS)) / 2 = d, so the longer wins and only equal lengths tie. Also the pairs
    and the ties among them."""
    cands = list(dict.fromkeys(a for a in answers if a.strip()))
    wins = dict.fromkeys(cands, 0.0)
    ties = 0
    for a, b in itertools.combinations(cands, 2):
        d = len(a) - len(b)
        if abs(d) > (BIAS if orders == "agree" else 0):
            wins[a if d > 0 else b] += 1.0
        else:
            wins[a] += 0.5
            wins[b] += 0.5
            ties += 1
    n = len(cands)
    return {a: w / (n - 1) if n > 1 else 0.5 for a, w in wins.items()}, n * (n - 1) // 2, ties


def test_answers_are_ranked_by_wins_in_both_orders_and_the_files_are_labels(tmp_path, fake):
    result = label(make_cfg(tmp_path))
    folder = tmp_path / "label"
    assert sorted(p.name for p in folder.iterdir()) == [
        "prefs.config.yaml", "prefs.jsonl", "prefs.samples.jsonl", "prefs.summary.md", "prefs.verdicts.sqlite"]
    answers = [json.loads(line) for line in (folder / "prefs.samples.jsonl").read_text().splitlines()]
    assert len(answers) == 12 * 4 and [a["sample"] for a in answers] == [0, 1, 2, 3] * 12

    pairs = ties = 0
    for i in range(0, len(answers), 4):
        group = answers[i : i + 4]
        scores, n, t = slow_ranking([a["completion"] for a in group])
        pairs, ties = pairs + n, ties + t
        for a in group:  # an empty answer is no candidate: 0, unjudged
            assert a["score"] == pytest.approx(scores.get(a["completion"], 0.0), abs=1e-12)
    assert 0 < ties < pairs  # the fixture's answers give both decided pairs and order-decided ones

    rows = [json.loads(line) for line in result.output.read_text().splitlines()]
    assert rows and all(r["chosen_score"] > r["rejected_score"] for r in rows)
    scored = {(a["prompt"], a["completion"]): a["score"] for a in answers}
    assert all(scored[r["prompt"], r["chosen"]] == r["chosen_score"] for r in rows)

    # every pair asked once in each order; every tie here is one the order decided
    assert result.judge_stats == {"label/judge_pairs": pairs, "label/position_bias": ties / pairs,
                                  "label/judge_ties": ties / pairs, "label/judge_calls": 2 * pairs,
                                  "label/cache_hits": 0}
    assert sum(fake.rows) == 2 * pairs and max(fake.rows) <= 8
    assert fake.rubrics == [get_task("tiny-target").rubric]  # the prompts' task's rubric by default
    summary = result.summary.read_text()
    assert "position bias (share of pairs the order decided)" in summary
    assert f"verdicts asked / read from the cache: {2 * pairs} / 0" in summary


def test_orders_average_decides_by_the_mean_log_odds(tmp_path, fake):
    """llm_judge.orders: average: the fake judge's pull to the first position (BIAS) is the same in both orders and
    cancels in the mean; every pair of unequal lengths is decided, and position bias is counted as under agree."""
    result = label(make_cfg(tmp_path, llm_judge={"batch_size": 2, "orders": "average"}))
    answers = [json.loads(line) for line in (tmp_path / "label" / "prefs.samples.jsonl").read_text().splitlines()]
    pairs = ties = biased = 0
    for i in range(0, len(answers), 4):
        group = [a["completion"] for a in answers[i : i + 4]]
        scores, n, t = slow_ranking(group, "average")
        pairs, ties = pairs + n, ties + t
        cands = list(dict.fromkeys(a for a in group if a.strip()))
        biased += sum(abs(len(a) - len(b)) <= BIAS for a, b in itertools.combinations(cands, 2))
        for a in answers[i : i + 4]:
            assert a["score"] == pytest.approx(scores.get(a["completion"], 0.0), abs=1e-12)
    assert ties < biased  # pairs the order decided under agree, most of them decided here
    assert result.judge_stats["label/position_bias"] == biased / pairs
    assert result.judge_stats["label/judge_ties"] == ties / pairs
    assert "two orders made one verdict by (llm_judge.orders): average" in result.summary.read_text()


def test_a_run_killed_half_way_pays_only_for_the_rest(tmp_path, fake):
    clean = label(make_cfg(tmp_path / "clean"))
    total = clean.judge_stats["label/judge_calls"]

    fake.rows, fake.fail_after = [], 20  # dies in its third chunk of 8: two chunks committed
    with pytest.raises(RuntimeError, match="the judge died"):
        label(make_cfg(tmp_path))
    left = {p.name for p in (tmp_path / "label").iterdir()}
    assert "prefs.jsonl" not in left and "prefs.verdicts.sqlite" in left  # only the cache: no config marks it

    fake.fail_after = None
    again = label(make_cfg(tmp_path))  # the same seed samples the same answers: 16 verdicts are on disk
    assert again.judge_stats["label/cache_hits"] == 16
    assert again.judge_stats["label/judge_calls"] == total - 16
    assert again.output.read_text() == clean.output.read_text()

    third = label(make_cfg(tmp_path))  # a finished run's rerun pays nothing
    assert (third.judge_stats["label/judge_calls"], third.judge_stats["label/cache_hits"]) == (0, total)


def test_a_users_file_at_the_cache_path_is_refused_before_any_model_loads(tmp_path, fake, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(label_module, "load_causal_lm", no_model)
    (tmp_path / "label").mkdir()
    mine = tmp_path / "label" / "prefs.verdicts.sqlite"
    mine.write_text("my notes\n")
    with pytest.raises(QuartetError, match="prefs.verdicts.sqlite: is not a verdict cache"):
        label(make_cfg(tmp_path))
    assert mine.read_text() == "my notes\n" and [p.name for p in mine.parent.iterdir()] == [mine.name]


@pytest.mark.parametrize("overrides, message", [
    ({"judge": "llm:no/such/model"}, "label.judge: "),
    ({"judge": "llm:judge-model", "llm_judge": {"base_url": "http://127.0.0.1:9/v1"}},
     "label.llm_judge.base_url: cannot reach http://127.0.0.1:9/v1/models"),
    ({"llm_judge": {"rubric": "missing-principles.txt"}}, "label.llm_judge.rubric: missing-principles.txt: no such"),
])
def test_a_bad_judge_is_one_error_before_any_model_loads(tmp_path, monkeypatch, overrides, message):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(label_module, "load_causal_lm", no_model)
    monkeypatch.setattr(quartet.judges.llm, "LocalLLMJudge", no_model)
    with pytest.raises(QuartetError) as e:
        label(make_cfg(tmp_path, **overrides))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert not (tmp_path / "label").exists()


def test_cli_label_with_a_real_local_judge(tmp_path):
    """The tiny random judge, pointwise: each answer rated alone, so the two orders agree by construction and the
    ratings, which differ answer by answer, decide pairs (pairwise, a random model picks a position every time)."""
    out = run_cli("label", f"policy={TINY}", "prompts.path=task:tiny-target/train", "prompts.limit=4",
                  f"judge={JUDGE}", "llm_judge.mode=pointwise", "generation.max_new_tokens=8", "min_gap=0",
                  f"output={tmp_path / 'prefs.jsonl'}")
    assert out.returncode == 0, out.stderr
    assert "position bias (share of pairs the order decided): 0" in out.stdout
    assert {p.name for p in tmp_path.iterdir()} >= {"prefs.jsonl", "prefs.samples.jsonl", "prefs.verdicts.sqlite"}
