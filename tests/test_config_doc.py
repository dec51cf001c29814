"""`quartet config <stage>` and docs/config.md: every setting, its default and its docstring, from one source."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from quartet import cli
from quartet.config import OptimConfig, PPOConfig
from quartet.config_doc import (
    REGENERATE,
    STAGES,
    default_config,
    field_docs,
    markdown,
    settings,
    starter_yaml,
    wired_fields,
    write_starter,
)
from quartet.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]

# the function each stage's `cli` hands its loaded config to, replaced so nothing trains
TRAIN = {
    "sft": ("quartet.trainers.sft", "train_sft"), "label": ("quartet.trainers.label", "label"),
    "rm": ("quartet.trainers.reward", "train_reward"), "ppo": ("quartet.trainers.ppo", "train_ppo"),
    "grpo": ("quartet.trainers.ppo", "train_ppo"), "rloo": ("quartet.trainers.ppo", "train_ppo"),
    "dpo": ("quartet.trainers.dpo", "train_dpo"), "run": ("quartet.pipeline", "run_pipeline"),
}


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "quartet.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def loaded_by_cli(stage: str, path: Path, monkeypatch) -> object:
    """The config `quartet <stage> -c path` (`quartet run path`) builds, taken where the stage would train on it."""
    import importlib

    module_name, func = TRAIN[stage]
    seen = []
    monkeypatch.setattr(importlib.import_module(module_name), func, lambda cfg, *a, **k: seen.append(cfg) or {})
    argv = ["run", str(path)] if stage == "run" else [stage, "-c", str(path)]
    assert cli.main(argv) == 0
    (cfg,) = seen
    return cfg


def test_the_config_command_offers_every_stage_that_reads_a_config():
    assert set(STAGES) == {*cli.TRAINING_STAGES, "run"}
    for stage in STAGES:
        assert cli.build_parser().parse_args(["config", stage]).stage == stage
    with pytest.raises(SystemExit):  # eval takes flags, not a config file
        cli.build_parser().parse_args(["config", "eval"])


def test_field_docs_are_the_strings_under_the_fields_in_the_source():
    docs = field_docs(OptimConfig)
    assert docs["lr"].startswith("peak learning rate (AdamW); null = the stage's default for full fine-tuning")
    assert list(docs) == [f.name for f in dataclasses.fields(OptimConfig)]
    # a docstring wrapped over lines in the source reads as one paragraph
    assert field_docs(PPOConfig)["tis_cap"].startswith("truncated importance sampling: weight each token's policy "
                                                       "loss by min(pi_train / pi_engine, tis_cap), e.g. 2.0 (TRL's")


@pytest.mark.parametrize("stage", STAGES)
def test_every_setting_of_every_stage_has_a_docstring(stage):
    missing = [s.name for s in settings(stage) if not s.doc]
    assert not missing, f"fields without a docstring under them: {missing}"


@pytest.mark.parametrize("stage", STAGES)
def test_the_starter_file_loads_as_the_defaults(stage, tmp_path, monkeypatch):
    """`quartet config <stage> --write` then `quartet <stage> -c` gives exactly the config an empty file gives;
    the file sets every field (bar those `quartet run` wires from others), each under its docstring."""
    monkeypatch.chdir(tmp_path)  # `quartet run` checks its output paths relative to here
    path = write_starter(stage, tmp_path / "starter.yaml")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert loaded_by_cli(stage, path, monkeypatch) == loaded_by_cli(stage, empty, monkeypatch)

    text = path.read_text()
    data = yaml.safe_load(text)
    written = set()

    def leaves(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict) and f"{prefix}{key}" in {s.name for s in settings(stage) if s.section}:
                leaves(value, f"{prefix}{key}.")
            else:
                written.add(prefix + key)

    leaves(data)
    expected = {s.name for s in settings(stage) if not s.section and not s.wired}
    assert written == expected
    lines = text.splitlines()
    for s in settings(stage):  # each field's line comes right after the last line of its docstring comment
        key = s.name.rsplit(".", 1)[-1]
        at = next(i for i, line in enumerate(lines) if line.lstrip("# ").startswith(f"{key}:")
                  and len(line) - len(line.lstrip()) == 2 * s.name.count("."))
        assert lines[at - 1].lstrip().startswith("#"), s.name
        lines = lines[at + 1:]


def test_a_preset_stage_starts_from_its_presets_defaults(tmp_path):
    cfg = default_config("grpo")
    assert (cfg.advantage, cfg.output_dir, default_config("ppo").advantage) == ("grpo", "runs/grpo", "gae")
    assert "advantage: grpo\n" in starter_yaml("grpo")


def test_quartet_run_keeps_wiring_what_the_starter_leaves_commented(tmp_path):
    """The fields `quartet run` fills from the other stages are found from `wire` itself, and a starter file
    that names a task still gets that task's data everywhere (they were not frozen at the default task's)."""
    assert {"sft.data.path", "ppo.policy", "ppo.reward", "rm.data.path", "sft.tracking.report_to",
            "eval.prompts"} <= wired_fields()
    assert "ppo.clip" not in wired_fields()
    from quartet.pipeline import load_pipeline

    path = write_starter("run", tmp_path / "run.yaml")
    path.write_text(path.read_text().replace("task: positive-review", "task: tiny-target", 1))
    cfg = load_pipeline(str(path), [f"output_dir={tmp_path / 'out'}"])
    assert (cfg.sft.data.path, cfg.ppo.prompts.path, cfg.ppo.output_dir) == (
        "task:tiny-target/sft", "task:tiny-target/train", str(tmp_path / "out" / "ppo"))


def test_config_prints_each_field_with_type_default_and_docstring():
    out = run("config", "rloo")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    at = lines.index("optim.lr: float | None = null")  # filled in at validation: 1e-5, or 1e-4 with LoRA
    assert lines[at + 1].strip().startswith("peak learning rate (AdamW); null = the stage's default")
    assert "advantage: Literal[" in out.stdout and "'remax'] = rloo" in out.stdout  # the preset's default
    assert "optim: OptimConfig" in lines and "lora.r: int = 16" in lines


def test_write_refuses_an_existing_file_unless_overwrite(tmp_path):
    target = tmp_path / "ppo.yaml"
    target.write_text("mine\n")
    out = run("config", "ppo", "--write", str(target))
    assert out.returncode == 2
    assert out.stderr.splitlines() == [f"error: {target}: already exists; pass --overwrite to replace it, or name "
                                       f"another file"]
    assert target.read_text() == "mine\n"
    out = run("config", "ppo", "--write", str(target), "--overwrite")
    assert out.returncode == 0, out.stderr
    assert target.read_text() == starter_yaml("ppo")
    with pytest.raises(ConfigError, match="is a directory"):
        write_starter("ppo", tmp_path, overwrite=True)


def test_docs_config_md_is_generated_from_the_docstrings():
    committed = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert committed == markdown(), f"docs/config.md is stale: run `{REGENERATE}` and commit it"
    assert "| `optim.lr` | `float \\| None` | `null` | peak learning rate (AdamW); null = the stage's default" in committed
