"""Stage 3 (rm): Bradley-Terry by hand, a known rule learnt to >= 90% held out, normalisation that
holds when the saved model is reloaded, run dir + calibration, CLI, bad input."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
from trainer_helpers import (  # noqa: F401
    TINY,
    WORDS,
    assert_one_line_error,
    keyword_pairs,
    run_cli,
    single_thread,
    write_jsonl,
)

from quartet.config import DataConfig, RewardConfig, from_dict, load_config
from quartet.data import load_samples, render_conversation
from quartet.errors import QuartetError
from quartet.eval.calibration import T_RANGE, fit_temperature
from quartet.models import load_reward_model
from quartet.pipeline import load_pipeline
from quartet.trainers.loop import split_train_eval
from quartet.trainers.reward import _Collate, _sample, _scores, _spread, bradley_terry_loss, train_reward

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA


def test_bradley_terry_by_hand():
    rc, rr = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0])
    # -log sigmoid(1) = log(1 + e^-1); -log sigmoid(0) = log 2
    expected = (math.log1p(math.exp(-1.0)) + math.log(2.0)) / 2
    assert bradley_terry_loss(rc, rr).item() == pytest.approx(expected)
    # margin 1 on the first pair: -log sigmoid(1 - 1) = log 2
    assert bradley_terry_loss(rc, rr, margin=torch.tensor([1.0, 0.0])).item() == pytest.approx(math.log(2.0))
    # centering adds coef * mean((r_c + r_r)^2) = 0.1 * (1 + 0) / 2
    assert bradley_terry_loss(rc, rr, center_coef=0.1).item() == pytest.approx(expected + 0.05)


@pytest.mark.parametrize("backbone", ["causal", "encoder"])
def test_scores_over_length_sorted_chunks_equal_one_forward_and_its_gradient(backbone, tiny_bert_dir):
    """Chunks of 2 rows cut to their longest: the scores and the gradient of one forward over the padded batch."""
    rm = load_reward_model(tiny_bert_dir if backbone == "encoder" else TINY)
    torch.manual_seed(0)
    rows = [([5 + i] * (3 + 4 * i % 11), [7] * (2 + i % 3), 0.0) for i in range(5)]  # 10 sequences, 2..13 tokens
    batch = _Collate(rm.tokenizer.pad_token_id)(rows)

    def run(chunk_rows):
        rm.zero_grad()
        c, r = _scores(rm, batch, chunk_rows)
        bradley_terry_loss(c, r).backward()
        return c.detach(), r.detach(), {n: p.grad.clone() for n, p in rm.named_parameters() if p.grad is not None}

    whole, chunked = run(len(rows) * 2), run(2)
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked[1], whole[1], rtol=1e-5, atol=1e-6)
    assert chunked[2].keys() == whole[2].keys() and len(whole[2]) > 2
    for name, g in whole[2].items():
        torch.testing.assert_close(chunked[2][name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("backbone", ["causal", "encoder"])
def test_a_sequence_met_in_several_pairs_is_scored_once_with_the_gradient_of_every_row(backbone, tiny_bert_dir):
    """One prompt's K = 4 answers in all 6 pairs: 12 rows, 4 distinct, 4 rows forwarded; scores and the gradient
    equal one forward over all 12 rows."""
    rm = load_reward_model(tiny_bert_dir if backbone == "encoder" else TINY)
    answers = [[5, 6] + [9] * i for i in range(1, 5)]  # 3..6 tokens, one prompt's answers
    rows = [(answers[i], answers[j], 0.0) for i in range(4) for j in range(i + 1, 4)]
    batch = _Collate(rm.tokenizer.pad_token_id)(rows)
    forwarded = []
    hook = rm.register_forward_hook(lambda module, args, out: forwarded.append(args[0].shape[0]))
    rm.zero_grad()
    c, r = _scores(rm, batch)
    bradley_terry_loss(c, r).backward()
    hook.remove()
    grads = {n: p.grad.clone() for n, p in rm.named_parameters() if p.grad is not None}
    assert sum(forwarded) == 4

    rm.zero_grad()
    every = rm(batch["input_ids"], batch["attention_mask"])
    bradley_terry_loss(every[:6], every[6:]).backward()
    torch.testing.assert_close(c.detach(), every[:6].detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r.detach(), every[6:].detach(), rtol=1e-5, atol=1e-6)
    assert len(grads) > 2
    for name, p in rm.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def make_cfg(tmp_path, n=200, **overrides) -> RewardConfig:
    data = write_jsonl(tmp_path / "pairs.jsonl", keyword_pairs(n))
    base = {
        "model": TINY,
        "data": {"path": str(data)},
        "eval_fraction": 0.2,
        "output_dir": str(tmp_path / "rm"),
        "epochs": 3.0,
        "batch_size": 16,
        "optim": {"lr": 3e-3, "warmup_steps": 3},
        "log_every": 5,
        "eval_every": 15,
    }
    for key, value in overrides.items():
        node = base
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return from_dict(RewardConfig, base)


def test_rm_learns_a_known_rule_and_writes_the_run_dir(tmp_path):
    result = train_reward(make_cfg(tmp_path))
    assert result.eval.accuracy >= 0.9
    assert result.first_eval.accuracy < 0.8  # it was learnt, not there from the start
    assert result.eval.chosen_mean > result.eval.rejected_mean and result.eval.margin > 0
    run = tmp_path / "rm"
    assert {p.name for p in run.iterdir()} >= {"config.yaml", "metrics.jsonl", "tb", "model", "summary.md",
                                              "calibration.json"}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keys = set().union(*records)
    assert {"rm/loss", "rm/accuracy", "rm/margin", "rm/eval_accuracy", "rm/eval_margin"} <= keys
    calibration = json.loads((run / "calibration.json").read_text(),  # strict JSON: no NaN or Infinity
                             parse_constant=lambda c: pytest.fail(f"calibration.json holds {c}"))
    held = calibration["eval"]
    assert sum(b["count"] for b in held["calibration"]) == 40
    # the temperature: fitted on the held-out margins, checked half against half (each half's margins over the
    # other's T) and saved with the model. T scales with the margins (fit_temperature(d / c) = T / c), and the
    # trainer's margins come from its bf16 autocast where the CPU has bf16 (8-bit mantissa: <= 2^-8 relative per
    # value) while the reload scores in fp32, so T agrees to 1e-2 there and to batching's ~1e-6 in fp32
    margins = torch.tensor(_held_out_margins(result))
    assert held["temperature"] == pytest.approx(fit_temperature(margins), rel=1e-2)
    assert T_RANGE[0] < held["temperature"] < T_RANGE[1]  # all 40 ordered right: Laplace keeps T finite
    assert len(held["fold_temperatures"]) == 2 and sum(b["count"] for b in held["calibration_scaled"]) == 40
    assert math.isfinite(held["nll_scaled"]) and held["nll"] > 0
    summary = (run / "summary.md").read_text()
    assert "calibration" in summary and "normalize_policy is not set" in summary
    assert "calibration with the temperature" in summary and "Bradley-Terry temperature T" in summary

    # normalised on the training responses: reloaded, they score mean 0, std 1 (unbiased std, as torch)
    rm = load_reward_model(str(result.model_dir))
    assert rm.temperature == pytest.approx(held["temperature"])
    from quartet.data.schemas import PreferenceExample

    train, _ = split_train_eval([PreferenceExample(**r) for r in keyword_pairs(200)], 0.2, seed=0)  # as the trainer
    texts = [render_conversation(rm.tokenizer, r.prompt, getattr(r, side)) for side in ("chosen", "rejected")
             for r in train]
    scores = rm.score_texts(texts)
    assert statistics.fmean(scores) == pytest.approx(0.0, abs=1e-3)
    assert statistics.stdev(scores) == pytest.approx(1.0, abs=1e-2)


def _held_out_margins(result) -> list[float]:
    """The saved model's raw margins on the held-out pairs of make_cfg's data, split as the trainer splits."""
    from quartet.data.schemas import PreferenceExample

    rm = load_reward_model(str(result.model_dir))
    _, held = split_train_eval([PreferenceExample(**r) for r in keyword_pairs(200)], 0.2, seed=0)
    raw = {side: torch.tensor(rm.score_texts([render_conversation(rm.tokenizer, r.prompt, getattr(r, side))
                                              for r in held])) * rm.std + rm.mean for side in ("chosen", "rejected")}
    return (raw["chosen"] - raw["rejected"]).tolist()


def test_normalize_policy_gives_policy_answers_mean_0_std_1(tmp_path):
    prompts = [f"say something about {w}" for w in WORDS[:12]]
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in prompts])
    cfg = make_cfg(tmp_path, n=40, epochs=1.0, normalize_policy=TINY + "&seed=3", normalize_samples=24,
                   normalize_prompts={"path": str(tmp_path / "prompts.jsonl")},
                   **{"normalize_generation.max_new_tokens": 10, "normalize_generation.batch_size": 24})
    result = train_reward(cfg)
    assert result.normalized_on.startswith("24 answers of")
    # the same answers (same seed; 12 prompts cycled to 24), scored the way PPO scores them: as text
    prompts = prompts * 2
    responses = _sample(cfg, prompts)
    rm = load_reward_model(str(result.model_dir))
    scores = rm.score_texts([render_conversation(rm.tokenizer, p, r) for p, r in zip(prompts, responses)])
    assert statistics.fmean(scores) == pytest.approx(0.0, abs=1e-3)
    assert statistics.stdev(scores) == pytest.approx(1.0, abs=1e-2)


def test_normalize_responses_normalises_on_answers_already_sampled(tmp_path):
    """The label stage's answers file instead of a new round of sampling: normalize_samples answers spread over the
    prompts (empty answers count: the policy gave them), and those score mean 0, std 1."""
    rows = [{"prompt": f"say something about {w}", "completion": f"{w} {'is good' if k % 2 else ''}".strip(),
             "score": 0.0, "sample": k} for w in WORDS[:8] for k in range(3)]
    rows[1]["completion"] = ""
    answers = write_jsonl(tmp_path / "answers.jsonl", rows)
    cfg = make_cfg(tmp_path, n=40, epochs=1.0, normalize_policy="no/such/policy", normalize_responses=str(answers),
                   normalize_samples=12)
    result = train_reward(cfg)  # the policy is not loaded: its answers are given
    assert result.normalized_on == f"12 answers from {answers}"
    used = _spread(load_samples(DataConfig(path=str(answers))), 12)
    assert [(a.prompt, a.completion) for a in used] == [(r["prompt"], r["completion"]) for r in rows[0::3] + rows[1:12:3]]
    rm = load_reward_model(str(result.model_dir))
    scores = rm.score_texts([render_conversation(rm.tokenizer, a.prompt, a.completion) for a in used])
    assert statistics.fmean(scores) == pytest.approx(0.0, abs=1e-3)
    assert statistics.stdev(scores) == pytest.approx(1.0, abs=1e-2)

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "completion": 3}])
    with pytest.raises(QuartetError, match=r"bad.jsonl.*row 1.*field 'completion' must be text, got a number"):
        train_reward(make_cfg(tmp_path, normalize_responses=str(bad), output_dir=str(tmp_path / "rm2")))
    assert not (tmp_path / "rm2").exists()


def test_the_pipeline_normalises_on_the_label_stages_answers_when_they_are_draws_of_the_same_sampling(tmp_path):
    (tmp_path / "pipe.yaml").write_text(json.dumps({"output_dir": str(tmp_path / "run"), "task": "tiny-target"}))
    cfg = load_pipeline(str(tmp_path / "pipe.yaml"))
    assert cfg.rm.normalize_responses == str(tmp_path / "run" / "label" / "preferences.samples.jsonl")
    for override in ["label.generation.temperature=0.7", "rm.normalize_generation.max_new_tokens=16",
                     "rm.normalize_prompts.path=task:tiny-target/eval", "rm.normalize_policy=other", "stages=[sft, rm, ppo]"]:
        assert load_pipeline(str(tmp_path / "pipe.yaml"), [override]).rm.normalize_responses is None, override
    # a label output of an earlier version (no answers file) is reused as it is: the normalisation samples anew
    (tmp_path / "run" / "label").mkdir(parents=True)
    (tmp_path / "run" / "label" / "preferences.jsonl").write_text("")
    assert load_pipeline(str(tmp_path / "pipe.yaml")).rm.normalize_responses is None


def test_margin_and_centering_options_train(tmp_path):
    rows = [dict(r, margin=1.0) for r in keyword_pairs(48)]
    write_jsonl(tmp_path / "m.jsonl", rows)
    cfg = make_cfg(tmp_path, margin=True, center_coef=0.01, max_steps=4, **{"data.path": str(tmp_path / "m.jsonl")})
    result = train_reward(cfg)
    assert math.isfinite(result.train_loss)
    assert "- margin + 0.01 centering" in (tmp_path / "rm" / "summary.md").read_text()


def test_margin_without_column_is_an_error_before_any_output(tmp_path):
    with pytest.raises(QuartetError, match="`margin: true` but 160 of 160 pairs have no 'margin'"):
        train_reward(make_cfg(tmp_path, margin=True))
    assert not (tmp_path / "rm").exists()


def test_lora_on_a_causal_backbone_trains_the_head(tmp_path):
    result = train_reward(make_cfg(tmp_path, n=40, max_steps=3, **{"lora.enabled": True, "lora.r": 4}))
    assert (result.model_dir / "model.safetensors").is_file()
    assert "LoRA r=4" in (tmp_path / "rm" / "summary.md").read_text()


def test_cli_rm_end_to_end_and_bad_file(tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", keyword_pairs(24))
    (tmp_path / "tiny.yaml").write_text(f"model: '{TINY}'\ndata:\n  path: {data}\nmax_steps: 2\nbatch_size: 4\n")
    out = run_cli("rm", "-c", tmp_path / "tiny.yaml", f"output_dir={tmp_path / 'run'}")
    assert out.returncode == 0, out.stderr
    assert "# reward model:" in out.stdout and "calibration" in out.stdout
    assert (tmp_path / "run" / "model" / "quartet_reward.json").is_file()

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "chosen": "same", "rejected": "same"}])
    out = run_cli("rm", "-c", tmp_path / "tiny.yaml", f"data.path={bad}", f"output_dir={tmp_path / 'bad'}")
    assert_one_line_error(out, "bad.jsonl row 1", "identical")
    assert not (tmp_path / "bad").exists()


def test_unknown_key_suggests(tmp_path):
    with pytest.raises(QuartetError, match="center_coeff: unknown key \\(did you mean 'center_coef'"):
        load_config(RewardConfig, None, ["center_coeff=0.1"])


def test_held_out_split_keeps_all_pairs_of_a_prompt_on_one_side():
    from quartet.data.schemas import PreferenceExample

    pairs = [PreferenceExample(prompt=f"prompt {p}", chosen=f"good {k}", rejected=f"bad {k}")
             for p in range(20) for k in range(6)]  # 6 pairs per prompt, as all-pairs of K=4 answers gives
    train, held = split_train_eval(pairs, 0.2, seed=0)
    assert len(train) + len(held) == len(pairs) and len(held) == 24
    assert not {ex.prompt for ex in train} & {ex.prompt for ex in held}
    assert split_train_eval(pairs, 0.2, seed=0) == (train, held)  # seeded
    # one prompt only: nothing to group by, split by rows
    single = [PreferenceExample(prompt="same", chosen=f"good {k}", rejected=f"bad {k}") for k in range(10)]
    train, held = split_train_eval(single, 0.2, seed=0)
    assert len(held) == 2 and len(train) == 8
    # unique prompts: the same split as by rows
    unique = [PreferenceExample(prompt=f"p{k}", chosen="a", rejected="b") for k in range(50)]
    by_rows = split_train_eval(list(range(50)), 0.2, seed=0)[1]
    assert [ex.prompt for ex in split_train_eval(unique, 0.2, seed=0)[1]] == [f"p{i}" for i in by_rows]
