"""The vLLM engine against the real vLLM: run inside .venv-vllm by test_vllm_engine.py (not collected by the main
suite: the file name does not start with test_). One engine serves every test here, since starting one takes
~30 s and the first call at each new batch shape another 10-30 s on CPU.

The model is a tiny random Llama whose output layer is scaled up so that its next-token distributions are far
from uniform (a uniform one would hide a sampler that ignores the logits). The engine runs in the dtype a user's
run gets on this machine (`precision: auto`): bf16 where the CPU multiplies it natively, fp32 on an AVX2-only CPU,
where emulated bf16 made this suite take 4 minutes (2026-11-27). The weights are rounded to that dtype first, so
the trainer's fp32 forward and the engine see the same numbers.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from builders import tiny_ppo
from quartet.config import GenerationConfig, LoraConfig, from_dict
from quartet.models import apply_lora, load_causal_lm
from quartet.models.precision import generation_dtype
from quartet.rollout.engine import HFEngine, make_engine
from quartet.rollout.weights import merged_state_dict
from quartet.trainers.ppo_roles import actor_logprobs

vllm_engine = pytest.importorskip("quartet.rollout.vllm_engine")

TINY = "tiny:llama?hidden=128&layers=2&heads=2&vocab=300&seed=5"
PROMPT = [40, 41, 42, 43, 44]
N = 3000  # one-token samples per chi-square test
REPORT = os.environ.get("QUARTET_VLLM_REPORT")  # numbers for the launching test to print
DTYPE = generation_dtype("auto")  # the engine's dtype in a user's run here: bf16 with native bf16, else fp32


def report(**numbers):
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps(numbers) + "\n")


def exact_in_engine_dtype(model):
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)  # logits spread over several nats
        for p in model.parameters():
            p.copy_(p.to(DTYPE).float())
    return model


@pytest.fixture(scope="module")
def setup():
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: plenty for these tiny requests
    model, tok = load_causal_lm(TINY)
    model = exact_in_engine_dtype(model)
    cfg = GenerationConfig(max_new_tokens=1, temperature=1.0, top_p=1.0, top_k=0, engine="vllm")
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    engine = make_engine(model, tok, cfg, DTYPE)  # the registry path PPO, label and rm take
    assert torch.equal(torch.rand(3), expected)  # starting vLLM left the trainer's random state alone
    assert isinstance(engine, vllm_engine.VLLMEngine)
    return model, tok, cfg, engine


def next_token_probs(model, prompt=PROMPT, temperature=1.0):
    with torch.no_grad():
        return (model(input_ids=torch.tensor([prompt])).logits[0, -1].double() / temperature).softmax(-1)


def one_token_counts(engine, seed, prompt=PROMPT):
    ids = torch.tensor([prompt])
    engine.cfg.max_new_tokens = 1
    ro = engine.generate(ids, torch.ones_like(ids), seed=seed, num_samples=N)
    assert ro.response_ids.shape == (N, 1)
    return torch.bincount(ro.response_ids[:, 0], minlength=300).double(), ro


def chi_square_p(counts, probs):
    """Pearson's chi-square goodness of fit, cells with expected count < 5 pooled into one; p-value."""
    n = counts.sum()
    expected = probs[: counts.numel()] * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    stat = ((obs - exp) ** 2 / exp.clamp(min=1e-12)).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2)), int(big.sum())


def test_one_token_samples_follow_the_trainers_softmax(setup):
    model, tok, cfg, engine = setup
    probs = next_token_probs(model)
    assert probs.max() > 0.05 and (probs > 1e-3).sum() > 20  # peaked but many plausible tokens
    counts, ro = one_token_counts(engine, seed=0)
    p, cells = chi_square_p(counts, probs)
    report(test="bandit", chi_square_p=p, cells=cells, samples=N, distinct=int((counts > 0).sum()))
    assert p > 1e-3, f"vLLM's samples do not follow the softmax (p={p:.2g})"
    # the test has the power to see a wrong sampler: temperature 0.8 or a top-50 cut fail it
    assert chi_square_p(counts, next_token_probs(model, temperature=0.8))[0] < 1e-6
    top50 = probs.clone()
    top50[probs.argsort(descending=True)[50:]] = 0
    assert chi_square_p(counts, top50 / top50.sum())[0] < 1e-6
    # the engine's log-prob of each sampled token is the trainer's, up to bf16 arithmetic (fp32's is far smaller)
    lp = probs.log()[ro.response_ids[:, 0]].float()
    assert (ro.engine_logprobs[:, 0] - lp).abs().max() < 0.05


def test_samples_are_seeded_per_sample(setup):
    model, tok, cfg, engine = setup
    engine.cfg.max_new_tokens = 8
    ids = torch.tensor([[0, 0, 40, 41, 42], [50, 51, 52, 53, 54]])  # left-padded with pad id 0
    mask = (ids != 0).long()
    a = engine.generate(ids, mask, seed=3, num_samples=3)
    b = engine.generate(ids, mask, seed=3, num_samples=3)
    c = engine.generate(ids, mask, seed=4, num_samples=3)
    assert torch.equal(a.response_ids, b.response_ids)
    assert not torch.equal(a.response_ids, c.response_ids)
    # the second prompt alone, told its samples are global samples 3..5, draws the same responses
    alone = engine.generate(ids[1:], mask[1:], seed=3, num_samples=3, sample_offset=3)
    assert torch.equal(alone.response_ids, a.response_ids[3:, : alone.response_ids.shape[1]])
    assert torch.equal(a.prompt_ids, ids.repeat_interleave(3, 0))


def test_eos_ends_a_response_and_max_new_tokens_caps_it(setup):
    model, tok, cfg, engine = setup
    eos = tok.eos_token_id
    big = copy.deepcopy(model)
    with torch.no_grad():
        big.lm_head.weight[eos] = big.lm_head.weight[eos] + 0.15 * big.model.norm.weight.sign()
    engine.sync(big)
    engine.cfg.max_new_tokens = 12
    ids = torch.tensor([PROMPT] * 64)
    ro = engine.generate(ids, torch.ones_like(ids), seed=0)
    lengths = ro.response_mask.sum(1).long()
    assert ro.response_ids.shape[1] <= 12 and lengths.max() <= 12
    assert 0 < ro.eos.sum() < 64  # some end with EOS, some are cut
    for row, n, ended in zip(ro.response_ids, lengths, ro.eos):
        assert (row[: n - 1] != eos).all()  # no EOS before the last real token
        assert (row[n - 1] == eos) == bool(ended)
        assert (row[n:] == tok.pad_token_id).all()
        if not ended:
            assert n == 12
    assert (ro.engine_logprobs[ro.response_mask == 0] == 0).all()
    engine.sync(model)


def test_sync_moves_the_sampled_distribution_lora_merged(setup):
    model, tok, cfg, engine = setup
    torch.manual_seed(0)  # peft draws lora_A from the global generator
    actor = apply_lora(copy.deepcopy(model), LoraConfig(enabled=True, r=4, alpha=8))
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    # a prompt of 300 tokens: vLLM's prefix cache (blocks of 128 here) keeps its keys and values between calls
    prompt = torch.randint(4, 300, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    merged = copy.deepcopy(model)  # what the engine receives: the LoRA-merged weights in its dtype
    merged.load_state_dict({k: v.to(DTYPE).float() for k, v in merged_state_dict(actor).items()})
    before = next_token_probs(model, prompt)
    after = next_token_probs(merged, prompt)
    assert 0.5 * (after - before).abs().sum() > 0.2  # the update changed the policy a lot
    assert chi_square_p(one_token_counts(engine, seed=1, prompt=prompt)[0], before)[0] > 1e-3  # cached now
    engine.sync(actor)
    counts, _ = one_token_counts(engine, seed=1, prompt=prompt)
    p_new, _ = chi_square_p(counts, after)
    p_old, _ = chi_square_p(counts, before)
    report(test="sync", chi_square_p_new=p_new, chi_square_p_old=p_old, sync_s=engine.last_sync_s,
           total_variation=float(0.5 * (after - before).abs().sum()))
    assert p_new > 1e-3, f"after sync the samples do not follow the new policy (p={p_new:.2g})"
    assert p_old < 1e-6, "after sync the samples still follow the old policy"
    engine.sync(model)  # and back: the old distribution again
    counts, _ = one_token_counts(engine, seed=2, prompt=prompt)
    assert chi_square_p(counts, before)[0] > 1e-3


def test_engine_logprobs_and_greedy_agree_with_hf(setup):
    model, tok, cfg, engine = setup
    engine.cfg.max_new_tokens = 16
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(4, 300, (n,), generator=g).tolist() for n in (3, 7, 5, 9)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = (torch.arange(width) >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
    ro = engine.generate(ids, mask, seed=5, num_samples=4)
    with torch.no_grad():
        old, _, _ = actor_logprobs(model, ro, 1.0)
    m = ro.response_mask
    diff = ((old - ro.engine_logprobs).abs() * m)
    mean_diff = float(diff.sum() / m.sum())
    hf = HFEngine(model, tok, GenerationConfig(max_new_tokens=16, batch_size=16), dtype=DTYPE)
    g_hf = hf.generate(ids, mask, greedy=True)
    g_vllm = engine.generate(ids, mask, greedy=True)
    same = float((g_hf.response_ids == g_vllm.response_ids[:, : g_hf.response_ids.shape[1]]).float().mean()) \
        if g_hf.response_ids.shape == g_vllm.response_ids.shape else 0.0
    report(test="agreement", logprob_diff_mean=mean_diff, logprob_diff_max=float(diff.max()),
           greedy_token_agreement=same, tokens=int(m.sum()))
    assert mean_diff < 0.02 and diff.max() < 0.3
    assert same >= 0.9


def test_ppo_with_the_vllm_engine_logs_the_gap_and_corrects_it(setup, tmp_path, monkeypatch):
    """PPO on tiny-target with generation.engine: vllm and tis_cap: the engine is synced before every rollout,
    rollout/logprob_diff_* and the TIS weights are logged, and the actor trains. The trainer is handed the
    suite's engine (same architecture; its weights are replaced by the actor's at the first sync), since a
    second vLLM engine in one process would cost another start."""
    import math

    from quartet.trainers import ppo

    model, tok, cfg, engine = setup
    handed = []

    def shared_engine(actor, tokenizer, gen_cfg, dtype, share_weights=False, record_logprobs=False):
        assert gen_cfg.engine == "vllm"
        engine.cfg = gen_cfg
        handed.append(gen_cfg)
        return engine

    monkeypatch.setattr(ppo, "make_engine", shared_engine)
    pcfg = tiny_ppo(tmp_path, policy=TINY, micro_batch_size=8, tis_cap=2.0,
                    **{"optim.adam_eps": 1e-5, "generation.engine": "vllm"})
    trainer = ppo.PPOTrainer(pcfg, progress=False)
    before = {n: p.detach().clone() for n, p in trainer.roles.actor.named_parameters()}
    result = trainer.train()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    try:
        assert handed and len(records) == 3
        for r in records:
            assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))
            # the engine samples from the weights being trained: gaps of its dtype's rounding (bf16 ~1e-3, fp32
            # ~1e-7: other kernels round differently, never all alike), TIS weights near 1
            assert 0 < r["rollout/logprob_diff_mean"] < 0.05, r["rollout/logprob_diff_mean"]
            assert r["rollout/logprob_diff_max"] < 1.0
            assert 0.9 < r["policy/tis_weight"] < 1.1 and 0 <= r["policy/tis_capped"] < 0.01
        report(test="ppo", logprob_diff_mean=[r["rollout/logprob_diff_mean"] for r in records],
               tis_weight=[r["policy/tis_weight"] for r in records])
        assert any(not torch.equal(before[n], p) for n, p in trainer.roles.actor.named_parameters())
    finally:
        engine.cfg = cfg
        engine.sync(model)


def test_eval_samples_every_checkpoint_with_one_engine(setup, tmp_path, monkeypatch):
    """`quartet eval --engine vllm`: one engine serves every checkpoint, each next one's weights reloaded into it;
    each sample has its (prompt, sample) seed, so a checkpoint's responses do not depend on which checkpoint
    started the engine or ran before it; a checkpoint of another architecture is refused with one line."""
    from quartet.errors import ConfigError
    from quartet.eval import evaluate as eval_module
    from quartet.eval.evaluate import evaluate
    from quartet.models import save_model

    model, tok, cfg, engine = setup
    eos = tok.eos_token_id
    early = copy.deepcopy(model)  # the same architecture, answers that end sooner
    with torch.no_grad():
        early.lm_head.weight[eos] = early.lm_head.weight[eos] + 0.6 * early.model.norm.weight.sign()
    save_model(model, tok, tmp_path / "a")
    save_model(early, tok, tmp_path / "b")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    started = []

    def shared_engine(actor, tokenizer, gen_cfg, dtype, share_weights=False):  # stands in for a second start
        assert gen_cfg.engine == "vllm" and gen_cfg.top_k == 0 and dtype == DTYPE
        started.append(gen_cfg)
        engine.cfg, engine.tokenizer = gen_cfg, tokenizer
        engine.sync(actor)
        return engine

    monkeypatch.setattr(eval_module, "make_engine", shared_engine)
    kw = dict(prompts="task:tiny-target/eval", num_prompts=8, samples_per_prompt=4, max_new_tokens=12,
              temperature=1.0, relevance=None, sample_dtype="auto", engine="vllm")  # auto: DTYPE, as asserted above
    try:
        first = evaluate([a, b], **kw)
        flipped = evaluate([b, a], baseline=a, **kw)  # the engine now starts from b; a's weights reloaded after
        assert len(started) == 2  # one engine per eval, not one per checkpoint
        for name in (a, b):
            assert [r[name] for r in first.samples] == [r[name] for r in flipped.samples]
        assert first.settings["engine"] == "vllm"
        ra, rb = first.checkpoints[a], first.checkpoints[b]
        report(test="eval", eos_rate_a=ra["eos_rate"], eos_rate_b=rb["eos_rate"], length_a=ra["length"]["mean"],
               length_b=rb["length"]["mean"], kl_b=rb["kl"]["mean"])
        assert rb["eos_rate"] > ra["eos_rate"] + 0.2 and rb["length"]["mean"] < ra["length"]["mean"]
        assert ra["kl"]["mean"] == 0 and rb["kl"]["mean"] > 0
        # the samples are seeded: another seed draws other responses
        other = evaluate([a], **{**kw, "seed": 1})
        assert [r[a] for r in other.samples] != [r[a] for r in first.samples]
        wide, _ = load_causal_lm(TINY.replace("hidden=128", "hidden=64"))
        save_model(wide, tok, tmp_path / "c")
        with pytest.raises(ConfigError, match=r"must share one architecture: '.*c' differs from '.*a' in .*hidden_size"):
            evaluate([a, str(tmp_path / "c")], **kw)
    finally:
        engine.cfg, engine.tokenizer = cfg, tok
        engine.sync(model)


def test_label_with_the_vllm_engine_writes_judged_pairs(setup, tmp_path, monkeypatch):
    """`quartet label generation.engine=vllm`: K answers per prompt sampled by vLLM, judged, paired; the same seed
    gives the same file."""
    from quartet.config import DataConfig, LabelConfig
    from quartet.data import load_preferences
    from quartet.models import save_model
    from quartet.trainers import label as label_module

    model, tok, cfg, engine = setup
    save_model(model, tok, tmp_path / "policy")
    started = []

    def shared_engine(actor, tokenizer, gen_cfg, dtype, share_weights=False):
        started.append(gen_cfg)
        engine.cfg, engine.tokenizer = gen_cfg, tokenizer
        engine.sync(actor)
        return engine

    monkeypatch.setattr(label_module, "make_engine", shared_engine)

    def run(name):
        return label_module.label(from_dict(LabelConfig, {
            "policy": str(tmp_path / "policy"), "judge": "task:tiny-target", "num_samples": 4, "min_gap": 0.05,
            "prompts": {"path": "task:tiny-target/train", "limit": 12, "max_prompt_tokens": 32},
            "generation": {"max_new_tokens": 12, "batch_size": 24, "engine": "vllm"},
            "output": str(tmp_path / name / "prefs.jsonl"),
        }))

    try:
        result = run("a")
        assert len(started) == 1 and started[0].engine == "vllm"
        rows = [json.loads(line) for line in result.output.read_text().splitlines()]
        report(test="label", pairs=result.counts.pairs, ties=result.counts.ties, samples=result.counts.samples,
               duplicates=result.counts.duplicates)
        assert result.counts.samples == 48 and len(rows) == result.counts.pairs > 0
        for row in rows:
            assert row["chosen_score"] > row["rejected_score"] + 0.05 and row["chosen"] != row["rejected"]
        assert len(load_preferences(DataConfig(path=str(result.output)))) == len(rows)
        assert run("b").output.read_text() == result.output.read_text()
    finally:
        engine.cfg, engine.tokenizer = cfg, tok
        engine.sync(model)


def test_two_processes_each_with_its_vllm_engine_equal_one(setup, tmp_path, monkeypatch):
    """`accelerate launch` with generation.engine: vllm: each process starts its own engine and samples its share of
    the rows from their global seeds; 2 processes x 8 prompts draw the responses 1 process x 16 draws and end at
    the same weights (the hf engine's version of this is tests/distributed/test_processes.py). The 1-process side
    runs here on the suite's engine, the 2 processes are launched for real (gloo)."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from quartet.trainers import ppo as ppo_module

    distributed = Path(__file__).resolve().parents[1] / "distributed"
    sys.path.insert(0, str(distributed))
    import mp_driver

    model, tok, cfg, engine = setup

    def shared_engine(actor, tokenizer, gen_cfg, dtype, share_weights=False, record_logprobs=False):
        engine.cfg, engine.tokenizer = gen_cfg, tokenizer
        engine.sync(actor)
        return engine

    monkeypatch.setattr(ppo_module, "make_engine", shared_engine)
    # the suite engine's architecture (vLLM's CPU attention has no kernels for the driver's own head size of 8)
    overrides = [f"policy={TINY.replace('seed=5', 'seed=1')}", "generation.engine=vllm"]
    try:
        (tmp_path / "p1").mkdir()
        mp_driver.ppo(tmp_path / "p1" / "out.pt", overrides)
    finally:
        engine.cfg, engine.tokenizer = cfg, tok
        engine.sync(model)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    (tmp_path / "p2").mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(distributed.parent / "trainers"),
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1", "--mixed_precision",
         "no", "--dynamo_backend", "no", "--num_processes", "2", "--main_process_port", port,
         str(distributed / "mp_driver.py"), "ppo", str(tmp_path / "p2" / "out.pt"), *overrides],
        capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = (torch.load(tmp_path / p / "out.pt") for p in ("p1", "p2"))
    for it in range(2):
        assert torch.equal(one["response_ids"][it], two["response_ids"][it])
        assert torch.allclose(one["advantages"][it], two["advantages"][it], atol=1e-5)
    worst = max(float((w - two["weights"][n]).abs().max()) for n, w in one["weights"].items())
    report(test="two_processes", max_weight_diff=worst)
    assert worst < 1e-4  # the bound tests/distributed/test_processes.py explains (Adam on float noise)


def test_what_vllm_cannot_run_is_one_config_error(setup, monkeypatch):
    """A prompt that does not fit the engine's context, and a model shape vLLM's CPU attention has no kernel for
    (seen for real with head size 16: "Unsupported CPU attention configuration: head_dim=16 isa=2 ..."), each end
    the run with one `error:` line instead of vLLM's traceback."""
    from quartet.errors import ConfigError

    model, tok, cfg, engine = setup
    engine.cfg.max_new_tokens = 8
    ids = torch.full((1, engine.max_model_len - 4), 40)
    with pytest.raises(ConfigError, match=rf"a prompt of {ids.shape[1]} tokens plus max_new_tokens 8 exceeds the "
                                          rf"engine's context of {engine.max_model_len} tokens"):
        engine.generate(ids, torch.ones_like(ids), seed=0)

    def unsupported(*args, **kwargs):
        raise RuntimeError("Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0")

    monkeypatch.setattr(engine.llm, "generate", unsupported)
    ids = torch.tensor([PROMPT])
    with pytest.raises(ConfigError, match=r"no kernel for this model's shape \(head_dim=16 .*\); use generation.engine: hf"):
        engine.generate(ids, torch.ones_like(ids), seed=0)
