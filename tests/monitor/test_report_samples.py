"""The report reads like a review: SFT vs PPO per prompt, worst first, two decimals, no seeds in view; the
over-optimisation plot (gold and proxy vs sqrt(KL)) and the relevance chart."""

from __future__ import annotations

import json
import math
import re

from ppo_streams import healthy_run, write_run

from quartet.monitor import report
from quartet.monitor.report import overoptimization_points, write_report


def _eval_json(path, n=12):
    """eval.json as `quartet eval` writes it: per sample the prompt, its index, sample number and seed, then
    each checkpoint's response and scores under `<name>`, `<name>/gold`, `<name>/relevance`, `<name>/kl`."""
    samples = []
    for i in range(n):
        sft_gold, ppo_gold = 0.1 + 0.01 * i, 0.1 + 0.01 * i + (0.5 - 0.1 * i)  # change 0.5 - 0.1 i: i = 11 worst
        samples.append({
            "prompt": f"Continue this review of film {i}", "prompt_index": i, "sample": 0, "seed": 9876543210 + i,
            "sft": f"sft answer {i}", "sft/gold": sft_gold, "sft/relevance": 0.512345, "sft/kl": 0.0,
            "ppo": f"ppo answer {i}", "ppo/gold": ppo_gold, "ppo/relevance": 0.234567, "ppo/kl": 3.14159,
        })
    data = {
        "checkpoints": {"sft": {"gold": {"mean": 0.2, "lo": 0.1, "hi": 0.3}}, "ppo": {"gold": {"mean": 0.3, "lo": 0.2, "hi": 0.4}}},
        "baseline": "sft", "settings": {"judge": "gold"}, "samples": samples,
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "eval.json").write_text(json.dumps(data))
    return data


def _main_view(html: str) -> str:
    return re.sub(r"<details>.*?</details>", "", html, flags=re.S)


def test_eval_samples_side_by_side_worst_regression_first(tmp_path):
    html = report._eval_samples_html(_eval_json(tmp_path / "eval"))
    main = _main_view(html)
    # one row per prompt, SFT beside PPO, with the change in gold
    assert "<th>prompt</th><th>sft <small>(baseline)</small></th><th>ppo</th><th>change in gold</th>" in main
    rows = re.findall(r"<tr><td>Continue this review of film (\d+)</td>", main)
    assert rows == ["11", "10", "9", "8", "7", "6", "5", "4"]  # change -0.6, -0.5, ...: worst first, 8 shown
    first = main[main.index("film 11"):main.index("film 10")]
    assert first.index("sft answer 11") < first.index("ppo answer 11")
    assert "gold 0.21 &middot; relevance 0.51" in first and "gold -0.39 &middot; relevance 0.23" in first
    assert '<td class="num worse">-0.60</td>' in first
    assert "8 of 12 prompts, largest drop in gold first" in main
    # two decimals only, and nothing of the replay bookkeeping in the main view
    assert not re.search(r"\d\.\d{3}", main)
    for word in ("seed", "prompt_index", "987654321", "3.14"):
        assert word not in main, word
    # ... which is one click away
    replay = html[html.index("<details>"):]
    assert "replay these samples" in replay and "9876543221" in replay and "<th>prompt_index</th>" in replay


def test_eval_samples_in_the_page(tmp_path):
    write_run(tmp_path / "ppo", healthy_run(12))
    _eval_json(tmp_path / "eval")
    page = write_report(tmp_path).read_text()
    samples = page[page.index("eval/eval.json: samples"):]
    assert samples.index("film 11<") < samples.index("film 4<") and "film 3<" not in samples


def test_checkpoint_dirs_are_named_by_their_stage():
    data = {"checkpoints": {"runs/demo/sft/model": {}, "runs/demo/ppo/model": {}}, "baseline": "runs/demo/sft/model",
            "samples": [{"prompt": "p", "runs/demo/sft/model": "a", "runs/demo/ppo/model": "b"}]}
    assert "<th>sft <small>(baseline)</small></th><th>ppo</th>" in report._eval_samples_html(data)
    assert report._short_name("smollm2-135m-instruct") == "smollm2-135m-instruct"


def test_eval_samples_without_a_judge_keep_prompt_order():
    data = {"checkpoints": {"a": {}, "b": {}}, "baseline": "a",
            "samples": [{"prompt": f"p{i}", "a": f"a{i}", "b": f"b{i}"} for i in range(3)]}
    main = report._eval_samples_html(data)
    assert re.findall(r"<tr><td>(p\d)</td>", main) == ["p0", "p1", "p2"] and "<td class=num>-</td>" in main
    assert "<details>" not in main
    single = report._eval_samples_html({"checkpoints": {"a": {}}, "samples": data["samples"]})
    assert "a0" in single and "b0" not in single


def test_overoptimization_points_and_plot(tmp_path):
    records = [
        {"step": 1, "objective/kl": 0.0, "objective/score": 0.1, "objective/gold": 0.1},
        {"step": 3, "objective/kl": 4.0, "objective/score": 0.9, "objective/gold": 0.2},
        {"step": 2, "objective/kl": 1.0, "objective/score": 0.5, "objective/gold": 0.4},
        {"step": 4, "objective/kl": -0.01, "objective/score": 0.2, "objective/gold": float("nan")},
        {"step": 5, "objective/kl": 9.0, "objective/score": 1.2, "objective/gold": 0.0},
    ]
    xs, proxy, gold, key = overoptimization_points(records)
    assert key == "objective/score"
    assert xs == [0.0, 1.0, 2.0, 3.0] and proxy == [0.1, 0.5, 0.9, 1.2] and gold == [0.1, 0.4, 0.2, 0.0]
    assert overoptimization_points([{k: v for k, v in r.items() if k != "objective/gold"} for r in records]) is None
    assert overoptimization_points([{k: v for k, v in r.items() if k != "objective/kl"} for r in records]) is None

    # a Gao-shaped run: KL grows, the proxy keeps rising, gold peaks at sqrt(KL) = 2 and falls
    run = []
    for i in range(40):
        d = 4 * i / 39
        run.append({"stage": "ppo", "step": i + 1, "objective/kl": d * d, "objective/score": d,
                    "objective/gold": d * (4 - d) / 4})
    write_run(tmp_path / "gao", run)
    page = write_report(tmp_path / "gao").read_text()
    png = tmp_path / "gao" / "plots" / "ppo-overoptimization.png"
    assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size > 5000
    assert 'alt="Gold and proxy vs sqrt(KL)"' in page and 'title="plots/ppo-overoptimization.png"' in page
    xs, _, gold, _ = overoptimization_points(run)
    assert math.isclose(xs[gold.index(max(gold))], 2.0, abs_tol=0.06)

    no_gold = [{k: v for k, v in r.items() if k != "objective/gold"} for r in run]
    write_run(tmp_path / "plain", no_gold)
    write_report(tmp_path / "plain")
    assert not (tmp_path / "plain" / "plots" / "ppo-overoptimization.png").exists()


def test_relevance_chart_and_summary(tmp_path):
    write_run(tmp_path / "ppo", healthy_run(10))
    page = write_report(tmp_path / "ppo").read_text()
    assert (tmp_path / "ppo" / "plots" / "ppo-relevance.png").is_file()
    assert "<b>rollout/relevance</b>" in page
    write_run(tmp_path / "old", [{k: v for k, v in r.items() if k != "rollout/relevance"} for r in healthy_run(10)])
    write_report(tmp_path / "old")
    assert not (tmp_path / "old" / "plots" / "ppo-relevance.png").exists()
