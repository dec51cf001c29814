"""Everything that can be checked before a model loads is checked before it loads (issue 35).

Timing nothing: every loader of model weights is replaced by one that fails the test, so a bad data file, a
missing field, an unresolvable reward spec or a bad model name must come back as the one `error:` line (rc 2)
before any stage, `quartet run`'s first included, has loaded a model. The CLI runs in-process
(`quartet.cli.main`), as a user meets it; the Python entry points raise the same error.
"""

from __future__ import annotations

import json

import pytest

from quartet import cli
from quartet.config import PPOConfig, SFTConfig, from_dict
from quartet.errors import ConfigError, DataError
from quartet.models import loading
from quartet.models import reward as reward_models

TINY = "tiny:llama?hidden=32&layers=1&heads=4&vocab=300"
SFT_ROWS = [{"prompt": "ab", "completion": "aa"}, {"prompt": "cd", "completion": "a1"}]
PAIRS = [{"prompt": "ab", "chosen": "aa", "rejected": "bb"}, {"prompt": "cd", "chosen": "a1", "rejected": "zz"}]
NO_FIELD = [{"question": "ab"}]  # a row without any field a stage reads
MISSING_MODULE = "no_such_module_xyz:score"


@pytest.fixture
def no_model_load(monkeypatch, tmp_path):
    """Every way Quartet loads weights fails the test; the test runs in its own empty working directory."""

    def loader_called(*args, **kwargs):
        raise AssertionError("loader called")

    for name in ("build_tiny", "_load_dir", "load_gguf", "_load_memory"):
        monkeypatch.setattr(loading, name, loader_called, raising=name != "_load_memory")
    monkeypatch.setattr(reward_models, "_load_seq_cls_dir", loader_called)
    monkeypatch.chdir(tmp_path)
    for name, rows in {"sft.jsonl": SFT_ROWS, "pairs.jsonl": PAIRS, "nofield.jsonl": NO_FIELD,
                       "prompts.jsonl": [{"prompt": "ab"}, {"prompt": "cd"}]}.items():
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def run_cli(argv: list[str], capsys) -> str:
    """The one `error:` line `quartet <argv>` prints (rc 2)."""
    rc = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1, err
    return errors[0]


SFT = ["sft", f"model={TINY}", "data.path=sft.jsonl", "output_dir=out"]
RM = ["rm", f"model={TINY}", "data.path=pairs.jsonl", "output_dir=out"]
LABEL = ["label", f"policy={TINY}", "prompts.path=prompts.jsonl", "judge=task:tiny-target", "output=out/pairs.jsonl"]
PPO = ["ppo", f"policy={TINY}", "reward=task:tiny-target", "prompts.path=prompts.jsonl", "output_dir=out"]
DPO = ["dpo", f"policy={TINY}", "data.path=pairs.jsonl", "output_dir=out"]
EVAL = ["eval", TINY, "--prompts", "prompts.jsonl", "--num-prompts", "2", "--out", "out"]

CASES = {
    # stage: a missing data file, a file without the fields the stage reads, a bad reward spec or model name
    "sft-data-missing": ([*SFT, "data.path=missing.jsonl"], "missing.jsonl: file not found"),
    "sft-data-no-field": ([*SFT, "data.path=nofield.jsonl"], "nofield.jsonl row 1: missing field 'prompt'"),
    "sft-eval-data-no-completion": ([*SFT, "eval_data.path=prompts.jsonl"],
                                    "prompts.jsonl row 1: missing field 'completion'"),
    "rm-data-missing": ([*RM, "data.path=missing.jsonl"], "missing.jsonl: file not found"),
    "rm-data-no-chosen": ([*RM, "data.path=sft.jsonl"], "sft.jsonl row 1: missing field 'chosen'"),
    "rm-normalize-policy-bad": ([*RM, "normalize_policy=tiny:nope"], "rm.normalize_policy: model 'tiny:nope': unknown tiny"),
    "label-prompts-missing": ([*LABEL, "prompts.path=missing.jsonl"], "missing.jsonl: file not found"),
    "label-prompts-no-field": ([*LABEL, "prompts.path=nofield.jsonl"], "nofield.jsonl row 1: missing field 'prompt'"),
    "label-judge-unresolvable": ([*LABEL, f"judge={MISSING_MODULE}"],
                                 f"label.judge: reward '{MISSING_MODULE}': no module named 'no_such_module_xyz'"),
    "label-judge-unknown-task": ([*LABEL, "judge=task:nope"], "label.judge: task:nope: unknown task"),
    "ppo-prompts-missing": ([*PPO, "prompts.path=missing.jsonl"], "missing.jsonl: file not found"),
    "ppo-prompts-no-field": ([*PPO, "prompts.path=nofield.jsonl"], "nofield.jsonl row 1: missing field 'prompt'"),
    "ppo-reward-unresolvable": ([*PPO, f"reward={MISSING_MODULE}"], f"ppo.reward: reward '{MISSING_MODULE}'"),
    "ppo-reward-dir-missing": ([*PPO, "reward=models/rm"], "ppo.reward: reward 'models/rm': no such reward-model"),
    "ppo-gold-unknown-task": ([*PPO, "gold=task:nope"], "ppo.gold: task:nope: unknown task"),
    "ppo-monitor-judge-bad": ([*PPO, "monitor_judges={on_task: judge:nope}"],
                              "ppo.monitor_judges.on_task: reward 'judge:nope': unknown judge"),
    "ppo-reference-missing": ([*PPO, "reference=models/ref"], "ppo.reference: model 'models/ref': not found"),
    "ppo-critic-init-missing": ([*PPO, "critic_init=models/critic"], "ppo.critic_init: model 'models/critic'"),
    "grpo-reward-unresolvable": (["grpo", *PPO[1:], f"reward={MISSING_MODULE}"], f"ppo.reward: reward '{MISSING_MODULE}'"),
    "rloo-prompts-missing": (["rloo", *PPO[1:], "prompts.path=missing.jsonl"], "missing.jsonl: file not found"),
    "dpo-data-missing": ([*DPO, "data.path=missing.jsonl"], "missing.jsonl: file not found"),
    "dpo-data-no-field": ([*DPO, "data.path=prompts.jsonl"], "prompts.jsonl row 1: missing field 'chosen'"),
    "dpo-reference-missing": ([*DPO, "reference=models/ref"], "dpo.reference: model 'models/ref': not found"),
    "eval-prompts-missing": ([*EVAL[:3], "missing.jsonl", *EVAL[4:]], "missing.jsonl: file not found"),
    "eval-prompts-no-field": ([*EVAL[:3], "nofield.jsonl", *EVAL[4:]], "nofield.jsonl row 1: missing field 'prompt'"),
    "eval-task-unknown": ([*EVAL, "--task", "nope"], "task:nope: unknown task"),
    "eval-reference-missing": ([*EVAL, "--reference", "models/ref"], "model 'models/ref': not found"),
}


@pytest.mark.parametrize("argv, message", CASES.values(), ids=CASES.keys())
def test_a_bad_input_is_one_error_line_before_any_model_loads(no_model_load, capsys, argv, message):
    line = run_cli(argv, capsys)
    assert message in line
    assert not (no_model_load / "out").exists()


def test_every_training_command_is_covered():
    covered = {k.split("-")[0] for k in CASES}
    assert covered >= {*cli.TRAINING_STAGES, "eval"}


PIPELINE = (f"output_dir: pipe\ntask: tiny-target\nstages: [sft, label, rm, ppo, eval]\n"
            f"sft: {{model: '{TINY}', data: {{path: sft.jsonl}}}}\nrm: {{model: '{TINY}'}}\n")
RUN_CASES = {
    "ppo-reward-unresolvable": (f"ppo.reward={MISSING_MODULE}", f"ppo.reward: reward '{MISSING_MODULE}'"),
    "ppo-prompts-no-field": ("ppo.prompts.path=nofield.jsonl",
                             "ppo.prompts.path: nofield.jsonl row 1: missing field 'prompt'"),
    "label-prompts-no-field": ("label.prompts.path=nofield.jsonl",
                               "label.prompts.path: nofield.jsonl row 1: missing field 'prompt'"),
    "rm-eval-data-no-field": ("rm.eval_data.path=sft.jsonl", "rm.eval_data.path: sft.jsonl row 1: missing field"),
    "eval-prompts-no-field": ("eval.prompts=nofield.jsonl", "eval.prompts: nofield.jsonl row 1: missing field"),
    "ppo-batch-arithmetic": ("ppo.minibatch_size=5", "minibatch_size"),
}


@pytest.mark.parametrize("override, message", RUN_CASES.values(), ids=RUN_CASES.keys())
def test_quartet_run_checks_every_stage_before_the_first_starts(no_model_load, capsys, monkeypatch, override,
                                                                 message):
    """A bad input of a late stage fails `quartet run` before sft (its first stage) starts, let alone loads."""
    from quartet import pipeline

    started = []
    monkeypatch.setattr(pipeline, "_run_stage", lambda stage, *a: started.append(stage))
    (no_model_load / "pipe.yaml").write_text(PIPELINE)
    line = run_cli(["run", "pipe.yaml", override], capsys)
    assert message in line
    assert started == [] and not (no_model_load / "pipe").exists()


def test_quartet_run_takes_what_an_earlier_stage_writes_on_trust(no_model_load, capsys, monkeypatch):
    """The label stage's pairs and the rm stage's model do not exist yet: not refused up front."""
    from quartet import pipeline

    started = []
    monkeypatch.setattr(pipeline, "_run_stage", lambda stage, *a: started.append(stage) or True)
    monkeypatch.setattr(pipeline, "write_report", lambda out: out / "report.html")
    (no_model_load / "pipe.yaml").write_text(PIPELINE)
    assert cli.main(["run", "pipe.yaml"]) == 0, capsys.readouterr().err
    assert started == ["sft", "label", "rm", "ppo", "eval"]


# ---- the Python entry points: the same errors, the same order
def test_ppo_trainer_in_python_refuses_a_bad_reward_before_loading(no_model_load):
    from quartet.trainers.ppo import PPOTrainer

    cfg = from_dict(PPOConfig, {"policy": TINY, "reward": MISSING_MODULE, "prompts": {"path": "prompts.jsonl"},
                                "output_dir": "out"})
    with pytest.raises(ConfigError, match=f"^ppo.reward: reward '{MISSING_MODULE}': no module named"):
        PPOTrainer(cfg, progress=False)
    assert not (no_model_load / "out").exists()


def test_ppo_trainer_in_python_refuses_a_missing_prompts_file_before_loading(no_model_load):
    from quartet.trainers.ppo import PPOTrainer

    cfg = from_dict(PPOConfig, {"policy": TINY, "reward": "task:tiny-target", "prompts": {"path": "gone.jsonl"},
                                "output_dir": "out"})
    with pytest.raises(DataError, match="^gone.jsonl: file not found$"):
        PPOTrainer(cfg, progress=False)


def test_sft_in_python_refuses_a_missing_field_before_loading(no_model_load):
    from quartet.trainers.sft import train_sft

    cfg = from_dict(SFTConfig, {"model": TINY, "data": {"path": "prompts.jsonl"}, "output_dir": "out"})
    with pytest.raises(DataError, match="^prompts.jsonl row 1: missing field 'completion'"):
        train_sft(cfg)


def test_the_loader_patch_does_catch_a_load(no_model_load, capsys):
    """The guard itself: a good config reaches the loader, which the fixture turns into a test failure."""
    with pytest.raises(AssertionError, match="loader called"):
        cli.main(SFT)


def test_stage_inputs_name_every_key_with_its_stage():
    from quartet.preflight import stage_inputs

    cfg = from_dict(PPOConfig, {"reference": "r", "critic_init": "c", "gold": "g", "monitor_judges": {"m": "j"}})
    keys = [i.key for i in stage_inputs("grpo", cfg)]
    assert keys == ["ppo.policy", "ppo.reference", "ppo.critic_init", "ppo.reward", "ppo.gold",
                    "ppo.monitor_judges.m", "ppo.prompts.path"]
    with pytest.raises(ValueError):
        stage_inputs("nope", cfg)
