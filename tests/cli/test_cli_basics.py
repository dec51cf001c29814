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


def test_a_command_leaves_the_process_group_at_its_end(tmp_path):
    """Under `accelerate launch` the stages share one process group; the command leaves it when it ends, however it
    ends (here: a one-line error), so no process exits still in it."""
    import torch.distributed as dist

    from quartet.cli import main

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert main(["doctor", str(tmp_path / "no-such-run")]) == 2
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
