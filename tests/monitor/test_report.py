"""quartet report: one self-contained page, plots on disk and embedded, all text escaped, atomic."""

import base64
import json
import re
import subprocess
import sys

import pytest
from ppo_streams import write_run
from report_fixtures import HOSTILE, make_pipeline, make_ppo_run

from quartet.errors import DataError
from quartet.monitor import report
from quartet.monitor.report import write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def embedded_pngs(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


@pytest.fixture(scope="module")
def ppo_report(tmp_path_factory):
    run = make_ppo_run(tmp_path_factory.mktemp("single") / "ppo")
    return run, write_report(run)


@pytest.fixture(scope="module")
def pipeline_report(tmp_path_factory):
    root = make_pipeline(tmp_path_factory.mktemp("pipeline"))
    return root, write_report(root)


def test_single_ppo_run(ppo_report):
    run, path = ppo_report
    assert path == run / "report.html"
    page = path.read_text()
    # findings come first, before any curve
    assert page.index("truncation") < page.index("Training curves")
    files = sorted((run / "plots").glob("*.png"))
    names = {p.name for p in files}
    assert {"ppo-score.png", "ppo-kl.png", "ppo-length.png", "ppo-entropy.png", "ppo-value.png",
            "ppo-clipfrac.png", "ppo-gold.png"} <= names
    pngs = embedded_pngs(page)
    assert len(pngs) == len(files)
    assert sorted(pngs) == sorted(p.read_bytes() for p in files)
    assert all(p.startswith(PNG_MAGIC) and len(p) > 5000 for p in pngs)
    # samples side by side, early vs late, from samples.jsonl (its cut last line ignored)
    assert "<th>early</th><th>late</th>" in page and "answer 2 at step 20" in page and "answer 2 at step 1<" in page
    assert "config.yaml" in page and "kl_coef: 0.05" in page


def test_gold_chart_only_with_gold(tmp_path):
    run = make_ppo_run(tmp_path / "ppo", rule=None, gold=False)
    write_report(run)
    names = {p.name for p in (run / "plots").glob("*.png")}
    assert "ppo-score.png" in names and "ppo-gold.png" not in names
    page = (run / "report.html").read_text()
    assert "Doctor: no findings. The logged metrics show none of the known failure modes." in page
    assert "Too short to judge" not in page  # 20 points: every rule could fire

    short = make_ppo_run(tmp_path / "short", n=7, rule=None)
    write_report(short)
    page = (short / "report.html").read_text()
    assert "Doctor: no findings. The logged metrics show none of the known failure modes it could judge." in page
    assert "Too short to judge" in page and "value_loss_stuck (value/loss: 7 of the 15 points it needs)" in page


def test_all_text_is_escaped(pipeline_report):
    page = pipeline_report[1].read_text()
    assert HOSTILE not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &quot;quotes&quot;" in page
    # the page's only script is its own image check
    assert page.count("<script>") == 1


def test_pipeline_dir_has_every_stage_and_the_eval_table(pipeline_report):
    root, path = pipeline_report
    page = path.read_text()
    names = {p.name for p in (root / "plots").glob("*.png")}
    assert {"sft-sft_loss.png", "rm-rm_loss.png", "rm-rm_accuracy.png", "ppo-score.png", "ppo-gold.png"} <= names
    assert "overoptimization" in page
    assert "sft <small>(baseline)</small>" in page
    assert "0.52 <small>[0.44, 0.6]</small>" in page and "0.71" in page
    assert "a better answer" in page and "gold 0.90" in page
    assert page.index("Doctor") < page.index("Evaluation") < page.index("Training curves") < page.index("Samples")


@pytest.mark.parametrize("content", [
    "{not json",
    json.dumps([1, 2]),
    json.dumps({"baseline": "x"}),
    json.dumps({"checkpoints": {"a": 3, "b": {"m": None}}, "samples": "nope"}),
    json.dumps({"checkpoints": {"a": {"m": {"mean": 1.0}}}, "samples": [{"a": "only a"}, 5]}),
])
def test_eval_json_is_read_tolerantly(tmp_path, content):
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "eval.json").write_text(content)
    page = write_report(tmp_path).read_text()
    assert "eval" in page and "Training curves" not in page


def test_nothing_to_report_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="run directory not found"):
        write_report(tmp_path / "missing")
    with pytest.raises(DataError, match="nothing to report"):
        write_report(tmp_path)


def test_failed_report_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    run = write_run(tmp_path / "ppo", [{"stage": "ppo", "step": i, "objective/score": i} for i in range(4)])
    write_report(run)
    old_page = (run / "report.html").read_text()
    old_plots = sorted(p.name for p in (run / "plots").iterdir())
    write_run(run, [{"stage": "ppo", "step": 1, "objective/score": 1.0}])

    def broken(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(report, "_plot", broken)
    with pytest.raises(RuntimeError):
        write_report(run)
    assert (run / "report.html").read_text() == old_page
    assert sorted(p.name for p in (run / "plots").iterdir()) == old_plots
    assert not [p for p in run.iterdir() if p.name.startswith(".")]


def test_nan_values_do_not_break_plots(tmp_path):
    records = [{"stage": "ppo", "step": i, "objective/score": v, "policy/loss": v}
               for i, v in enumerate([0.1, float("nan"), 0.3, float("inf")], start=1)]
    write_run(tmp_path, records)
    page = write_report(tmp_path).read_text()
    assert "nan at step 2" in page.replace("</span> at step", " at step").replace("ERROR: ", "")
    assert (tmp_path / "plots" / "ppo-score.png").read_bytes().startswith(PNG_MAGIC)


def test_cli_report_prints_the_path(tmp_path):
    run = write_run(tmp_path / "ppo", [{"stage": "ppo", "step": i, "objective/kl": i / 10} for i in range(4)])
    out = subprocess.run([sys.executable, "-m", "quartet.cli", "report", str(run)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(run / "report.html")


def test_training_samples_pair_each_prompt_with_its_latest_answer():
    rows = [
        {"step": 1, "prompt": "p1", "response": "old 1", "score": 0.1},
        {"step": 1, "prompt": "p2", "response": "old 2"},
        {"step": 5, "prompt": "p1", "response": "new 1", "score": 0.9, "gold": 0.8},
        {"step": 9, "prompt": "p3", "response": "only once"},
    ]
    html = report._training_samples_html(rows, "ppo")
    assert html.count("<tr>") == 2  # header + p1; p2 and p3 were answered once
    assert html.index("old 1") < html.index("new 1") and "score 0.90 &middot; gold 0.80" in html
    once = report._training_samples_html([r for r in rows if r["prompt"] != "p1"], "ppo")
    assert "only once" in once and "old 2" not in once
    assert report._training_samples_html([{"step": 1}], "ppo") == ""
