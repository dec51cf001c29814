"""Accuracy for right/wrong gold tasks: pass@k against its closed form, groups (levels, kinds) with their CIs, and
the alignment tax (eval's extra_tasks) on tiny random models."""

import json
from math import comb

import pytest
import torch

from quartet.cli import main as cli_main
from quartet.config import EvalConfig
from quartet.errors import ConfigError, DataError
from quartet.eval.evaluate import _groups, _pass_at, evaluate, format_breakdown, format_table, format_tax
from quartet.eval.stats import pass_at_k, pass_ks
from quartet.pipeline import _tax_section, load_pipeline, run_pipeline
from quartet.preflight import check_inputs, stage_inputs
from quartet.tasks import get_task

TINY = "tiny:llama?hidden=32&layers=1&heads=4&vocab=260&seed=1"
OTHER = TINY.replace("seed=1", "seed=2")
FAST = dict(prompts="task:arithmetic/eval", num_prompts=4, max_new_tokens=4, relevance=None, bad_cases=0)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_pass_at_k_hand_worked():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)      # 1 - C(3,2)/C(5,2)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)             # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)            # pass@1 = c/n
    assert pass_at_k(3, 1, 3) == 1.0 and pass_at_k(8, 0, 4) == 0.0 and pass_at_k(4, 4, 2) == 1.0
    for n, c, k in [(10, 4, 3), (20, 1, 5), (16, 9, 8), (7, 2, 6)]:
        assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)
    for bad in [(4, 5, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)
    assert pass_ks(1) == [1] and pass_ks(4) == [1, 2, 4] and pass_ks(6) == [1, 2, 4, 6]


@pytest.mark.parametrize("p", [0.1, 0.37, 0.8])
def test_pass_at_k_is_unbiased(p):
    """Closed form: over c ~ Binomial(n, p) right samples, E[pass_at_k(n, c, k)] = 1 - (1 - p)^k exactly, where the
    plug-in 1 - (1 - c/n)^k is biased low."""
    n, k = 8, 3
    pmf = [comb(n, c) * p**c * (1 - p) ** (n - c) for c in range(n + 1)]
    expected = sum(w * pass_at_k(n, c, k) for c, w in enumerate(pmf))
    plug_in = sum(w * (1 - (1 - c / n) ** k) for c, w in enumerate(pmf))
    assert expected == pytest.approx(1 - (1 - p) ** k, abs=1e-12)
    assert plug_in < expected - 1e-3


def test_pass_at_from_gold_scores_per_prompt():
    gold = [1, 0, 0, 1, 0, 0, 0, 0]                              # two prompts x 4 samples: 2 right, then none
    got = _pass_at(gold, 4, seed=0)
    assert list(got) == ["pass@1", "pass@2", "pass@4"]
    assert got["pass@1"]["mean"] == pytest.approx(0.25)
    assert got["pass@2"]["mean"] == pytest.approx((1 - 1 / 6) / 2)  # (1 - C(2,2)/C(4,2) + 0) / 2
    assert got["pass@4"]["mean"] == pytest.approx(0.5)
    assert got["pass@4"]["lo"] == 0.0 and got["pass@4"]["hi"] == 1.0


def test_groups_average_per_prompt_first():
    groups = [{"level 10": 1.0}, {"level 10": 0.0}, {"level 2": 1.0, "a": 1.0}, {"level 2": 1.0, "a": 0.0},
              {"level 2": 0.0}, {"level 2": 0.0}]                  # three prompts x 2 samples
    got = _groups(groups, 2, seed=0)
    assert list(got) == ["a", "level 2", "level 10"]               # natural order
    assert got["level 2"]["mean"] == pytest.approx(0.5) and got["level 2"]["prompts"] == 2
    assert got["level 10"] == {"mean": 0.5, "lo": 0.5, "hi": 0.5, "prompts": 1}
    assert got["a"]["mean"] == 0.5                                  # only the sample that has the group


def test_accuracy_groups_and_alignment_tax_on_tiny_models(tmp_path):
    plain = evaluate([TINY, OTHER], samples_per_prompt=2, **FAST)
    result = evaluate([TINY, OTHER], samples_per_prompt=2, extra_tasks=["constraints", "tiny-target"],
                      out=tmp_path / "ev", **FAST)
    assert result.checkpoints == plain.checkpoints and result.breakdown == plain.breakdown  # the main eval untouched
    for name, m in result.checkpoints.items():
        assert m["pass@1"] == m["gold"] and set(m) >= {"pass@1", "pass@2"}
        assert list(result.breakdown[name]) == ["level 1", "level 2", "level 3", "level 4"]  # eval interleaves them
        assert all(g["prompts"] == 1 for g in result.breakdown[name].values())
    data = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert set(data["tasks"]) == {"constraints", "tiny-target"} and data["settings"]["extra_tasks"] == [
        "constraints", "tiny-target"]
    cons = data["tasks"]["constraints"]
    assert cons["prompts"] == "task:constraints/eval" and cons["num_prompts"] == 4
    assert set(cons["checkpoints"][OTHER]) >= {"gold", "pass@1", "pass@2", "score_diff", "kl"}
    assert cons["checkpoints"][TINY]["score_diff"]["mean"] == 0.0   # the baseline against itself
    assert "breakdown" in cons and "breakdown" not in data["tasks"]["tiny-target"]
    assert "pass@1" not in data["tasks"]["tiny-target"]["checkpoints"][TINY]  # a 0-1 share, not right/wrong
    rows = (tmp_path / "ev" / "tasks" / "constraints" / "samples.jsonl").read_text().splitlines()
    assert len(rows) == 2 * 4 * 2 and json.loads(rows[0])["prompt"] == get_task("constraints").prompts("eval")[0]

    table = format_table(result)
    assert "| gold | pass@2 |" in table and "gold = accuracy (pass@1), pass@k: Chen et al. 2021" in table
    assert format_breakdown(result.breakdown).splitlines()[2].startswith("| level 1 | 1 | ")
    tax = format_tax(result, names={TINY: "SFT", OTHER: "PPO"})
    assert tax.splitlines()[0] == "| task | prompts | SFT | PPO | PPO - SFT |"
    assert tax.splitlines()[2].startswith("| constraints | 4 | ")
    section = _tax_section(result, {TINY: "SFT", OTHER: "PPO"})
    assert section[0] == "## Alignment tax" and "constraints by group:" in section


def test_without_extra_tasks_eval_json_has_no_new_sections(tmp_path):
    evaluate([TINY], prompts="task:tiny-target/eval", num_prompts=2, max_new_tokens=4, relevance=None,
             out=tmp_path / "ev")
    data = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert "tasks" not in data and "breakdown" not in data and "pass@1" not in data["checkpoints"][TINY]
    assert not (tmp_path / "ev" / "tasks").exists()


def test_extra_tasks_refusals():
    with pytest.raises(ConfigError, match=r"eval.extra_tasks: must be a list of built-in task names, got 'arith'"):
        EvalConfig(extra_tasks="arith").validate("eval")
    with pytest.raises(ConfigError, match="eval.extra_tasks: names 'arithmetic' twice"):
        EvalConfig(extra_tasks=["arithmetic", "arithmetic"]).validate("eval")
    with pytest.raises(DataError, match="task:arithmatic: unknown task \\(did you mean 'arithmetic'\\?\\)"):
        evaluate([TINY], extra_tasks=["arithmatic"], **FAST)
    with pytest.raises(DataError, match=r"^eval.extra_tasks\[1\]: .*unknown task"):
        check_inputs(stage_inputs("eval", EvalConfig(prompts="task:arithmetic/eval", extra_tasks=["constraints",
                                                                                                   "nope"])))


def test_cli_flags(tmp_path, capsys):
    out = tmp_path / "ev"
    assert cli_main(["eval", TINY, "--prompts", "task:arithmetic/eval", "--num-prompts", "4", "--max-new-tokens", "4",
                     "--relevance", "none", "--samples-per-prompt", "2", "--extra-tasks", "constraints",
                     "--bad-cases", "0", "--batch-size", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "by group (task:arithmetic):" in printed and "alignment tax" in printed and "pass@2" in printed
    data = json.loads((out / "eval.json").read_text())
    assert data["settings"]["samples_per_prompt"] == 2 and list(data["tasks"]) == ["constraints"]
    assert data["settings"]["batch_size"] == 4


def test_a_grpo_pipeline_on_arithmetic_reports_accuracy_and_the_alignment_tax(tmp_path, monkeypatch):
    """configs/arithmetic.yaml's shape (stages [ppo, eval], reward_funcs with the format reward) on a tiny model,
    with eval.extra_tasks: summary.md holds the level breakdown and the alignment tax on constraints."""
    monkeypatch.setattr("quartet.pipeline.write_report", lambda out: out / "report.html")  # its plots cost ~15 s
    (tmp_path / "pipe.yaml").write_text(json.dumps({
        "output_dir": str(tmp_path / "run"), "task": "arithmetic", "stages": ["ppo", "eval"],
        "tracking": {"report_to": "none"}, "sft": {"model": TINY},
        "ppo": {"advantage": "grpo", "reward_funcs": ["task:arithmetic", "task:arithmetic/format"],
                "reward_weights": [1.0, 0.2], "samples_per_prompt": 2, "iterations": 1, "rollout_batch_size": 2,
                "minibatch_size": 4, "micro_batch_size": 4, "generation": {"max_new_tokens": 4, "batch_size": 4},
                "precision": "fp32"},
        "eval": {"num_prompts": 4, "max_new_tokens": 4, "batch_size": 4, "relevance": None, "bad_cases": 0,
                 "extra_tasks": ["constraints"]},
    }))
    cfg = load_pipeline(str(tmp_path / "pipe.yaml"))
    assert cfg.ppo.gold == "task:arithmetic" and cfg.eval.prompts == "task:arithmetic/eval"
    run_pipeline(cfg)
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert "By group (task:arithmetic):" in summary and "| level 4 | 1 |" in summary
    assert "## Alignment tax" in summary and "| task | prompts | SFT | GRPO | GRPO - SFT |" in summary
    assert "| constraints | 4 |" in summary and "constraints by group:" in summary
    metrics = [json.loads(line) for line in (tmp_path / "run" / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert any("rollout/reward_arithmetic_format" in m for m in metrics)
