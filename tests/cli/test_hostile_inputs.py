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

from quartet.outputs import MARKER, WRITES

TINY = "tiny:llama?hidden=32&layers=1&heads=4&vocab=300"
SFT_ROWS = '{"prompt": "ab", "completion": "aa"}\n{"prompt": "cd", "completion": "a1"}\n'
PAIRS = '{"prompt": "ab", "chosen": "aa", "rejected": "bb"}\n{"prompt": "cd", "chosen": "a1", "rejected": "zz"}\n'
PIPELINE = f'output_dir: out\ntask: tiny-target\nsft: {{model: "{TINY}", data: {{path: sft.jsonl}}}}\nrm: {{model: "{TINY}"}}\n'
PPO = ["ppo", f"policy={TINY}", "prompts.path=task:tiny-target/train", "output_dir=out"]
LABEL = ["label", f"policy={TINY}", "prompts.path=task:tiny-target/train", "output=out/pairs.jsonl"]
EVAL = ["--prompts", "task:tiny-target/eval", "--num-prompts", "2", "--max-new-tokens", "4", "--out", "out"]


def model(kind: str, damage: str | dict | None = None) -> dict:
    """A model dir to copy in: kind "lm" (a saved tiny causal LM) or "rm" (a saved tiny reward model);
    damage "truncate" (model.safetensors cut in half), "config" (config.json that is not JSON), or an edit of one
    file: {"file": name, "text": new content} or {"file": name, "set": {key: value}} (JSON keys replaced)."""
    return {"model": kind, "damage": damage}


# a "billion laughs": nine aliases of nine aliases ... of a string, 9^9 strings once expanded
BOMB = {"a": '["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]',
        **{n: "[" + ", ".join([f"*{p}"] * 9) + "]" for p, n in zip("abcdefgh", "bcdefghi")}}
BOMB_YAML = "".join(f"{k}: &{k} {v}\n" for k, v in BOMB.items())
BOMB_FLOW = "{" + ", ".join(f"{k}: &{k} {v}" for k, v in BOMB.items()) + "}"


@dataclass
class Case:
    id: str
    argv: list[str]
    error: list[str]
    """substrings of the one `error:` line (rc 2), or of stderr's note (rc 0)"""
    files: dict = field(default_factory=dict)
    """relative path -> text, model(...) or link(...)"""
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
    Case("ppo-judge-timeout-zero", [*PPO, "judge_timeout=0"], ["ppo.judge_timeout: must be > 0, got 0.0"]),
    Case("label-judge-timeout-inf", [*LABEL, "judge_timeout=.inf"], ["judge_timeout: must be a finite number, got inf"]),
    Case("eval-judge-timeout-negative", ["eval", TINY, *EVAL, "--judge-timeout", "-1"],
         ["judge_timeout: must be > 0, got -1.0"]),
    Case("eval-temperature-nan", ["eval", TINY, *EVAL, "--temperature", "nan"],
         ["temperature: must be a finite number, got nan"]),
    Case("eval-num-prompts-zero", ["eval", TINY, *EVAL, "--num-prompts", "0"], ["num_prompts: must be > 0, got 0"]),
    Case("eval-seed-negative", ["eval", TINY, *EVAL, "--seed", "-1"], ["seed: must be in [0, 4294967295]"]),
    # ---- `quartet run`: every stage's inputs checked before the first stage starts
    Case("run-unknown-task", ["run", "pipe.yaml", "task=nope"],
         ["pipeline.task: unknown task 'nope' (known tasks: arithmetic, constraints, positive-review, tiny-target)"],
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
    # ---- YAML: aliases bounded in files and overrides alike; error lines capped
    Case("sft-yaml-alias-bomb", ["sft", "-c", "bomb.yaml"],
         ["bomb.yaml:5: not valid YAML", "aliases expand to more than 10000 nodes"], {"bomb.yaml": BOMB_YAML},
         subprocess=True),
    Case("sft-override-alias-bomb", ["sft", f"seed={BOMB_FLOW}"],
         ["override 'seed': aliases expand to more than 10000 nodes"], subprocess=True),
    Case("run-yaml-alias-bomb", ["run", "pipe.yaml"], ["pipe.yaml:5: not valid YAML", "aliases expand"],
         {"pipe.yaml": BOMB_YAML}),
    Case("sft-yaml-recursive-alias", ["sft", "-c", "loop.yaml"], ["alias *a refers to the node it is in"],
         {"loop.yaml": "data: &a {columns: *a}\n"}),
    Case("sft-error-line-capped", ["sft", "seed=[" + "1, " * 2000 + "]"],
         ["seed: must be an integer, got [1, 1, ", "1, 1 ... [4030 more characters cut]"]),
    # ---- data reading bounded (FIFOs and devices: test_a_data_path_that_never_ends_is_refused below)
    Case("sft-max-line-mb-zero", ["sft", "data.max_line_mb=0"], ["data.max_line_mb: must be > 0, got 0"]),
    Case("sft-data-line-too-long", ["sft", f"model={TINY}", "data.path=sft.jsonl", "data.max_line_mb=0.0001",
                                    "output_dir=out"],
         ["sft.jsonl row 2: line longer than the 0.0001 MB limit (max_line_mb)"],
         {"sft.jsonl": SFT_ROWS.replace('"cd"', '"' + "c" * 500 + '"')}),
    Case("dpo-data-nested-too-deep", ["dpo", f"policy={TINY}", "data.path=pairs.jsonl", "output_dir=out"],
         ["pairs.jsonl row 3: lists and objects nested more than 64 levels deep"],
         {"pairs.jsonl": PAIRS + '{"prompt": "ab", "chosen": ' + "[" * 5000 + "]" * 5000 + ', "rejected": "x"}\n'}),
    # ---- a malformed tokenizer or config.json in a model dir: one line naming the file
    Case("sft-model-tokenizer-not-json", ["sft", "model=lm", "data.path=sft.jsonl"],
         ["lm/tokenizer.json: not readable JSON"],
         {"lm": model("lm", {"file": "tokenizer.json", "text": "{oops"}), "sft.jsonl": SFT_ROWS}, subprocess=True),
    Case("sft-model-tokenizer-wrong-shape", ["sft", "model=lm", "data.path=sft.jsonl"],
         ["lm/tokenizer.json: not a tokenizer the tokenizers library can read"],
         {"lm": model("lm", {"file": "tokenizer.json", "text": '{"model": 5}'}), "sft.jsonl": SFT_ROWS}),
    Case("eval-model-tokenizer-a-list", ["eval", "lm", *EVAL], ["lm/tokenizer.json: expected a JSON object, got list"],
         {"lm": model("lm", {"file": "tokenizer.json", "text": "[1, 2]"})}),
    Case("label-model-tokenizer-config-a-list", [*LABEL, "policy=lm"],
         ["lm/tokenizer_config.json: expected a JSON object, got list"],
         {"lm": model("lm", {"file": "tokenizer_config.json", "text": "[]"})}),
    Case("sft-model-hidden-size-text", ["sft", "model=lm", "data.path=sft.jsonl"],
         ["lm/config.json: hidden_size must be a whole number > 0, got 'big'"],
         {"lm": model("lm", {"file": "config.json", "set": {"hidden_size": "big"}}), "sft.jsonl": SFT_ROWS}),
    Case("sft-model-layers-negative", ["sft", "model=lm", "data.path=sft.jsonl"],
         ["lm/config.json: num_hidden_layers must be a whole number > 0, got -1"],
         {"lm": model("lm", {"file": "config.json", "set": {"num_hidden_layers": -1}}), "sft.jsonl": SFT_ROWS}),
    Case("dpo-model-heads-a-list", ["dpo", "policy=lm", "data.path=pairs.jsonl", "output_dir=out"],
         ["lm/config.json: num_attention_heads must be a whole number > 0, got [4]"],
         {"lm": model("lm", {"file": "config.json", "set": {"num_attention_heads": [4]}}), "pairs.jsonl": PAIRS}),
    Case("ppo-model-norm-eps-text", [*PPO, "policy=lm"], ["lm/config.json: not usable", "rms_norm_eps", "got str"],
         {"lm": model("lm", {"file": "config.json", "set": {"rms_norm_eps": "tiny"}})}),
    Case("ppo-reward-rm-tokenizer-wrong-shape", [*PPO, "reward=rm"],
         ["rm/tokenizer.json: not a tokenizer the tokenizers library can read"],
         {"rm": model("rm", {"file": "tokenizer.json", "text": "{}"})}),
    Case("run-model-layers-negative", ["run", "pipe.yaml", "sft.model=lm"],
         ["sft.model: lm/config.json: num_hidden_layers must be a whole number > 0, got -1"],
         {"pipe.yaml": PIPELINE, "sft.jsonl": SFT_ROWS,
          "lm": model("lm", {"file": "config.json", "set": {"num_hidden_layers": -1}})}),
    # ---- PPO's best_metric names a metric the run logs
    Case("ppo-best-metric-unknown", [*PPO, "best_metric=objective/scor"],
         ["ppo.best_metric: 'objective/scor' is not a metric this run logs", "objective/score, optim/"]),
    Case("ppo-best-metric-gold-without-gold", [*PPO, "best_metric=objective/gold"],
         ["ppo.best_metric: 'objective/gold' is not a metric this run logs"]),
]

# ---------------------------------------------------------------------------- where and how a stage writes
def link(target: str) -> dict:
    """A symbolic link to `target` (relative to the link's folder; it need not exist)."""
    return {"link": target}


FOLDERS = {"tb", "model", "checkpoints", "best", "critic", "wandb", "plots", "sft", "label", "rm", "ppo", "dpo", "eval"}


def users_files(stage: str, root: str = "out") -> dict:
    """A file of the user's at every path `stage` writes in `root` (quartet.outputs.WRITES; where the stage writes a
    folder, a folder of the user's holding one)."""
    return {f"{root}/{n}/mine.txt" if n in FOLDERS else f"{root}/{n}": f"the user's {n}\n" for n in WRITES[stage]}


def earlier_run(stage: str, root: str = "out") -> dict:
    """The files of an earlier run of `stage` in `root`, as a failed run over it must leave them."""
    files = {f"{root}/{MARKER}": json.dumps({"stage": stage}) + "\n", f"{root}/config.yaml": "seed: 0\n",
             f"{root}/metrics.jsonl": json.dumps({"stage": stage, "step": 1}) + "\n", f"{root}/summary.md": "# run\n"}
    if stage in ("sft", "rm", "dpo", "ppo"):
        files[f"{root}/model"] = model("rm" if stage == "rm" else "lm")
    if stage == "ppo":  # lines a fresh run over it would drop (the records after iteration 0)
        files[f"{root}/samples.jsonl"] = json.dumps({"stage": "ppo", "step": 1, "completion": "x"}) + "\n"
    return files


def failing_reward(module: str, body: str = "raise RuntimeError('boom')") -> dict:
    """A `module:score` reward (or judge) that fails on its first call; each case its own module name."""
    return {f"{module}.py": f"def score(prompts, responses):\n    {body}\n"}


SFT = ["sft", f"model={TINY}", "data.path=sft.jsonl", "output_dir=out"]
RM = ["rm", f"model={TINY}", "data.path=pairs.jsonl", "output_dir=out"]
DPO = ["dpo", f"policy={TINY}", "data.path=pairs.jsonl", "output_dir=out"]
SMALL_PPO = ["rollout_batch_size=4", "minibatch_size=4", "micro_batch_size=4", "generation.max_new_tokens=4",
             "generation.batch_size=4"]
# the loss is not finite by the last step: an error inside the run (no warmup: the stages' default warms up over 10)
DIVERGES = ["max_steps=3", "optim.lr=1e30", "optim.warmup_steps=0"]
INPUTS = {"sft": {"sft.jsonl": SFT_ROWS}, "rm": {"pairs.jsonl": PAIRS}, "dpo": {"pairs.jsonl": PAIRS}, "ppo": {},
          "eval": {}}
STAGE_ARGV = {"sft": SFT, "rm": RM, "dpo": DPO, "ppo": PPO, "eval": ["eval", TINY, *EVAL]}
LABEL_FILES = ("jsonl", "samples.jsonl", "config.yaml", "summary.md")
LABEL_RUN = {**{f"out/pairs.{s}": "{}\n" for s in LABEL_FILES},
             "out/pairs.config.yaml": "policy: x\nprompts: {path: p.jsonl}\njudge: task:tiny-target\noutput: out/pairs.jsonl\n"}
PIPELINE_RUN = {"out/.quartet-run": '{"stage": "pipeline"}\n', "out/pipeline.yaml": PIPELINE,
                **earlier_run("ppo", "out/ppo")}

OUTPUT_CASES = [
    # ---- --overwrite writes beside a user's files, never over one: a file of theirs at any path the stage writes
    #      is refused, the first named (quartet.outputs.WRITES order), and nothing is touched
    *[Case(f"{stage}-overwrite-onto-users-files", [*STAGE_ARGV[stage], "--overwrite"],
           [f"{stage}.{'out' if stage == 'eval' else 'output_dir'}: out already holds files that are not a Quartet run",
            f"out/{MARKER} is a path the {stage} stage writes", "--overwrite writes beside what a folder holds"],
           {**INPUTS[stage], **users_files(stage)}, subprocess=stage == "sft") for stage in STAGE_ARGV],
    Case("label-overwrite-onto-users-files", [*LABEL, "--overwrite"],
         ["label.output: out/pairs.jsonl exists and was not written by Quartet"],
         {f"out/pairs.{s}": "the user's\n" for s in LABEL_FILES}),
    Case("label-users-summary-beside-the-pairs", [*LABEL, "--overwrite"],
         ["label.output (its summary): out/pairs.summary.md exists and was not written by Quartet"],
         {"out/pairs.summary.md": "the user's\n"}),
    Case("run-onto-users-files", ["run", "p.yaml"],
         ["pipeline.output_dir: out already holds files that are not a Quartet run; choose a new folder"],
         {"p.yaml": PIPELINE, "sft.jsonl": SFT_ROWS, **users_files("pipeline")}),
    # ---- an output that is a symbolic link, or under /sys or /proc: one line before any work
    Case("sft-output-is-a-link", [*SFT, "output_dir=link"],
         ["sft.output_dir: link is a symbolic link (to ", "real); name that path itself"],
         {"sft.jsonl": SFT_ROWS, "real/.keep": "", "link": link("real")}, subprocess=True),
    Case("rm-output-is-a-dangling-link", [*RM, "output_dir=link"], ["rm.output_dir: link is a symbolic link"],
         {"pairs.jsonl": PAIRS, "link": link("nowhere")}),
    Case("dpo-output-is-a-link", [*DPO, "output_dir=link"], ["dpo.output_dir: link is a symbolic link"],
         {"pairs.jsonl": PAIRS, "real/.keep": "", "link": link("real")}),
    Case("ppo-output-is-a-link", [*PPO, "output_dir=link"], ["ppo.output_dir: link is a symbolic link"],
         {"real/.keep": "", "link": link("real")}),
    Case("eval-out-is-a-link", ["eval", TINY, *EVAL, "--out", "link"], ["eval.out: link is a symbolic link"],
         {"real/.keep": "", "link": link("real")}),
    Case("label-output-is-a-link", [*LABEL, "output=link.jsonl"], ["label.output: link.jsonl is a symbolic link"],
         {"real.jsonl": "{}\n", "link.jsonl": link("real.jsonl")}),
    Case("run-output-is-a-link", ["run", "p.yaml", "output_dir=link"], ["pipeline.output_dir: link is a symbolic link"],
         {"p.yaml": PIPELINE, "sft.jsonl": SFT_ROWS, "real/.keep": "", "link": link("real")}),
    Case("sft-output-under-sys", [*SFT, "output_dir=/sys/quartet-out"],
         ["sft.output_dir: cannot write /sys/quartet-out: /sys is not writable"], {"sft.jsonl": SFT_ROWS},
         subprocess=True),
    Case("rm-output-under-proc", [*RM, "output_dir=/proc/quartet-out"],
         ["rm.output_dir: cannot write /proc/quartet-out: /proc is not writable"], {"pairs.jsonl": PAIRS}),
    Case("dpo-output-in-sysfs", [*DPO, "output_dir=/sys/kernel/quartet"],
         ["dpo.output_dir: cannot write /sys/kernel/quartet: /sys/kernel is not writable"], {"pairs.jsonl": PAIRS}),
    Case("ppo-output-under-sys", [*PPO, "output_dir=/sys/quartet/run"],
         ["ppo.output_dir: cannot write /sys/quartet/run: /sys is not writable"]),
    Case("eval-out-under-proc", ["eval", TINY, *EVAL, "--out", "/proc/quartet-out"],
         ["eval.out: cannot write /proc/quartet-out: /proc is not writable"]),
    Case("label-output-under-proc", [*LABEL, "output=/proc/quartet/pairs.jsonl"],
         ["label.output: cannot write /proc/quartet/pairs.jsonl: /proc is not writable"]),
    Case("run-output-under-sys", ["run", "p.yaml", "output_dir=/sys/quartet-out"],
         ["pipeline.output_dir: cannot write /sys/quartet-out: /sys is not writable"],
         {"p.yaml": PIPELINE, "sft.jsonl": SFT_ROWS}),
    # ---- a stage that fails before its first result leaves nothing (no folder, marker, config, metrics, tb/) ...
    Case("ppo-reward-raises-on-its-first-call", [*PPO, *SMALL_PPO, "reward=hostile_first_raise:score"],
         ["reward 'hostile_first_raise:score'", "boom"], failing_reward("hostile_first_raise"), subprocess=True),
    Case("ppo-reward-returns-too-few", [*PPO, *SMALL_PPO, "reward=hostile_first_short:score"],
         ["reward 'hostile_first_short:score'"], failing_reward("hostile_first_short", "return [0.0]")),
    Case("ppo-reward-returns-nan", [*PPO, *SMALL_PPO, "reward=hostile_first_nan:score"],
         ["reward 'hostile_first_nan:score'"], failing_reward("hostile_first_nan", "return [float('nan')] * len(responses)")),
    Case("ppo-reward-returns-none", [*PPO, *SMALL_PPO, "reward=hostile_first_none:score"],
         ["reward 'hostile_first_none:score'"], failing_reward("hostile_first_none", "return None")),
    Case("label-judge-raises-on-its-first-call", [*LABEL, "judge=hostile_first_judge:score"],
         ["reward 'hostile_first_judge:score'", "boom"], failing_reward("hostile_first_judge")),
    Case("eval-judge-raises-on-its-first-call", ["eval", TINY, *EVAL, "--relevance", "hostile_first_eval:score"],
         ["reward 'hostile_first_eval:score'", "boom"], failing_reward("hostile_first_eval")),
    Case("sft-loss-not-finite", [*SFT, *DIVERGES], ["SFT loss became non-finite"], {"sft.jsonl": SFT_ROWS}),
    Case("rm-loss-not-finite", [*RM, *DIVERGES], ["reward-model loss became non-finite"], {"pairs.jsonl": PAIRS}),
    Case("dpo-loss-not-finite", [*DPO, *DIVERGES], ["DPO loss became non-finite"], {"pairs.jsonl": PAIRS}),
    Case("run-stages-empty", ["run", "p.yaml", "stages=[]"], ["pipeline.stages: names no stage"],
         {"p.yaml": PIPELINE, "sft.jsonl": SFT_ROWS}),
    Case("run-reward-raises-on-its-first-call", ["run", "p.yaml", "stages=[ppo]", "ppo.reward=hostile_first_run:score",
                                                 *[f"ppo.{o}" for o in SMALL_PPO]],
         ["reward 'hostile_first_run:score'", "boom"],
         {"p.yaml": PIPELINE, **failing_reward("hostile_first_run")}, subprocess=True),
    # ... and an earlier run it fails over (with --overwrite, or `quartet run --force`) is left exactly as it was
    *[Case(f"{stage}-fails-over-its-earlier-run", [*STAGE_ARGV[stage], *DIVERGES, "--overwrite"],
           [f"{name} loss became non-finite"], {**INPUTS[stage], **earlier_run(stage)})
      for stage, name in (("sft", "SFT"), ("rm", "reward-model"), ("dpo", "DPO"))],
    Case("ppo-fails-over-its-earlier-run", [*PPO, *SMALL_PPO, "reward=hostile_again_ppo:score", "--overwrite"],
         ["reward 'hostile_again_ppo:score'"], {**failing_reward("hostile_again_ppo"), **earlier_run("ppo")}),
    Case("eval-fails-over-its-earlier-run", ["eval", TINY, *EVAL, "--relevance", "hostile_again_eval:score",
                                             "--overwrite"],
         ["reward 'hostile_again_eval:score'"],
         {**failing_reward("hostile_again_eval"), "out/.quartet-run": '{"stage": "eval"}\n', "out/eval.json": "{}\n",
          "out/samples.jsonl": "{}\n"}),
    Case("label-fails-over-its-earlier-run", [*LABEL, "judge=hostile_again_label:score", "--overwrite"],
         ["reward 'hostile_again_label:score'"], {**failing_reward("hostile_again_label"), **LABEL_RUN}),
    Case("run-fails-over-its-earlier-run", ["run", "p.yaml", "stages=[ppo]", "--force",
                                            "ppo.reward=hostile_again_run:score", *[f"ppo.{o}" for o in SMALL_PPO]],
         ["reward 'hostile_again_run:score'"], {"p.yaml": PIPELINE, **failing_reward("hostile_again_run"),
                                                **PIPELINE_RUN}),
]
CASES += OUTPUT_CASES

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
        if isinstance(content, dict) and "link" in content:
            os.symlink(content["link"], path)
        elif isinstance(content, dict):
            shutil.copytree(template(content["model"]), path)
            if content["damage"] == "truncate":
                weights = os.path.join(path, "model.safetensors")
                data = open(weights, "rb").read()
                open(weights, "wb").write(data[: len(data) // 2])
            elif content["damage"] == "config":
                open(os.path.join(path, "config.json"), "w").write("{not json")
            elif isinstance(content["damage"], dict):
                edit = content["damage"]
                file = os.path.join(path, edit["file"])
                text = edit.get("text")
                if "set" in edit:
                    text = json.dumps({**json.load(open(file)), **edit["set"]})
                open(file, "w").write(text)
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
    shutil.copytree(root / case.id, d, symlinks=True)  # a link stays a link
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


# ---------------------------------------------------------------------------- inputs that never end
NEVER_ENDS = r'''
import contextlib, io, json, logging, os, sys
from quartet.cli import main
results = {}
for case_dir, argv in json.load(open(sys.argv[1])):
    os.chdir(case_dir)
    err = io.StringIO()
    for h in list(logging.getLogger().handlers):
        logging.getLogger().removeHandler(h)
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    results[case_dir] = [rc, err.getvalue()]
print(json.dumps(results))
'''


def test_a_data_path_that_never_ends_is_refused(tmp_path):
    """A FIFO (no writer: opening it blocks) and /dev/zero (reading never ends), named directly or through a
    symlink, are refused with one line before a byte is read, by a stage and by `quartet run`'s up-front check.
    One real process under a timeout runs every case, so a regression fails here instead of hanging the suite."""
    cases, expected = [], {}
    for kind, path in (("fifo", "pipe.jsonl"), ("dev-zero", "/dev/zero"), ("link", "zero.jsonl")):
        for argv in (["sft", f"model={TINY}", f"data.path={path}", "output_dir=out"],
                     ["run", "pipe.yaml", f"sft.data.path={path}"]):
            d = tmp_path / f"{argv[0]}-{kind}"
            d.mkdir()
            (d / "pipe.yaml").write_text(PIPELINE)
            if kind == "fifo":
                os.mkfifo(d / path)
            elif kind == "link":
                (d / path).symlink_to("/dev/zero")
            what = "a named pipe (FIFO)" if kind == "fifo" else "a character device"
            expected[str(d)] = (Case(d.name, argv, [f"{path}: is {what}, not a data file"]), _snapshot(d))
            cases.append([str(d), argv])
    d = tmp_path / "config-fifo"  # a config file read from a FIFO would wait for a writer too
    d.mkdir()
    os.mkfifo(d / "sft.yaml")
    expected[str(d)] = (Case(d.name, ["sft", "-c", "sft.yaml"], ["sft.yaml: not a regular file"]), _snapshot(d))
    cases.append([str(d), ["sft", "-c", "sft.yaml"]])
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    out = subprocess.run([sys.executable, "-c", NEVER_ENDS, str(tmp_path / "cases.json")], capture_output=True,
                         text=True, timeout=180, env=_env(), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    for d, (rc, stderr) in json.loads(out.stdout.splitlines()[-1]).items():
        case, before = expected[d]
        _check(case, rc, stderr, before, _snapshot(Path(d)))


def test_a_yaml_alias_bomb_is_refused_at_once_and_small_anchors_still_work(tmp_path):
    """The bomb is refused while it is parsed (well under a second, where expanding it took over a minute),
    with a short message; an anchor reused a few times, as a hand-written config might, still loads."""
    import time

    from quartet.config import SFTConfig, load_config, read_yaml
    from quartet.errors import ConfigError

    (tmp_path / "bomb.yaml").write_text(BOMB_YAML)
    for load in (lambda: read_yaml(tmp_path / "bomb.yaml"), lambda: load_config(SFTConfig, None, [f"seed={BOMB_FLOW}"])):
        start = time.perf_counter()
        with pytest.raises(ConfigError, match="aliases expand to more than 10000 nodes") as err:
            load()
        assert time.perf_counter() - start < 0.5 and len(str(err.value)) < 200
    (tmp_path / "sft.yaml").write_text("optim: &o {lr: 0.001, warmup_steps: 2}\ndata: {path: a.jsonl}\n"
                                       "eval_data: {<<: {path: b.jsonl}, limit: 3}\nlora: &l {enabled: false}\n")
    cfg = load_config(SFTConfig, tmp_path / "sft.yaml", ["eval_data.max_line_mb=2"])
    assert cfg.optim.lr == 0.001 and cfg.eval_data.limit == 3 and cfg.eval_data.max_line_mb == 2


def test_error_lines_are_capped_with_a_count_of_what_was_cut():
    from quartet.cli import MAX_ERROR_CHARS, capped

    assert capped("short") == "short" and capped("x" * MAX_ERROR_CHARS) == "x" * MAX_ERROR_CHARS
    assert capped("x" * (MAX_ERROR_CHARS + 7)) == "x" * MAX_ERROR_CHARS + " ... [7 more characters cut]"
