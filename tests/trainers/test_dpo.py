"""DPO: a known preference rule learnt to >= 90% held-out implicit-reward accuracy, reference log-probs
equal to a teacher-forced pass, every loss variant and LoRA train, the pipeline runs dpo in place of
rm + ppo, the CLI, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
from trainer_helpers import TINY, keyword_pairs, memorise_rows, run_cli, single_thread, write_jsonl  # noqa: F401

from quartet.cli import main
from quartet.config import DPOConfig, LoraConfig, from_dict, load_config
from quartet.data import load_preferences, split_conversation
from quartet.errors import QuartetError
from quartet.models import apply_lora, load_causal_lm, make_reference
from quartet.monitor.doctor import diagnose
from quartet.monitor.metrics import read_metrics
from quartet.trainers import loop
from quartet.trainers.dpo import _add_reference_logps, _Collate, _encode, train_dpo

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA


def make_cfg(tmp_path, n=200, **overrides) -> DPOConfig:
    data = write_jsonl(tmp_path / "pairs.jsonl", keyword_pairs(n))
    base = {
        "policy": TINY,
        "data": {"path": str(data)},
        "eval_fraction": 0.2,
        "output_dir": str(tmp_path / "dpo"),
        "epochs": 3.0,
        "batch_size": 16,
        "beta": 0.1,
        "optim": {"lr": 3e-3, "warmup_steps": 3},
        "log_every": 5,
        "eval_every": 15,
        "kl_samples": 4,
        "generation": {"max_new_tokens": 12},
    }
    for key, value in overrides.items():
        node = base
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return from_dict(DPOConfig, base)


def changed(model_dir) -> bool:
    trained, _ = load_causal_lm(str(model_dir))
    start, _ = load_causal_lm(TINY)
    return any(not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), start.state_dict().values()))


def test_dpo_learns_a_known_rule_and_writes_the_run_dir(tmp_path):
    result = train_dpo(make_cfg(tmp_path))
    first, final = result.first_eval, result.eval
    # step 0: the policy is the reference, so every implicit reward is 0 and no pair is ranked yet
    assert first.margin == pytest.approx(0.0, abs=1e-4) and first.loss == pytest.approx(math.log(2), abs=1e-4)
    assert first.accuracy < 0.8 and first.kl == pytest.approx(0.0, abs=1e-3)
    assert final.accuracy >= 0.9  # held out: the rule (`yes` beats `no`) was learnt, not the pairs
    assert final.margin > 0 and final.chosen_reward > final.rejected_reward and final.loss < 0.5 * first.loss
    assert final.kl > 0.01 and math.isfinite(final.kl)  # the policy moved away from the reference
    assert math.isfinite(result.train_loss) and result.train["rewards/accuracy"] >= 0.9
    assert changed(result.model_dir)

    run = tmp_path / "dpo"
    assert {p.name for p in run.iterdir()} >= {"config.yaml", "metrics.jsonl", "tb", "model", "summary.md"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")]
    records = read_metrics(run)
    keys = set().union(*records)
    assert {"dpo/loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy", "logps/chosen",
            "logps/rejected", "dpo/beta", "dpo/eval_loss", "rewards/eval_accuracy", "dpo/kl"} <= keys
    assert [r["step"] for r in records if "dpo/loss" in r] == list(range(5, 31, 5))
    assert [r["step"] for r in records if "rewards/eval_accuracy" in r] == [0, 15, 30]
    assert all(math.isfinite(v) for r in records for k, v in r.items() if k not in ("stage",))
    assert not [f for f in diagnose(records) if f.rule == "both_logps_down"]  # chosen log-probs went up here
    assert "implicit-reward accuracy (start -> end)" in (run / "summary.md").read_text()

    # the saved policy is what the eval and later stages load: it ranks a held-out pair by the rule
    model, tok = load_causal_lm(str(result.model_dir))
    ref, _ = load_causal_lm(TINY)
    from quartet.data.schemas import PreferenceExample

    _, held = loop.split_train_eval([PreferenceExample(**r) for r in keyword_pairs(200)], 0.2, seed=0)  # as the trainer
    wins = 0
    for row in held[:10]:
        logratio = []
        for side in ("chosen", "rejected"):
            head, rest = split_conversation(tok, row.prompt, getattr(row, side))
            prompt_ids = tok(head, add_special_tokens=False).input_ids
            lp = [sequence_logp(m, tok, prompt_ids, rest, eos=False) for m in (model, ref)]
            logratio.append(lp[0] - lp[1])
        wins += logratio[0] > logratio[1]
    assert wins >= 9


def sequence_logp(model, tok, prompt_ids, answer: str, eos: bool = True) -> float:
    """log pi(answer [+ EOS] | prompt) by hand: one forward, the log-softmax at each answer token."""
    answer_ids = tok(answer, add_special_tokens=False).input_ids + ([tok.eos_token_id] if eos else [])
    ids = torch.tensor([prompt_ids + answer_ids])
    logp = model(ids).logits.float().log_softmax(-1)[0, len(prompt_ids) - 1 : -1]
    return logp.gather(-1, torch.tensor(answer_ids)[:, None]).sum().item()


@pytest.mark.parametrize("lora", [False, True])
def test_reference_logps_are_one_teacher_forced_pass(tmp_path, lora):
    """The precomputed log-probs equal a hand-written forward of the reference; with LoRA the reference is
    the adapter-disabled base even after the adapter has changed."""
    write_jsonl(tmp_path / "p.jsonl", keyword_pairs(6))
    cfg = make_cfg(tmp_path, n=6, **{"data.chat_template": False})
    examples = load_preferences(cfg.data)
    model, tok = load_causal_lm(TINY)
    base = load_causal_lm(TINY)[0]
    reference = None
    if lora:
        model = apply_lora(model, LoraConfig(enabled=True, r=4))
        reference = make_reference(model)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_()  # the adapted policy now differs from its base
    pairs = _encode(tok, examples, 512, False, "p.jsonl")
    _add_reference_logps(pairs, reference, model, _Collate(tok.pad_token_id), 4, loop.make_accelerator("fp32", 1))
    for ex, pair in zip(examples, pairs):
        prompt_ids = tok(ex.prompt, add_special_tokens=False).input_ids
        assert pair.ref_chosen == pytest.approx(sequence_logp(base, tok, prompt_ids, ex.chosen), rel=1e-4)
        assert pair.ref_rejected == pytest.approx(sequence_logp(base, tok, prompt_ids, ex.rejected), rel=1e-4)


@pytest.mark.parametrize("variant", [
    {"loss": "ipo"},
    {"loss": "hinge"},
    {"loss": "simpo", "beta": 2.0, "simpo_gamma": 1.0},
    {"loss": "sigmoid", "label_smoothing": 0.1},
])
def test_every_loss_variant_trains(tmp_path, variant):
    result = train_dpo(make_cfg(tmp_path, n=40, max_steps=4, kl_samples=0, **variant))
    assert math.isfinite(result.train_loss) and result.eval.kl is None  # kl off: not measured, not logged
    assert result.eval.margin > result.first_eval.margin
    assert changed(result.model_dir)


def test_lora_policy_uses_the_adapter_disabled_reference(tmp_path):
    result = train_dpo(make_cfg(tmp_path, n=40, max_steps=4, kl_samples=2, **{"lora.enabled": True, "lora.r": 4,
                                                                               "optim.lr": 1e-2}))
    assert result.first_eval.kl == pytest.approx(0.0, abs=1e-3) and result.eval.kl > result.first_eval.kl
    assert (result.model_dir / "model.safetensors").is_file() and (result.model_dir / "adapter").is_dir()
    summary = (tmp_path / "dpo" / "summary.md").read_text()
    assert "LoRA r=4" in summary and "the adapter-disabled policy" in summary


def test_pipeline_runs_dpo_in_place_of_rm_and_ppo(tmp_path):
    """`stages: [sft, label, dpo, eval]` on tiny models: DPO reads the label stage's pairs, starts from the SFT
    model, and the eval compares it with SFT the way it compares PPO."""
    from quartet.pipeline import load_pipeline, run_pipeline

    sft = write_jsonl(tmp_path / "demo.jsonl", memorise_rows())
    out = tmp_path / "run"
    (tmp_path / "pipe.yaml").write_text(json.dumps({
        "output_dir": str(out), "task": "tiny-target", "stages": ["sft", "label", "dpo", "eval"],
        "tracking": {"report_to": "none"},
        "sft": {"model": TINY, "data": {"path": str(sft), "chat_template": False}, "eval_fraction": 0.25,
                "max_steps": 2, "batch_size": 4, "precision": "fp32"},
        "label": {"num_samples": 4, "prompts": {"limit": 24}, "min_gap": 0.0,
                  "generation": {"max_new_tokens": 8, "batch_size": 32}},
        "dpo": {"max_steps": 3, "batch_size": 4, "log_every": 1, "precision": "fp32", "eval_fraction": 0.25,
                "kl_samples": 2, "generation": {"max_new_tokens": 8}, "optim": {"lr": 1e-3}},
        "eval": {"num_prompts": 4, "max_new_tokens": 8, "batch_size": 4},
    }))
    cfg = load_pipeline(str(tmp_path / "pipe.yaml"))
    assert cfg.dpo.policy == str(out / "sft" / "model") and cfg.dpo.data.path == cfg.label.output
    times = run_pipeline(cfg)
    assert list(times) == ["sft", "label", "dpo", "eval"] and not (out / "rm").exists() and not (out / "ppo").exists()
    dpo_config = (out / "dpo" / "config.yaml").read_text()
    assert f"policy: {out / 'sft' / 'model'}" in dpo_config and str(out / "label" / "preferences.jsonl") in dpo_config
    assert read_metrics(out / "dpo")[-1]["step"] == 3
    result = json.loads((out / "eval" / "eval.json").read_text())
    assert list(result["checkpoints"]) == [str(out / "sft" / "model"), str(out / "dpo" / "model")]
    assert result["checkpoints"][str(out / "dpo" / "model")]["kl_full"]["mean"] > 0  # measured against SFT
    summary = (out / "summary.md").read_text()
    assert "| SFT (baseline) |" in summary and "| DPO |" in summary and "PPO" not in summary
    assert "DPO loss and implicit-reward accuracy" in (out / "report.html").read_text()


def test_cli_dpo_end_to_end_and_bad_file(tmp_path, capsys):
    data = write_jsonl(tmp_path / "pairs.jsonl", keyword_pairs(24))
    (tmp_path / "tiny.yaml").write_text(f"policy: '{TINY}'\ndata:\n  path: {data}\nmax_steps: 2\nbatch_size: 4\n"
                                        "kl_samples: 2\ngeneration: {max_new_tokens: 8}\n")
    out = run_cli("dpo", "-c", tmp_path / "tiny.yaml", f"output_dir={tmp_path / 'run'}", "beta=0.2")
    assert out.returncode == 0, out.stderr
    assert "# DPO:" in out.stdout and "beta 0.2" in out.stdout
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()

    # bad input through the same entry point, in this process (a second interpreter costs ~10 s)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "chosen": "a"}])
    code = main(["dpo", "-c", str(tmp_path / "tiny.yaml"), f"data.path={bad}", f"output_dir={tmp_path / 'bad'}"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err
    assert "bad.jsonl row 1: missing field 'rejected'" in lines[0]
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(("override", "message"), [
    (["loss=ipo", "label_smoothing=0.1"], "dpo.label_smoothing: applies to loss sigmoid or simpo, not 'ipo'"),
    (["loss=kto"], "loss: must be one of 'sigmoid', 'ipo', 'hinge', 'simpo', got 'kto'"),
    (["beta=0"], "dpo.beta: must be > 0, got 0.0"),
    (["label_smoothing=0.5"], "dpo.label_smoothing: must be in [0, 0.5), got 0.5"),
    (["betta=0.1"], "betta: unknown key (did you mean 'beta'?)"),
])
def test_bad_config_is_one_line_error(override, message):
    with pytest.raises(QuartetError) as e:
        load_config(DPOConfig, None, override)
    assert str(e.value) == message


def test_prompts_that_fill_max_seq_len_are_an_error_before_any_output(tmp_path):
    with pytest.raises(QuartetError, match=r"pairs.jsonl: every one of the 160 prompts fills max_seq_len=2"):
        train_dpo(make_cfg(tmp_path, max_seq_len=2))
    assert not (tmp_path / "dpo").exists()


def test_a_users_folder_is_refused_before_any_work(tmp_path, monkeypatch):
    import quartet.trainers.dpo as dpo

    (tmp_path / "dpo").mkdir()
    (tmp_path / "dpo" / "notes.txt").write_text("mine")
    monkeypatch.setattr(dpo, "load_causal_lm", lambda *a, **k: pytest.fail("loaded a model for a refused output"))
    with pytest.raises(QuartetError, match=r"dpo.output_dir: .* already holds files that are not a Quartet run"):
        train_dpo(make_cfg(tmp_path))
    assert [p.name for p in (tmp_path / "dpo").iterdir()] == ["notes.txt"]


def test_reference_runs_once_per_batch_of_pairs_then_only_for_the_kl_probe(tmp_path, monkeypatch):
    """Precomputation: one reference forward per batch of the 20 pairs, then one per held-out pass (the KL
    probe), never in the training loop; with kl_samples 0 and no named reference no reference exists at all."""
    from quartet.models.reference import Reference

    calls = []
    original = Reference.logits
    monkeypatch.setattr(Reference, "logits", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    cfg = make_cfg(tmp_path, n=20, max_steps=4, batch_size=4, eval_every=2, kl_samples=2, reference=TINY)
    train_dpo(cfg)
    assert len(calls) == 20 // 4 + 3  # 5 batches of pairs + held-out passes at steps 0, 2 and 4

    import quartet.trainers.dpo as dpo

    monkeypatch.setattr(dpo, "make_reference", lambda *a, **k: pytest.fail("a reference model was built"))
    result = train_dpo(make_cfg(tmp_path, n=20, max_steps=2, batch_size=4, kl_samples=0,
                                output_dir=str(tmp_path / "no-ref")))
    assert result.first_eval.margin == pytest.approx(0.0, abs=1e-4) and result.eval.margin != 0.0
