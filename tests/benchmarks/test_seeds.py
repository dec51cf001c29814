"""benchmarks/seeds.py: what it reads back from a run folder, its Bradley-Terry check by hand, and the table's counts."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from quartet.algo.stats import wilson_interval

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "seeds.py"


@pytest.fixture(scope="module")
def seeds():
    spec = importlib.util.spec_from_file_location("seeds_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ci(mean, lo, hi):
    return {"mean": mean, "lo": lo, "hi": hi}


def write_run(out: Path, gain_lo: float, rm_bins: list[tuple[int, float, float]] | None, findings=(),
              relevance_policy: float = 0.40) -> Path:
    """A run folder as `quartet run` leaves it: eval.json, findings, the RM's calibration, summary.md's times."""
    (out / "eval").mkdir(parents=True)
    base = {"gold": _ci(0.2, 0.1, 0.3), "relevance": _ci(0.41, 0.35, 0.48), "kl": _ci(0, 0, 0),
            "length": _ci(24.0, 21, 27), "win_rate": 0.5, "score_diff": _ci(0, 0, 0)}
    pol = {"gold": _ci(0.45, 0.37, 0.55), "relevance": _ci(relevance_policy, 0.3, 0.45), "kl": _ci(3.2, 2.5, 4),
           "length": _ci(25.0, 22, 27), "win_rate": 0.69, "score_diff": _ci(0.27, gain_lo, 0.39)}
    (out / "eval" / "eval.json").write_text(json.dumps(
        {"checkpoints": {"sft/model": base, "ppo/model": pol}, "baseline": "sft/model"}))
    (out / "ppo").mkdir()
    (out / "ppo" / "findings.jsonl").write_text("".join(json.dumps({"rule": r, "step": 3}) + "\n" for r in findings))
    if rm_bins is not None:
        (out / "rm").mkdir()
        bins = [{"margin": f"bin{i}", "count": n, "accuracy": acc, "predicted": pred}
                for i, (n, acc, pred) in enumerate(rm_bins)]
        (out / "rm" / "calibration.json").write_text(json.dumps({"eval": {"accuracy": 0.78, "calibration": bins}}))
    (out / "summary.md").write_text("# summary\n\n## Time per stage\n\n- sft: 36 s\n- ppo: 166 s\n- total: 373 s\n")
    return out


def test_a_bin_follows_bradley_terry_when_its_prediction_is_inside_the_wilson_interval(seeds, tmp_path):
    # 10 pairs, 6 right: Wilson 95% interval [0.313, 0.832]; 0.80 is inside it, 0.95 is not; an empty bin is skipped
    lo, hi = wilson_interval(6, 10)
    assert (round(lo, 3), round(hi, 3)) == (0.313, 0.832)
    run = write_run(tmp_path / "s0", 0.1, [(10, 0.6, 0.80), (10, 0.6, 0.95), (0, None, None)])
    cal = seeds.calibration(run)
    assert [b["follows_bt"] for b in cal["bins"]] == [True, False, False]
    assert (cal["bins_following_bt"], cal["bins_with_pairs"], cal["accuracy"]) == (1, 2, 0.78)


def test_the_rm_stages_prompt_interval_is_used_and_wilsons_count_printed_beside_it(seeds, tmp_path):
    # 100 pairs, 60 right: Wilson [0.502, 0.691] leaves out a prediction of 0.72; the rm stage's interval with
    # prompts as the draws, [0.45, 0.75] (a prompt's pairs share answers), holds it: the bin follows BT by the file's
    run = write_run(tmp_path / "s0", 0.1, [(100, 0.6, 0.72)])
    path = run / "rm" / "calibration.json"
    held = json.loads(path.read_text())
    held["eval"]["calibration"][0] |= {"lo": 0.45, "hi": 0.75}
    path.write_text(json.dumps(held))
    cal = seeds.calibration(run)
    (b,) = cal["bins"]
    assert (b["lo"], b["hi"], b["follows_bt"], b["follows_bt_wilson"]) == (0.45, 0.75, True, False)
    assert [round(x, 3) for x in b["wilson"]] == [0.502, 0.691]
    assert (cal["bins_following_bt"], cal["bins_following_bt_wilson"]) == (1, 0)
    text = seeds.table([seeds.read_seed(0, run, 0.0)])
    assert "every bin follows Bradley-Terry: 1/1 raw" in text
    assert "by Wilson's interval, which counts the pairs as independent: 0/1 raw" in text


def test_the_bins_over_the_temperature_are_read_and_counted_beside_the_raw_ones(seeds, tmp_path):
    run = write_run(tmp_path / "s0", 0.1, [(10, 0.6, 0.95)])
    path = run / "rm" / "calibration.json"
    held = json.loads(path.read_text())
    held["eval"] |= {"temperature": 2.5, "fold_temperatures": [2.4, 2.6],
                     "calibration_scaled": [{"margin": "bin0", "count": 10, "accuracy": 0.6, "predicted": 0.7}]}
    path.write_text(json.dumps(held))
    cal = seeds.calibration(run)
    assert (cal["bins_following_bt"], cal["scaled"]["bins_following_bt"], cal["temperature"]) == (0, 1, 2.5)
    text = seeds.table([seeds.read_seed(0, run, 0.0)])
    assert "| 0/1, /T 1/1 (T 2.50) |" in text
    assert "every bin follows Bradley-Terry: 0/1 raw, 1/1 over the temperature" in text


def test_the_reward_model_against_gold_on_the_baselines_answers_by_hand(seeds, tmp_path):
    run = write_run(tmp_path / "s0", 0.1, None)

    def row(prompt, gold, rm, relevance, checkpoint="sft/model"):
        return json.dumps({"checkpoint": checkpoint, "prompt_index": prompt, "gold": gold, "rm": rm,
                           "relevance": relevance}) + "\n"

    (run / "eval" / "samples.jsonl").write_text("".join([
        # prompt 0: gold 0.9 > 0.5 > 0.0; the RM orders (a, b) right, (a, c) right, (b, c) wrong; c is off-topic
        row(0, 0.9, 2.0, 0.5), row(0, 0.5, 1.0, 0.3), row(0, 0.0, 1.5, 0.1),
        # prompt 1: gold gap 0.05 is a tie (left out)
        row(1, 0.30, 0.0, 0.5), row(1, 0.35, 1.0, 0.5),
        row(0, -1.0, 9.0, 0.9, checkpoint="ppo/model"),  # the policy's answers do not count
    ]))
    vs = seeds.rm_against_gold(run, "sft/model")
    assert (vs["pairs"], vs["agree"]) == (3, pytest.approx(2 / 3))
    assert (vs["on_topic_pairs"], vs["on_topic_agree"]) == (1, 1.0)  # only (a, b) has both answers >= 0.2
    rm, gold = [2.0, 1.0, 1.5, 0.0, 1.0], [0.9, 0.5, 0.0, 0.30, 0.35]
    assert vs["corr"] == pytest.approx(float(np.corrcoef(rm, gold)[0, 1]))
    assert "| 1.00 (1), " in seeds.table([seeds.read_seed(0, run, 0.0)])


def test_a_seed_reads_gain_findings_relevance_and_seconds(seeds, tmp_path):
    row = seeds.read_seed(0, write_run(tmp_path / "s0", -0.01, None, ["kl_blowup"], relevance_policy=0.30), 12.0)
    assert row["gain"] == _ci(0.27, -0.01, 0.39) and not row["gain_ci_excludes_0"]
    assert row["findings"] == ["kl_blowup"] and row["rm"] is None
    assert row["relevance"]["falls_beyond_ci"]  # 0.30 below the baseline's lower bound 0.35
    assert row["stage_seconds"] == {"sft": 36.0, "ppo": 166.0, "total": 373.0}


def test_the_table_counts_what_the_recipe_is_judged_by(seeds, tmp_path):
    rows = [seeds.read_seed(0, write_run(tmp_path / "a", 0.15, [(10, 0.6, 0.8)]), 0.0),
            seeds.read_seed(1, write_run(tmp_path / "b", -0.02, [(10, 0.6, 0.95)], ["kl_blowup"]), 0.0)]
    text = seeds.table(rows)
    assert "gain's CI excludes 0: 1/2; no findings: 1/2" in text
    assert "RM held-out accuracy >= 0.75: 2/2; every bin follows Bradley-Terry: 1/2 raw" in text
    assert "over the temperature" not in text  # runs from before the temperature: raw bins only
    assert "relevance not below the baseline's CI: 2/2" in text
    assert text.count("\n| ") == 2  # one row per seed under the header
    assert "too short" not in text


def test_the_table_says_what_the_ppo_runs_were_too_short_to_judge(seeds, tmp_path):
    run = write_run(tmp_path / "a", 0.15, None)
    (run / "ppo" / "metrics.jsonl").write_text("".join(
        json.dumps({"stage": "ppo", "step": s, "objective/kl": 1.0, "value/loss": 0.5}) + "\n" for s in range(1, 8)))
    row = seeds.read_seed(0, run, 0.0)
    assert row["too_short"] == ["reward_flat_kl_zero (objective/kl: 7 of the 10 points it needs)",
                                "kl_blowup's KL-growth test (objective/kl: 7 of the 10 points it needs)",
                                "value_loss_stuck (value/loss: 7 of the 15 points it needs)"]
    assert "- too short for the doctor to judge: kl_blowup's KL-growth test" in seeds.table([row])


def test_the_family_wise_count_widens_each_bin_by_bonferroni_over_its_effective_pairs(seeds, tmp_path):
    # two bins, so each at 1 - 0.05 / 2 (z = 2.2414). Bin 0: 0.6 over 50 effective pairs -> Wilson
    # centre (0.6 + z^2/100) / (1 + z^2/50) = 0.5909, half 2.2414 / 1.1005 * sqrt(0.24/50 + z^2/10000) = 0.1483:
    # [0.443, 0.739] holds BT's 0.735, which the file's 95% interval [0.47, 0.73] does not. Bin 1: 0.9 over 40 ->
    # [0.746, 0.965]: 0.99 is outside both
    run = write_run(tmp_path / "s0", 0.1, [(80, 0.6, 0.735), (60, 0.9, 0.99)])
    path = run / "rm" / "calibration.json"
    held = json.loads(path.read_text())
    held["eval"]["calibration"][0] |= {"lo": 0.47, "hi": 0.73, "effective_pairs": 50.0}
    held["eval"]["calibration"][1] |= {"lo": 0.80, "hi": 0.96, "effective_pairs": 40.0}
    path.write_text(json.dumps(held))
    cal = seeds.calibration(run)
    assert [[round(x, 3) for x in b["familywise"]] for b in cal["bins"]] == [[0.443, 0.739], [0.746, 0.965]]
    assert [b["follows_bt"] for b in cal["bins"]] == [False, False]
    assert [b["follows_bt_familywise"] for b in cal["bins"]] == [True, False]
    assert (cal["bins_following_bt"], cal["bins_following_bt_familywise"]) == (0, 1)
    text = seeds.table([seeds.read_seed(0, run, 0.0)])
    assert "every bin follows Bradley-Terry: 0/1 raw; family-wise (each of k bins at 1 - 0.05/k, prompts as the " \
           "draws): 0/1 raw" in text
    # a file without effective pair counts (before the rm stage wrote them) has no family-wise count
    run = write_run(tmp_path / "s1", 0.1, [(10, 0.6, 0.80)])
    assert seeds.calibration(run)["bins_following_bt_familywise"] is None
    assert "family-wise" not in seeds.table([seeds.read_seed(0, run, 0.0)])
