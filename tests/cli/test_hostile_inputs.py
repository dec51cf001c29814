"""Hostile inputs over every command: exit 2, exactly one `error:` line naming the culprit, no traceback,
and a filesystem left exactly as it was.

The table is the test: each `Case` is an argv, the files to create first (in the case's own directory,
which is also the working directory, so relative paths in argv and configs land there), and the text
the error line must contain. To add a case, append to `CASES`.

Speed: a `quartet` process spends ~4 s importing torch and transformers, so the cases run in ONE
driver process that calls `quartet.cli.main(argv)` per case (stderr captured, logging re-pointed at
it, an escaping exception recorded as a traceback). The cases marked `subprocess=True` also run as
real `python -m quartet.cli` processes, so the entry point itself is covered.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

TINY = "tiny:llama?hidden=32&layers=1&heads=4&vocab=300"
SFT_ROWS = '{"prompt": "ab", "completion": "aa"}\n{"prompt": "cd", "completion": "a1"}\n'
PAIRS = '{"prompt": "ab", "chosen": "aa", "rejected": "bb"}\n{"prompt": "cd", "chosen": "a1", "rejected": "zz"}\n'
PIPELINE = f'output_dir: out\ntask: tiny-target\nsft: {{model: "{TINY}", data: {{path: sft.jsonl}}}}\nrm: {{model: "{TINY}"}}\n'
PPO = ["ppo", f"policy={TINY}", "prompts.path=task:tiny-target/train", "output_dir=out"]
LABEL = ["label", f"policy={TINY}", "prompts.path=task:tiny-target/train", "output=out/pairs.jsonl"]
EVAL = ["--prompts", "task:tiny-target/eval", "--num-prompts", "2", "--max-new-tokens", "4", "--out", "out"]


def model(kind: str, damage: str | None = None) -> dict:
    """A model dir to copy in: kind "lm" (a saved tiny causal LM) or "rm" (a saved tiny reward model);
    damage "truncate" (model.safetensors cut in half) or "config" (config.json that is not JSON)."""
    return {"model": kind, "damage": damage}


@dataclass
class Case:
    id: str
    argv: list[str]
    error: list[str]
    """substrings of the one `error:` line (rc 2), or of stderr's note (rc 0)"""
    files: dict = field(default_factory=dict)
    """relative path -> text, or model(...)"""
    rc: int = 2
    writes: list[str] = field(default_factory=list)
    """files the command may create (a report); everything else must be untouched"""
    subprocess: bool = False
    """also run as a real `python -m quartet.cli` process"""


CASES = [
    # ---- config values: type, range and finiteness, one check for all
    Case("sft-lr-inf", ["sft", f"model={TINY}", "data.path=sft.jsonl", "optim.lr=.inf"],
         ["optim.lr: must be a finite number, got inf"], {"sft.jsonl": SFT_ROWS}, subprocess=True),
    Case("sft-yaml-epochs-inf", ["sft", "-c", "sft.yaml"], ["epochs: must be a finite number, got inf"],
         {"sft.yaml": f"model: '{TINY}'\ndata: {{path: sft.jsonl}}\nepochs: .inf\n", "sft.jsonl": SFT_ROWS}),
    Case("sft-adam-eps-zero", ["sft", "optim.adam_eps=0"], ["optim.adam_eps: must be > 0, got 0.0"]),
    Case("sft-grad-norm-nan", ["sft", "optim.max_grad_norm=.nan"], ["optim.max_grad_norm: must be a finite number"]),
    Case("sft-weight-decay-negative", ["sft", "optim.weight_decay=-0.1"], ["optim.weight_decay: must be >= 0, got -0.1"]),
    Case("sft-lora-dropout-one", ["sft", "lora.dropout=1"], ["lora.dropout: must be < 1"]),
    Case("sft-seed-negative", ["sft", "seed=-1"], ["seed: must be in [0, 4294967295], got -1"]),
    Case("sft-yaml-month-13", ["sft", "-c", "sft.yaml"], ["sft.yaml: not valid YAML", "month must be in 1..12"],
         {"sft.yaml": "seed: 2024-13-01\n"}),
    Case("sft-yaml-5000-digit-int", ["sft", "-c", "sft.yaml"], ["sft.yaml: not valid YAML", "integer"],
         {"sft.yaml": "batch_size: " + "9" * 5000 + "\n"}),
    Case("label-min-gap-negative", [*LABEL, "min_gap=-1"], ["label.min_gap: must be >= 0, got -1.0"]),
    Case("label-temperature-nan", [*LABEL, "generation.temperature=.nan"],
         ["generation.temperature: must be a finite number, got nan"]),
    Case("rm-column-not-text", ["rm", "data.columns={prompt: 3}"], ["data.columns.prompt: must be a column name"]),
    Case("rm-center-coef-inf", ["rm", "center_coef=.inf"], ["center_coef: must be a finite number, got inf"]),
    Case("ppo-eos-penalty-nan", [*PPO, "missing_eos_penalty=.nan"], ["missing_eos_penalty: must be a finite number"]),
    Case("ppo-lr-inf", [*PPO, "optim.lr=.inf"], ["optim.lr: must be a finite number, got inf"]),
    Case("ppo-critic-lr-negative", [*PPO, "critic_lr=-1"], ["ppo.critic_lr: must be > 0, got -1.0"]),
    Case("ppo-critic-warmup-no-critic", [*PPO, "advantage=rloo", "samples_per_prompt=2", "critic_warmup=2"],
         ["ppo.critic_warmup: 2 iterations of critic-only training, but this run has no critic"]),
    Case("ppo-reward-clip-zero", [*PPO, "reward_clip=0"], ["ppo.reward_clip: must be > 0, got 0.0"]),
    Case("eval-temperature-nan", ["eval", TINY, *EVAL, "--temperature", "nan"],
         ["temperature: must be a finite number, got nan"]),
    Case("eval-num-prompts-zero", ["eval", TINY, *EVAL, "--num-prompts", "0"], ["num_prompts: must be > 0, got 0"]),
    Case("eval-seed-negative", ["eval", TINY, *EVAL, "--seed", "-1"], ["seed: must be in [0, 4294967295]"]),
    # ---- `quartet run`: every stage's inputs checked before the first stage starts
    Case("run-unknown-task", ["run", "pipe.yaml", "task=nope"],
         ["pipeline.task: unknown task 'nope' (known tasks: positive-review, tiny-target)"],
         {"pipe.yaml": PIPELINE, "sft.jsonl": SFT_ROWS}, subprocess=True),
    Case("run-unknown-stage", ["run", "pipe.yaml", "stages=[sft, ppo2]"], ["stages: unknown stage 'ppo2'"],
         {"pipe.yaml": PIPELINE, "sft.jsonl": SFT_ROWS}),
    Case("run-eval-num-prompts-zero", ["run", "pipe.yaml", "eval.num_prompts=0"], ["eval.num_prompts: must be > 0"],
         {"pipe.yaml": PIPELINE, "sft.jsonl": SFT_ROWS}),
    Case("run-eval-temperature-negative", ["run", "pipe.yaml", "eval.temperature=-1"],
         ["eval.temperature: must be >= 0"], {"pipe.yaml": PIPELINE, "sft.jsonl": SFT_ROWS}),
    Case("run-eval-unknown-engine", ["run", "pipe.yaml", "eval.engine=sglang"],
         ["eval.engine: must be one of hf, vllm, got 'sglang'"], {"pipe.yaml": PIPELINE, "sft.jsonl": SFT_ROWS}),
    Case("run-eval-unknown-split", ["run", "pipe.yaml", "eval.prompts=task:tiny-target/test"],
         ["eval.prompts: task:tiny-target/test: unknown split (choose from train, eval)"],
         {"pipe.yaml": PIPELINE, "sft.jsonl": SFT_ROWS}),
    Case("run-sft-data-missing", ["run", "pipe.yaml", "sft.data.path=missing.jsonl"],
         ["sft.data.path: missing.jsonl: file not found"], {"pipe.yaml": PIPELINE}),
    Case("run-reward-module-missing", ["run", "pipe.yaml", "ppo.reward=no_such_module_xyz:score"],
         ["ppo.reward: reward 'no_such_module_xyz:score': no module named 'no_such_module_xyz'"],
         {"pipe.yaml": PIPELINE, "sft.jsonl": SFT_ROWS}),
    Case("run-reward-module-raises", ["run", "pipe.yaml", "ppo.reward=hostile_raises:score"],
         ["ppo.reward: reward 'hostile_raises:score': importing 'hostile_raises' failed (RuntimeError: boom)"],
         {"pipe.yaml": PIPELINE, "sft.jsonl": SFT_ROWS, "hostile_raises.py": "raise RuntimeError('boom')\n"}),
    Case("run-judge-unknown-task", ["run", "pipe.yaml", "label.judge=task:nope"],
         ["label.judge: task:nope: unknown task"], {"pipe.yaml": PIPELINE, "sft.jsonl": SFT_ROWS}),
    Case("run-reward-dir-missing", ["run", "pipe.yaml", "ppo.reward=models/rm"],
         ["ppo.reward: reward 'models/rm': no such reward-model directory"],
         {"pipe.yaml": PIPELINE, "sft.jsonl": SFT_ROWS}),
    Case("run-normalize-policy-missing", ["run", "pipe.yaml", "rm.normalize_policy=models/policy"],
         ["rm.normalize_policy: model 'models/policy': not found"], {"pipe.yaml": PIPELINE, "sft.jsonl": SFT_ROWS}),
    Case("run-gold-plain-lm", ["run", "pipe.yaml", "ppo.gold=lm"],
         ["ppo.gold: reward model 'lm'", "no trained reward head"],
         {"pipe.yaml": PIPELINE, "sft.jsonl": SFT_ROWS, "lm": model("lm")}),
    Case("run-label-policy-damaged", ["run", "pipe.yaml", "stages=[label]", "label.policy=lm"],
         ["label.policy: lm/model.safetensors: damaged weights file"],
         {"pipe.yaml": PIPELINE, "lm": model("lm", "truncate")}),
    Case("run-ppo-output-is-a-user-folder", ["run", "pipe.yaml", "ppo.output_dir=mine"],
         ["ppo.output_dir: mine already holds files that are not a Quartet run"],
         {"pipe.yaml": PIPELINE, "sft.jsonl": SFT_ROWS, "mine/thesis.tex": "my thesis\n"}),
    Case("run-label-output-is-a-user-file", ["run", "pipe.yaml", "label.output=notes.jsonl"],
         ["label.output: notes.jsonl exists and was not written by Quartet"],
         {"pipe.yaml": PIPELINE, "sft.jsonl": SFT_ROWS, "notes.jsonl": '{"mine": 1}\n'}),
    # ---- damaged model files, at every entry point that loads a model
    Case("sft-model-truncated", ["sft", "model=lm", "data.path=sft.jsonl"], ["lm/model.safetensors: damaged weights file"],
         {"lm": model("lm", "truncate"), "sft.jsonl": SFT_ROWS}, subprocess=True),
    Case("sft-model-gguf-cut-short", ["sft", "model=cut.gguf", "data.path=sft.jsonl"],
         ["model 'cut.gguf': cannot read the GGUF tokenizer"], {"cut.gguf": "GGUF\x03\x00\x00\x00", "sft.jsonl": SFT_ROWS}),
    Case("eval-reference-truncated", ["eval", TINY, *EVAL, "--reference", "lm"], ["lm/model.safetensors: damaged weights file"],
         {"lm": model("lm", "truncate")}),
    Case("sft-model-config-not-json", ["sft", "model=lm", "data.path=sft.jsonl"], ["lm/config.json: not readable JSON"],
         {"lm": model("lm", "config"), "sft.jsonl": SFT_ROWS}),
    Case("eval-checkpoint-truncated", ["eval", "lm", *EVAL], ["lm/model.safetensors: damaged weights file"],
         {"lm": model("lm", "truncate")}),
    Case("eval-checkpoint-config-not-json", ["eval", TINY, "lm", *EVAL], ["lm/config.json: not readable JSON"],
         {"lm": model("lm", "config")}),
    Case("label-judge-rm-truncated", [*LABEL, "judge=rm"], ["rm/model.safetensors: damaged weights file"],
         {"rm": model("rm", "truncate")}),
    Case("label-judge-rm-config-not-json", [*LABEL, "judge=rm"], ["rm/config.json: not readable JSON"],
         {"rm": model("rm", "config")}),
    Case("ppo-reward-rm-truncated", [*PPO, "reward=rm"], ["rm/model.safetensors: damaged weights file"],
         {"rm": model("rm", "truncate")}),
    Case("ppo-reward-rm-config-not-json", [*PPO, "reward=rm"], ["rm/config.json: not readable JSON"],
         {"rm": model("rm", "config")}),
    Case("rm-normalize-policy-truncated", ["rm", f"model={TINY}", "data.path=pairs.jsonl", "normalize_policy=lm",
                                           "output_dir=out"],
         ["rm.normalize_policy: lm/model.safetensors: damaged weights file"],
         {"lm": model("lm", "truncate"), "pairs.jsonl": PAIRS}),
    # ---- a language model where a reward model belongs: refused, not given a random head
    Case("label-judge-plain-lm", [*LABEL, "judge=lm"], ["reward model 'lm'", "no trained reward head"],
         {"lm": model("lm")}, subprocess=True),
    Case("ppo-reward-plain-lm", [*PPO, "reward=lm"], ["reward model 'lm'", "no trained reward head"], {"lm": model("lm")}),
    Case("eval-reward-model-plain-lm", ["eval", TINY, *EVAL, "--reward-model", "lm"],
         ["reward model 'lm'", "no trained reward head"], {"lm": model("lm")}),
    # ---- prompts longer than the context, another vocabulary
    Case("label-prompt-longer-than-context", [*LABEL, f"policy={TINY}&ctx=16"],
         ["exceeds the model's context of 16 tokens", "lower prompts.max_prompt_tokens or generation.max_new_tokens"]),
    Case("eval-prompt-longer-than-context", ["eval", "tiny:gpt2?hidden=32&layers=1&heads=4&vocab=300&ctx=16", *EVAL],
         ["exceeds the model's context of 16 tokens", "lower --max-new-tokens"]),
    Case("rm-normalize-policy-short-context", ["rm", f"model={TINY}", "data.path=pairs.jsonl",
                                               f"normalize_policy={TINY}&ctx=8", "output_dir=out"],
         ["rm.normalize_policy", "exceeds the model's context of 8 tokens"], {"pairs.jsonl": PAIRS}),
    Case("eval-reference-other-vocabulary", ["eval", TINY, *EVAL, "--reference", TINY.replace("300", "512")],
         ["--reference", "scores 512 tokens but checkpoint", "scores 300", "KL needs one vocabulary"]),
    # ---- report and doctor: malformed metrics are one line, wrong types a note
    Case("doctor-line-not-an-object", ["doctor", "run"], ["run/metrics.jsonl line 1: not a JSON object"],
         {"run/metrics.jsonl": '[1, 2]\n{"stage": "ppo", "step": 1}\n'}, subprocess=True),
    Case("report-line-null", ["report", "run"], ["run/metrics.jsonl line 1: not a JSON object"],
         {"run/metrics.jsonl": 'null\n{"stage": "ppo", "step": 1}\n'}),
    Case("doctor-missing-run-dir", ["doctor", "nope"], ["nope: run directory not found"]),
    Case("doctor-wrong-types-noted", ["doctor", "run"],
         ["run/metrics.jsonl: ignored 3 value(s) of the wrong type", 'objective/score = "high" is not a number',
          'step "one" is not a whole number'],
         {"run/metrics.jsonl": '{"stage": "ppo", "step": 1, "objective/score": "high", "objective/kl": [1]}\n'
                               '{"stage": "ppo", "step": "one", "objective/score": 0.5}\n'
                               '{"stage": "ppo", "step": 2, "objective/score": 0.5}\n'}, rc=0,
         writes=["run/findings.jsonl"]),
    Case("report-wrong-types-noted", ["report", "run"], ["ignored 1 value(s) of the wrong type", "stage 5 is not text"],
         {"run/metrics.jsonl": '{"stage": 5, "step": 1}\n{"stage": "sft", "step": 1, "sft/loss": 1.0}\n'}, rc=0,
         writes=["run/report.html", "run/plots"]),
    # ---- outputs: a user's folder or file is never replaced; checkpoints are never unpickled
    Case("sft-into-users-folder", ["sft", f"model={TINY}", "data.path=sft.jsonl", "output_dir=mine"],
         ["sft.output_dir: mine already holds files that are not a Quartet run", "--overwrite"],
         {"sft.jsonl": SFT_ROWS, "mine/thesis.tex": "chapter 1"}, subprocess=True),
    Case("sft-output-is-a-file", ["sft", f"model={TINY}", "data.path=sft.jsonl", "output_dir=notes.txt"],
         ["sft.output_dir: notes.txt is a file"], {"sft.jsonl": SFT_ROWS, "notes.txt": "mine"}),
    Case("rm-output-dot", ["rm", f"model={TINY}", "data.path=pairs.jsonl", "output_dir=."],
         ["rm.output_dir: '.' is the current directory"], {"pairs.jsonl": PAIRS}),
    Case("label-output-users-file", ["label", f"policy={TINY}", "prompts.path=task:tiny-target/train",
                                     "output=mine.jsonl"],
         ["label.output: mine.jsonl exists and was not written by Quartet"], {"mine.jsonl": "{}\n"}),
    Case("eval-out-users-folder", ["eval", TINY, *EVAL], ["eval.out: out already holds files that are not a Quartet run"],
         {"out/keep.txt": "mine"}),
    Case("ppo-into-another-stages-run", [*PPO], ["ppo.output_dir: out already holds a Quartet sft run"],
         {"out/.quartet-run": '{"stage": "sft"}\n', "out/config.yaml": "model: x\n"}),
    Case("ppo-resume-without-checkpoint", [*PPO, "--resume"], ["--resume given but there is no checkpoint"]),
    Case("ppo-resume-pickled-checkpoint", [*PPO, "--resume"],
         ["state.pt: checkpoint of an older Quartet (pickled state)", "unpickling a file can run code"],
         {"out/.quartet-run": '{"stage": "ppo"}\n', "out/checkpoints/iter-2/state.pt": "not read",
          "out/checkpoints/iter-2/policy.safetensors": "not read"}),
    Case("ppo-resume-damaged-checkpoint", [*PPO, "--resume"],
         ["no readable checkpoint", "policy.safetensors: damaged safetensors file"],
         {"out/.quartet-run": '{"stage": "ppo"}\n', "out/checkpoints/iter-2/policy.safetensors": "cut short",
          "out/checkpoints/iter-2/state.json": "{}", "out/checkpoints/iter-2/state.safetensors": "x"}),
    Case("run-into-users-folder", ["run", "p.yaml", "output_dir=."],
         ["pipeline.output_dir: '.' is the current directory"],
         {"p.yaml": PIPELINE, "pipeline.yaml": "my own notes\n", "sft.jsonl": SFT_ROWS}),
]

DRIVER = r'''
import contextlib, io, json, logging, os, shutil, sys, traceback
sys.dont_write_bytecode = True
spec = json.load(open(sys.argv[1]))
TINY = spec["tiny"]
templates = {}


def template(kind):
    if kind not in templates:
        path = os.path.join(spec["root"], "_templates", kind)
        if kind == "lm":
            from quartet.models import load_causal_lm, save_model
            save_model(*load_causal_lm(TINY), path)
        else:
            from quartet.models import load_reward_model, save_reward_model
            save_reward_model(load_reward_model(TINY), path)
        templates[kind] = path
    return templates[kind]


def materialise(case_dir, files):
    os.makedirs(case_dir)
    for rel, content in files.items():
        path = os.path.join(case_dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if isinstance(content, dict):
            shutil.copytree(template(content["model"]), path)
            if content["damage"] == "truncate":
                weights = os.path.join(path, "model.safetensors")
                data = open(weights, "rb").read()
                open(weights, "wb").write(data[: len(data) // 2])
            elif content["damage"] == "config":
                open(os.path.join(path, "config.json"), "w").write("{not json")
        else:
            open(path, "w", encoding="utf-8").write(content)


def snapshot(root):
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = [st.st_size, st.st_mtime_ns] if name in filenames else ["dir"]
    return out


from quartet.cli import main

results = {}
for case in spec["cases"]:
    d = case["dir"]
    materialise(d, case["files"])
    before = snapshot(d)
    os.chdir(d)
    err = io.StringIO()
    root = logging.getLogger()
    for h in list(root.handlers):  # cli.main's basicConfig then points logging at this case's stderr
        root.removeHandler(h)
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(case["argv"])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:
            rc = "exception"
            err.write(traceback.format_exc())
    os.chdir(spec["root"])
    results[case["id"]] = {"rc": rc, "stderr": err.getvalue(), "before": before, "after": snapshot(d)}
json.dump(results, open(sys.argv[2], "w"))
'''


def _env() -> dict:
    return {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _snapshot(root: Path) -> dict:
    """relative path -> [size, mtime] of every file, ["dir"] of every directory (entries, not mtimes, count)"""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = [st.st_size, st.st_mtime_ns] if name in filenames else ["dir"]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case's (rc, stderr, filesystem before, after) from one driver process."""
    root = tmp_path_factory.mktemp("hostile")
    spec = {"root": str(root), "tiny": TINY, "cases": [
        {"id": c.id, "argv": c.argv, "files": c.files, "dir": str(root / c.id)} for c in CASES
    ]}
    (root / "spec.json").write_text(json.dumps(spec))
    (root / "driver.py").write_text(DRIVER)
    out = subprocess.run([sys.executable, str(root / "driver.py"), str(root / "spec.json"), str(root / "results.json")],
                         capture_output=True, text=True, timeout=600, env=_env(), cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    return root, json.loads((root / "results.json").read_text())


def _check(case: Case, rc, stderr: str, before: dict, after: dict) -> None:
    assert "Traceback" not in stderr, f"{case.id}: traceback\n{stderr[-3000:]}"
    assert rc == case.rc, f"{case.id}: exit {rc}, expected {case.rc}\n{stderr[-2000:]}"
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    if case.rc == 2:
        assert len(errors) == 1, f"{case.id}: expected one error line, got {errors}"
        text = errors[0]
    else:
        assert not errors, f"{case.id}: {errors}"
        text = stderr
    for part in case.error:
        assert part in text, f"{case.id}: {part!r} not in {text!r}"
    allowed = {p for p in after if any(p == w or p.startswith(w + os.sep) for w in case.writes)}
    changed = {p for p in set(before) | set(after) if p not in allowed and before.get(p) != after.get(p)}
    assert not changed, f"{case.id}: the command touched {sorted(changed)}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input(case, results):
    _, by_id = results
    r = by_id[case.id]
    _check(case, r["rc"], r["stderr"], r["before"], r["after"])


@pytest.mark.parametrize("case", [c for c in CASES if c.subprocess], ids=[c.id for c in CASES if c.subprocess])
def test_hostile_input_as_a_real_process(case, results, tmp_path):
    """The same case through `python -m quartet.cli` (the entry point, its logging and its exit status),
    in a fresh copy of the files the driver made for it."""
    root, _ = results
    d = tmp_path / "case"
    shutil.copytree(root / case.id, d)
    before = _snapshot(d)
    out = subprocess.run([sys.executable, "-m", "quartet.cli", *case.argv], capture_output=True, text=True,
                         timeout=300, env=_env(), cwd=d)
    _check(case, out.returncode, out.stderr, before, _snapshot(d))


def test_the_table_covers_every_command_and_enough_cases():
    commands = {c.argv[0] for c in CASES}
    assert commands >= {"sft", "label", "rm", "ppo", "run", "eval", "report", "doctor"}
    assert len(CASES) >= 30 and len({c.id for c in CASES}) == len(CASES)
    assert sum(c.subprocess for c in CASES) >= 5


def test_case_record_is_plain_data():
    """Cases travel to the driver as JSON: keep them plain data (text, lists, dicts from `model`)."""
    json.dumps([asdict(c) for c in CASES])
