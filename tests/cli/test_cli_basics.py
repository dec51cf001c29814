"""The `quartet` entry point as a user runs it: in a subprocess."""

import subprocess
import sys

from quartet.cli import STAGES


def run(*args):
    return subprocess.run([sys.executable, "-m", "quartet.cli", *args], capture_output=True, text=True, timeout=120)


def test_help_lists_every_stage():
    out = run("--help")
    assert out.returncode == 0
    for name in ("sft", "label", "rm", "ppo", "run", "eval", "report", "doctor"):
        assert name in out.stdout
    assert set(STAGES) >= {"sft", "label", "rm", "ppo", "run", "eval", "report", "doctor"}


def test_bad_config_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("iteratoins: 3\n")
    out = run("ppo", "-c", str(bad))
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == "error: iteratoins: unknown key (did you mean 'iterations'?)"
    assert "Traceback" not in out.stderr
