"""quartet eval's judged win rate: each checkpoint's response against the baseline's to the same (prompt, sample), in
both orders, by a fake judge that prefers the longer answer (hand-checked from the responses), its verdicts cached
in the eval's folder so a rerun, or a rerun after a crash, asks only for what it lacks."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

import quartet.judges.llm
from quartet.config import EvalConfig, LLMJudgeConfig
from quartet.errors import QuartetError
from quartet.eval.evaluate import evaluate, format_table
from quartet.eval.stats import bootstrap_ci
from quartet.preflight import check_inputs, stage_inputs

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA

TINY = "tiny:llama?hidden=32&layers=2&heads=4&vocab=300"
OTHER = TINY + "&seed=1"
JUDGE = "llm:" + TINY
FAST = dict(prompts="task:tiny-target/eval", num_prompts=6, max_new_tokens=10, relevance=None)
BIAS = 0.5
"""the fake judge's pull toward the answer shown first, in characters"""


class LengthJudge:
    """Stands in for quartet.judges.llm_local.LocalLLMJudge: log-odds len(first) - len(second) + BIAS, so a pair more
    than BIAS characters apart goes to the longer answer in both orders, and a closer one to the first-shown answer
    in both (position bias: a tie)."""

    rows: list[int] = []
    fail_after: int | None = None

    def __init__(self, model, rubric, mode="pairwise", batch_size=16, where="judge", dtype="auto"):
        self.name = f"llm:{model}|length"

    def compare(self, prompts, firsts, seconds):
        if LengthJudge.fail_after is not None and sum(LengthJudge.rows) + len(firsts) > LengthJudge.fail_after:
            raise RuntimeError("the judge died")
        LengthJudge.rows.append(len(firsts))
        return [len(a) - len(b) + BIAS for a, b in zip(firsts, seconds)]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fake(monkeypatch):
    LengthJudge.rows, LengthJudge.fail_after = [], None
    monkeypatch.setattr(quartet.judges.llm, "LocalLLMJudge", LengthJudge)
    return LengthJudge


def by_hand(result, name: str) -> tuple[list[float], int, int]:
    """Per (prompt, sample): 1 when `name`'s response is more than BIAS characters longer than the baseline's, 0 when
    shorter by as much, else 0.5; also the pairs a judge is asked about (not identical) and the order-decided ones."""
    wins, asked, biased = [], 0, 0
    for row in result.samples:
        a, b = row[name], row[result.baseline]
        d = len(a) - len(b)
        wins.append(1.0 if d > BIAS else 0.0 if d < -BIAS else 0.5)
        asked += a != b
        biased += a != b and abs(d) <= BIAS
    return wins, asked, biased


def test_judged_win_rate_by_hand_cached_and_shown(tmp_path, fake):
    s = dict(FAST, judge=JUDGE, llm_judge=LLMJudgeConfig(batch_size=2))
    result = evaluate([TINY, OTHER], out=tmp_path / "e", samples_per_prompt=2, **s)
    wins, asked, biased = by_hand(result, OTHER)
    assert 0 < biased < asked  # the fixture's responses give both kinds of pair
    m = result.checkpoints[OTHER]
    mean, lo, hi = bootstrap_ci([(x + y) / 2 for x, y in zip(wins[::2], wins[1::2])], n_boot=2000, seed=0)
    assert m["judge_win_rate"] == {"mean": pytest.approx(sum(wins) / len(wins)), "lo": lo, "hi": hi}
    assert mean == pytest.approx(sum(wins) / len(wins))
    assert m["judge_position_bias"] == biased / asked
    assert m["judge_ties"] == wins.count(0.5) / len(wins)
    base = result.checkpoints[TINY]
    assert base["judge_win_rate"] is base["judge_position_bias"] is base["judge_ties"] is None
    assert sum(fake.rows) == 2 * asked and result.timing["judge_calls"] == 2 * asked

    saved = json.loads((tmp_path / "e" / "eval.json").read_text())
    assert saved["checkpoints"][OTHER]["judge_win_rate"] == m["judge_win_rate"]
    assert saved["settings"]["judge"] == "gold" and saved["settings"]["judge_spec"] == JUDGE
    records = [json.loads(line) for line in (tmp_path / "e" / "samples.jsonl").read_text().splitlines()]
    assert [r["judge_win"] for r in records if r["checkpoint"] == OTHER] == wins
    table = format_table(result)
    assert "| judge win rate | position bias | judge ties |" in table and f"judge win rate by {JUDGE}" in table

    fake.rows = []
    again = evaluate([TINY, OTHER], out=tmp_path / "e", overwrite=True, samples_per_prompt=2, **s)
    assert fake.rows == [] and again.timing["judge_cache_hits"] == 2 * asked  # every verdict read back
    assert again.checkpoints == result.checkpoints
    assert (tmp_path / "e" / "verdicts.sqlite").is_file()


def test_an_eval_killed_while_judging_resumes_from_its_cache(tmp_path, fake):
    s = dict(FAST, judge=JUDGE, llm_judge=LLMJudgeConfig(batch_size=2))  # 8 verdicts per commit
    _, asked, _ = by_hand(evaluate([TINY, OTHER], out=tmp_path / "clean", **s), OTHER)
    fake.rows, fake.fail_after = [], asked  # every (a, b) verdict committed, then it dies in the (b, a) order
    with pytest.raises(RuntimeError, match="the judge died"):
        evaluate([TINY, OTHER], out=tmp_path / "e", **s)
    assert not (tmp_path / "e" / "eval.json").exists()
    fake.fail_after = None
    result = evaluate([TINY, OTHER], out=tmp_path / "e", **s)  # no --overwrite: the folder is this eval's own
    assert (result.timing["judge_cache_hits"], result.timing["judge_calls"]) == (asked, asked)
    assert (tmp_path / "e" / "eval.json").is_file() and (tmp_path / "e" / "verdicts.sqlite").is_file()


def test_the_pipeline_section_passes_through_and_a_bad_judge_fails_first(tmp_path, fake, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "BIAS", 4.5)  # a pull past these responses' length gaps
    section = EvalConfig(**FAST, judge=JUDGE, llm_judge=LLMJudgeConfig(cache=None, orders="average"),
                         samples_per_prompt=2)
    result = evaluate([TINY, OTHER], **dataclasses.asdict(section))  # as `quartet run` calls it
    # orders: average: the mean log-odds of the two orders is len(a) - len(b) (BIAS cancels): the longer wins
    wins = [1.0 if d > 0 else 0.0 if d < 0 else 0.5
            for d in (len(row[OTHER]) - len(row[result.baseline]) for row in result.samples)]
    assert wins != by_hand(result, OTHER)[0]  # agree would tie a pair these responses hold (lengths 10 and 9)
    assert result.checkpoints[OTHER]["judge_win_rate"]["mean"] == pytest.approx(sum(wins) / len(wins))
    assert "each pair judged in both orders, their mean log-odds deciding" in format_table(result)
    assert not list(tmp_path.iterdir())  # no out, no cache

    with pytest.raises(QuartetError, match="^eval.judge: "):
        check_inputs(stage_inputs("eval", EvalConfig(judge="llm:no/such/model")))
    with pytest.raises(QuartetError, match="^eval.llm_judge.base_url: cannot reach http://127.0.0.1:9/v1/models"):
        evaluate([TINY], out=tmp_path / "e", judge="llm:m", llm_judge={"base_url": "http://127.0.0.1:9/v1"}, **FAST)
    assert not (tmp_path / "e").exists()
