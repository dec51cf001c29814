"""An evaluation's bad cases: hand-made eval records -> the rows worked out by hand, and the file is a prompts file
that `quartet label` reads."""

import json

import pytest
import torch

from quartet.cli import main
from quartet.config import DataConfig
from quartet.data import load_prompts
from quartet.eval.bad_cases import percentile_ranks, pick_bad_cases
from quartet.eval.evaluate import evaluate, write_result

TINY = "tiny:llama?hidden=32&layers=2&heads=4&vocab=300"

# prompt: the policy's gold and rm scores, the baseline's gold score (one sample each)
SCORES = {0: (0.9, 0.8, 0.5), 1: (0.1, 0.2, 0.6), 2: (0.5, 0.95, 0.4), 3: (0.3, 0.1, 0.9), 4: (0.7, 0.5, 0.7)}


def records(with_gold=True):
    out = []
    for i, (gold, rm, base) in SCORES.items():
        for name, scores in (("sft", {"gold": base, "rm": 0.0}), ("ppo", {"gold": gold, "rm": rm})):
            if not with_gold:
                scores = {"rm": scores["gold"]}
            out.append({"checkpoint": name, "prompt_index": i, "sample": 0, "prompt": f"p{i}",
                        "response": f"{name} {i}", **scores})
    return out


def test_percentile_ranks_share_ties():
    assert percentile_ranks([3.0, 1.0, 3.0, 2.0]) == [2.5 / 3, 0.0, 2.5 / 3, 1 / 3]
    assert percentile_ranks([7.0]) == [0.5]


def test_the_reasons_take_turns_worst_first_each_prompt_once():
    """By hand. Gold ranks (lowest 0): p1 0, p3 .25, p2 .5, p4 .75, p0 1; rm ranks: p3 0, p1 .25, p4 .5, p0 .75,
    p2 1; rm - gold: p0 -.25, p1 .25, p2 .5, p3 -.25, p4 -.25. Lowest gold: p1 p3 p2 p4 p0. Regressions (gold minus
    the baseline's): p3 -.6, p1 -.5 (p4's 0 is none). In turn: p1 (low), p2 (the largest gap), p3 (regression),
    then low again: p1 p3 p2 taken, so p4; then the gaps' next untaken, p0 (its tie with p4 broken by order)."""
    rows = pick_bad_cases(records(), "ppo", "sft", 10)
    assert [(r["prompt"], r["reason"]) for r in rows] == [
        ("p1", "low_score"), ("p2", "rm_disagrees"), ("p3", "regression"), ("p4", "low_score"), ("p0", "rm_disagrees")]
    assert rows[1]["rank_gap"] == pytest.approx(0.5) and rows[2]["diff"] == pytest.approx(-0.6)
    assert rows[0] == {"prompt": "p1", "reason": "low_score", "prompt_index": 1, "checkpoint": "ppo",
                       "responses": ["ppo 1"], "gold": 0.1, "rm": 0.2, "score": 0.1}
    assert [r["prompt"] for r in pick_bad_cases(records(), "ppo", "sft", 4)] == ["p1", "p2", "p3", "p4"]
    assert pick_bad_cases(records(), "ppo", "sft", 0) == []


def test_without_gold_the_reward_model_judges_and_nothing_disagrees():
    rows = pick_bad_cases(records(with_gold=False), "ppo", "sft", 3)
    assert [(r["prompt"], r["reason"]) for r in rows] == [("p1", "low_score"), ("p3", "regression"),
                                                          ("p2", "low_score")]
    assert "gold" not in rows[0] and rows[0]["rm"] == 0.1


def test_the_baseline_alone_has_no_regressions_and_samples_are_averaged():
    recs = [{"checkpoint": "a", "prompt_index": i, "sample": j, "prompt": [{"role": "user", "content": f"q{i}"}],
             "response": f"r{i}{j}", "gold": g} for i, gs in enumerate([(1.0, 0.0), (0.2, 0.2)]) for j, g in enumerate(gs)]
    rows = pick_bad_cases(recs, "a", "a", 5)
    assert [(r["prompt_index"], r["score"], r["responses"]) for r in rows] == [(1, 0.2, ["r10", "r11"]),
                                                                            (0, 0.5, ["r00", "r01"])]


def test_label_samples_the_bad_cases_of_an_eval(tmp_path, capsys):
    """`quartet eval` writes its bad cases; `quartet label judge=none prompts.path=<them>` answers them (chats too)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = evaluate([TINY, TINY + "&seed=1"], prompts="task:tiny-target/eval", num_prompts=6, max_new_tokens=4,
                          bad_cases=3, out=tmp_path / "eval")
        result.settings["bad_cases"] = 0  # off: no file
        write_result(result, tmp_path / "off")
        assert sorted(p.name for p in (tmp_path / "off").iterdir()) == [".quartet-run", "eval.json", "samples.jsonl"]
        cases = tmp_path / "eval" / "bad_cases.jsonl"
        rows = [json.loads(line) for line in cases.read_text().splitlines()]
        assert len(rows) == 3 and {r["checkpoint"] for r in rows} == {TINY + "&seed=1"}
        assert [p.prompt for p in load_prompts(DataConfig(path=str(cases)))] == [r["prompt"] for r in rows]
        chats = tmp_path / "chats.jsonl"
        chats.write_text(json.dumps(dict(rows[0], prompt=[{"role": "user", "content": "hi"}])) + "\n")
        assert load_prompts(DataConfig(path=str(chats)))[0].prompt == [{"role": "user", "content": "hi"}]
        assert main(["label", f"policy={TINY}", f"prompts.path={cases}", "judge=none", "num_samples=2",
                     "generation.max_new_tokens=4", f"output={tmp_path / 'next' / 'p.jsonl'}"]) == 0
        answers = [json.loads(line) for line in (tmp_path / "next" / "p.samples.jsonl").read_text().splitlines()]
        assert [a["prompt"] for a in answers] == [r["prompt"] for r in rows for _ in range(2)]
    finally:
        torch.set_num_threads(before)
    assert "quartet annotate" in capsys.readouterr().out
