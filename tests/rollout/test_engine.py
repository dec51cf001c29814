"""HF generation engine: samples from the actor's full distribution, stays in sync with LoRA weights."""

from __future__ import annotations

import pytest
import torch

from quartet.config import GenerationConfig, LoraConfig
from quartet.models import apply_lora, load_causal_lm
from quartet.rollout.engine import HFEngine
from quartet.rollout.record import response_mask_from_ids
from quartet.rollout.weights import merged_state_dict

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA

TINY = "tiny:llama?hidden=32&layers=1&heads=4&vocab=260&seed=3"


def test_one_token_samples_follow_the_full_softmax():
    """No hidden top-k/top-p truncation: PPO's old log-probs assume the untruncated distribution."""
    model, tok = load_causal_lm(TINY)
    engine = HFEngine(model, tok, GenerationConfig(max_new_tokens=1, batch_size=4000), dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7]] * 4000)
    ro = engine.generate(ids, torch.ones_like(ids), seed=0)
    with torch.no_grad():
        probs = model(input_ids=ids[:1]).logits[0, -1].softmax(-1)
    freq = torch.bincount(ro.response_ids[:, 0], minlength=probs.numel()).float() / 4000
    assert ro.response_ids.unique().numel() > 200  # transformers' default top_k=50 would cap this at 50
    assert 0.5 * (freq - probs).abs().sum() < 0.12  # total variation, sampling noise ~0.09 for 260 outcomes


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8)])
def test_the_sampler_draws_from_the_warped_softmax(temperature, top_k, top_p):
    """`PerRowInverseCDF` after the temperature / top-k / top-p warpers: token frequencies over many seeds
    follow softmax(logits / T) cut to the kept tokens, a cut token is never drawn, and one row's draws do not
    depend on the rows beside it."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    model, tok = load_causal_lm(TINY)
    gen = GenerationConfig(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    engine = HFEngine(model, tok, gen, dtype=torch.float32)
    logits = torch.randn(1, 260, generator=torch.Generator().manual_seed(0)) * 2.0
    n = 6000
    processors = engine._sampler(list(range(n)))
    tokens = processors(None, logits.expand(n, -1).clone()).argmax(-1)
    warped = logits / temperature
    if top_k:
        warped = TopKLogitsWarper(top_k)(None, warped)
    if top_p < 1.0:
        warped = TopPLogitsWarper(top_p)(None, warped)
    probs = warped.softmax(-1)[0]
    freq = torch.bincount(tokens, minlength=260).float() / n
    assert (freq[probs == 0] == 0).all()
    assert 0.5 * (freq - probs).abs().sum() < 0.06  # total variation; sampling noise ~0.02-0.04 here
    alone = engine._sampler([5])(None, logits.clone()).argmax(-1)
    assert alone.item() == tokens[5].item()


def test_sync_folds_lora_into_the_engine_copy():
    model, tok = load_causal_lm(TINY)
    actor = apply_lora(model, LoraConfig(enabled=True, r=4, alpha=8))
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    engine = HFEngine(actor, tok, GenerationConfig(max_new_tokens=4), dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = actor(input_ids=ids).logits
        got = engine.model(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert not any("lora" in k for k in merged_state_dict(actor))


def test_an_engine_sharing_the_actors_weights_samples_what_a_copy_samples():
    """share_weights: no copy; in fp32 the same tokens as an fp32 copy, in bf16 the actor under autocast (its
    weights untouched, its train/eval mode restored, nothing recorded for autograd)."""
    model, tok = load_causal_lm(TINY)
    model.requires_grad_(True)  # an actor being trained
    ids = torch.tensor([[0, 0, 5, 6, 7], [9, 8, 7, 6, 5], [0, 4, 4, 4, 4]])
    mask = (ids != 0).long()
    gen = GenerationConfig(max_new_tokens=6, batch_size=6)
    copy = HFEngine(model, tok, gen, dtype=torch.float32).generate(ids, mask, seed=4, num_samples=2)
    shared_engine = HFEngine(model, tok, gen, dtype=torch.float32, share_weights=True)
    assert shared_engine.model is model
    model.train()
    shared = shared_engine.generate(ids, mask, seed=4, num_samples=2)
    assert model.training  # restored
    assert torch.equal(shared.response_ids, copy.response_ids)

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    bf16 = HFEngine(model, tok, gen, dtype=torch.bfloat16, share_weights=True)
    greedy = bf16.generate(ids, mask, greedy=True)
    bf16_copy = HFEngine(model, tok, gen, dtype=torch.bfloat16).generate(ids, mask, greedy=True)
    assert greedy.response_ids.shape == bf16_copy.response_ids.shape
    assert (greedy.response_ids == bf16_copy.response_ids).float().mean() > 0.5  # bf16 matmuls, fp32 norms
    assert all(torch.equal(p, before[n]) and p.dtype == torch.float32 and p.grad is None
               for n, p in model.named_parameters())

    bf16.sync(model)  # nothing to copy
    other, _ = load_causal_lm(TINY)
    with pytest.raises(RuntimeError, match="another model"):
        bf16.sync(other)


def test_a_shared_lora_model_is_sampled_as_it_is():
    """share_weights in the model's own dtype samples it as it is, a LoRA model through its adapters unmerged
    (DPO's KL probe): with the adapters' B still 0, the base model's tokens."""
    model, tok = load_causal_lm(TINY)
    ids = torch.tensor([[0, 0, 5, 6, 7], [9, 8, 7, 6, 5]])
    mask = (ids != 0).long()
    gen = GenerationConfig(max_new_tokens=6, batch_size=2)
    plain = HFEngine(model, tok, gen, dtype=torch.float32, share_weights=True).generate(ids, mask, seed=4)
    lora = apply_lora(model, LoraConfig(enabled=True, r=4, alpha=8))
    engine = HFEngine(lora, tok, gen, dtype=torch.float32, share_weights=True)
    assert engine.model is lora
    assert torch.equal(engine.generate(ids, mask, seed=4).response_ids, plain.response_ids)


def test_the_float64_nucleus_is_cut_by_the_sampler():
    """`float64_top_p` (quartet eval's sampling, DPO's KL probe): no TopPLogitsWarper; each row draws
    inverse_cdf(nucleus(softmax(logits / T), top_p)) with the next uniform of its own generator."""
    from quartet.algo import inverse_cdf, nucleus

    model, tok = load_causal_lm(TINY)
    engine = HFEngine(model, tok, GenerationConfig(max_new_tokens=1, temperature=0.7, top_p=0.8),
                      dtype=torch.float32, float64_top_p=True)
    processors = engine._sampler(list(range(50)))
    assert [type(p).__name__ for p in processors] == ["TemperatureLogitsWarper", "PerRowInverseCDF"]
    logits = torch.randn(50, 260, generator=torch.Generator().manual_seed(0)) * 2.0
    tokens = processors(None, logits.clone()).argmax(-1)
    u = torch.cat([torch.rand(1, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in range(50)])
    assert torch.equal(tokens, inverse_cdf(nucleus(torch.softmax(logits / 0.7, dim=-1), 0.8), u))
    assert len(set(tokens.tolist())) > 1


def test_one_sample_seed_for_every_stream():
    """The engines' `quartet-sample/<seed>/<index>` and quartet eval's `quartet-eval/<seed>/<prompt>/<sample>`
    hashes, from one function: every seed recorded in an earlier samples.jsonl still replays its sample."""
    import hashlib

    from quartet.rollout.sampling import EVAL_STREAM, sample_seed

    def blake(text: str) -> int:
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & (2**63 - 1)

    assert sample_seed(7, 3) == blake("quartet-sample/7/3")
    assert sample_seed(0, 2, 1, stream=EVAL_STREAM) == blake("quartet-eval/0/2/1")
    assert sample_seed(0, 2, 1, stream=EVAL_STREAM) != sample_seed(0, 2, 1)


def test_response_mask_keeps_eos_and_drops_what_follows():
    ids = torch.tensor([[5, 3, 9, 9], [5, 6, 7, 8]])
    mask, eos = response_mask_from_ids(ids, eos_id=3)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert eos.tolist() == [True, False]


def test_k_samples_share_one_prefill_and_match_repeated_prompts():
    """num_samples=K prefills each prompt once; the samples equal those of the prompts repeated K times."""
    model, tok = load_causal_lm(TINY)
    engine = HFEngine(model, tok, GenerationConfig(max_new_tokens=6, batch_size=6), dtype=torch.float32)
    ids = torch.tensor([[0, 0, 5, 6, 7], [9, 8, 7, 6, 5], [0, 4, 4, 4, 4]])  # left-padded with pad id 0
    mask = (ids != 0).long()
    shared = engine.generate(ids, mask, seed=1, num_samples=3)
    repeated = engine.generate(ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0), seed=1)
    assert shared.response_ids.shape[0] == 9 and torch.equal(shared.prompt_ids, ids.repeat_interleave(3, 0))
    assert torch.equal(shared.response_ids, repeated.response_ids)
    assert shared.responses == repeated.responses
    # the K samples of a prompt differ (they are samples, not copies of one answer)
    assert len({tuple(r.tolist()) for r in shared.response_ids[:3]}) > 1


GQA = "tiny:llama?hidden=64&layers=2&heads=4&kv_heads=2&vocab=260&seed=3"


@pytest.mark.parametrize("spec", [TINY, GQA])
def test_k_samples_decode_on_one_copy_of_their_prompt(spec):
    """K samples per prompt decode on the prompt's keys held once (models/sample_prefix.py): the cache holds P
    prompts' keys and the rows' own, and the tokens are those of the cache repeated K times. Float32: the two
    attentions differ by rounding (~1e-6 of a logit), so a draw could differ only where a uniform falls among
    tokens narrower than that; this random model's distributions are near uniform over 260 tokens, none so narrow."""
    model, tok = load_causal_lm(spec)
    if next(model.parameters()).device.type != "cpu":
        pytest.skip("CPU only: a GPU decodes on the repeated cache")
    engine = HFEngine(model, tok, GenerationConfig(max_new_tokens=10, batch_size=12), dtype=torch.float32)
    ids = torch.tensor([[0, 0, 5, 6, 7], [9, 8, 7, 6, 5], [0, 4, 4, 4, 4]])
    mask = (ids != 0).long()
    shared = engine.generate(ids, mask, seed=2, num_samples=4)
    assert engine._prompt_sharing is True
    with torch.no_grad():
        layer = engine._shared_prefill(ids, mask, 4).layers[0]
    assert layer.prompt_keys.shape[:3] == (3, layer.prompt_keys.shape[1], 4)  # 3 prompts x their 4 tokens, once
    assert layer.keys.shape[0] == 12 and layer.keys.shape[2] == 0  # the 12 rows' own: none yet
    engine._prompt_sharing = False
    repeated = engine.generate(ids, mask, seed=2, num_samples=4)
    assert torch.equal(shared.response_ids, repeated.response_ids)


def test_a_wrong_shared_prompt_attention_is_caught_and_not_used(monkeypatch):
    """The engine's probe compares a few decoding steps on the shared cache with the repeated cache: an attention
    that forgets the prompt's keys fails it, and the engine decodes on the repeated cache instead."""
    from quartet.models import sample_prefix
    from quartet.models.attention import grouped_eager_attention

    def forgets_the_prompt(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        prompt_len = key.quartet_shared_layer.prompt_keys.shape[2]
        mask = attention_mask[..., prompt_len:] if attention_mask is not None else None
        return grouped_eager_attention(module, query, key, value, mask, scaling)

    model, tok = load_causal_lm(GQA)
    engine = HFEngine(model, tok, GenerationConfig(max_new_tokens=8, batch_size=12), dtype=torch.float32)
    ids = torch.tensor([[0, 0, 5, 6, 7], [9, 8, 7, 6, 5], [0, 4, 4, 4, 4]])
    mask = (ids != 0).long()
    want = engine.generate(ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0), seed=5).response_ids
    monkeypatch.setattr(sample_prefix, "shared_prompt_attention", forgets_the_prompt)  # registered when a cache is made
    got = engine.generate(ids, mask, seed=5, num_samples=2).response_ids
    assert engine._prompt_sharing is False
    assert torch.equal(got, want)


def test_bf16_k_samples_pass_the_probe():
    """In bf16 the shared attention's rounding moves logits by about one 8-bit rounding: within the probe's
    tolerance, so a bf16 engine (the label stage's) decodes on the shared cache."""
    model, tok = load_causal_lm(GQA)
    engine = HFEngine(model, tok, GenerationConfig(max_new_tokens=8, batch_size=12), dtype=torch.bfloat16)
    ids = torch.tensor([[0, 0, 5, 6, 7], [9, 8, 7, 6, 5], [0, 4, 4, 4, 4]])
    ro = engine.generate(ids, (ids != 0).long(), seed=5, num_samples=4)
    assert engine._prompt_sharing is (next(engine.model.parameters()).device.type == "cpu")
    assert ro.response_ids.shape[0] == 12


def test_each_sample_has_its_own_random_stream():
    """A sample depends on (seed, its global index) only: not on the prompts beside it, the batch split or the
    generate-call size, so N processes with offsets sample what one process samples."""
    from quartet.data import left_pad

    model, tok = load_causal_lm(TINY)
    engine = HFEngine(model, tok, GenerationConfig(max_new_tokens=6, batch_size=8), dtype=torch.float32)
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14], [15], [16, 17], [18, 19, 20], [21], [22, 23]]
    ids, mask = left_pad(prompts, tok.pad_token_id)
    whole = engine.generate(ids, mask, seed=7, num_samples=2)
    halves = []
    for part, offset in ((prompts[:4], 0), (prompts[4:], 8)):
        ids, mask = left_pad(part, tok.pad_token_id)
        halves.append(engine.generate(ids, mask, seed=7, num_samples=2, sample_offset=offset).responses)
    assert whole.responses == halves[0] + halves[1]
    other = engine.generate(*left_pad(prompts, tok.pad_token_id), seed=8, num_samples=2)
    assert other.responses != whole.responses
    # the two samples of one prompt differ (their own streams), though they share the prompt's prefill
    assert sum(whole.responses[2 * i] != whole.responses[2 * i + 1] for i in range(8)) >= 6


def test_explicit_seeds_pick_each_rows_stream():
    """`seeds=` names each output row's seed (quartet eval's per-(prompt, sample) seeds): the same rows as the
    derived seeds they equal, in any batch split; a wrong count is refused."""
    from quartet.data import left_pad
    from quartet.rollout.sampling import sample_seed

    model, tok = load_causal_lm(TINY)
    engine = HFEngine(model, tok, GenerationConfig(max_new_tokens=6, batch_size=2), dtype=torch.float32)
    ids, mask = left_pad([[5, 6, 7], [9, 10], [11, 12, 13, 14]], tok.pad_token_id)
    derived = engine.generate(ids, mask, seed=7, num_samples=2)
    seeds = [sample_seed(7, j) for j in range(6)]
    assert engine.generate(ids, mask, num_samples=2, seeds=seeds).responses == derived.responses
    reversed_rows = engine.generate(ids.flip(0), mask.flip(0), num_samples=2,
                                    seeds=[s for i in (2, 1, 0) for s in seeds[2 * i : 2 * i + 2]])
    assert reversed_rows.responses == [r for i in (2, 1, 0) for r in derived.responses[2 * i : 2 * i + 2]]
    with pytest.raises(ValueError, match="5 seeds for 6 output rows"):
        engine.generate(ids, mask, num_samples=2, seeds=seeds[:5])


@pytest.mark.parametrize("leave", [0.0, 0.125, 1.0])
@pytest.mark.parametrize("num_samples", [1, 3])
def test_finished_rows_leave_the_batch_and_the_samples_are_generates(num_samples, leave, monkeypatch):
    """The engine's decoding loop drops finished rows from the batch (and the KV cache) once `leave` of it has
    emitted EOS (0: at each finish; 1: never, the batch ends when all have); every row's tokens are still
    exactly what transformers' `generate` samples with the same processors and seeds, which runs every row to
    the end. EOS is made a likely token here, so rows finish at many different steps."""
    from quartet.data import left_pad
    from quartet.rollout import engine as engine_module
    from quartet.rollout.sampling import row_seeds

    monkeypatch.setattr(engine_module, "LEAVE_FRACTION", leave)

    model, tok = load_causal_lm(TINY)
    engine = HFEngine(model, tok, GenerationConfig(max_new_tokens=24, batch_size=64), dtype=torch.float32)
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14], [15], [16, 17], [18, 19, 20]]
    ids, mask = left_pad(prompts, tok.pad_token_id)
    engine.generation_config.eos_token_id = None  # first without EOS: the token in most answers then is EOS
    free = engine.generate(ids, mask, seed=3, num_samples=num_samples).response_ids
    eos = int(torch.stack([torch.bincount(row, minlength=260).clamp(max=1) for row in free]).sum(0).argmax())
    engine.generation_config.eos_token_id = eos
    ro = engine.generate(ids, mask, seed=3, num_samples=num_samples)
    if num_samples > 1 and ids.device.type == "cpu":  # the K samples decoded on one copy of their prompt's keys
        assert engine._prompt_sharing is True
    reps = ids.repeat_interleave(num_samples, 0), mask.repeat_interleave(num_samples, 0)
    processors = engine._sampler(row_seeds(3, 0, len(prompts) * num_samples, None))
    with torch.no_grad():
        full = engine.model.generate(input_ids=reps[0], attention_mask=reps[1], logits_processor=processors,
                                     generation_config=engine.generation_config)[:, ids.shape[1]:]
    ends = [int((row == eos).nonzero()[0]) + 1 if (row == eos).any() else row.numel() for row in full]
    assert len(set(ends)) > 2 and min(ends) < 24  # rows ended at different steps, some early
    assert ro.response_ids.shape[1] == full.shape[1] == max(ends)
    # the Rollout also ends an answer at the tokenizer's own EOS
    stop = torch.isin(full, torch.tensor([eos, tok.eos_token_id]))
    lengths = [int(row.nonzero()[0]) + 1 if row.any() else full.shape[1] for row in stop]
    for i, n in enumerate(lengths):
        assert ro.response_ids[i, :n].tolist() == full[i, :n].tolist()
        assert (ro.response_ids[i, n:] == tok.pad_token_id).all()


@pytest.mark.parametrize(("share_weights", "leave"), [(False, 0.125), (True, 0.125), (False, 0.0), (False, 1.0)])
def test_recorded_logprobs_are_the_teacher_forced_forwards(share_weights, leave, monkeypatch):
    """`record_logprobs`: each sampled token's log-prob and its step's entropy under softmax(logits / T), before
    top-k cuts the distribution, are what the actor's forward over the finished rollout gives (what PPO's old
    log-probs are), rows that finish early included (whenever finished rows leave the batch); 0 on padding.
    Greedy rows record nothing."""
    from quartet.algo.logprobs import logprobs_and_entropy
    from quartet.data import left_pad
    from quartet.rollout import engine as engine_module
    from quartet.trainers.ppo_roles import actor_logprobs

    monkeypatch.setattr(engine_module, "LEAVE_FRACTION", leave)

    model, tok = load_causal_lm(TINY)
    gen = GenerationConfig(max_new_tokens=24, batch_size=64, temperature=0.8, top_k=20)
    engine = HFEngine(model, tok, gen, dtype=torch.float32, share_weights=share_weights)
    ids, mask = left_pad([[5, 6, 7], [9, 10], [11, 12, 13, 14], [15], [16, 17], [18, 19, 20]], tok.pad_token_id)
    engine.generation_config.eos_token_id = None  # the token in most answers then ends rows at different steps
    free = engine.generate(ids, mask, seed=1).response_ids
    eos = torch.stack([torch.bincount(row, minlength=260).clamp(max=1) for row in free]).sum(0).argmax()
    tok.eos_token = tok.convert_ids_to_tokens(int(eos))  # the rollout's answers end there too
    engine.generation_config.eos_token_id = int(eos)
    assert engine.generate(ids, mask, seed=1).engine_logprobs is None  # only when asked
    engine = HFEngine(model, tok, gen, dtype=torch.float32, share_weights=share_weights, record_logprobs=True)
    assert engine.generation_config.eos_token_id == int(eos)
    ro = engine.generate(ids, mask, seed=1, num_samples=2)
    assert 1 < int(ro.lengths.min()) < int(ro.lengths.max())  # rows ended at different steps
    with torch.no_grad():
        want, want_entropy, _ = actor_logprobs(model, ro, 0.8)
        logits = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits
    torch.testing.assert_close(ro.engine_logprobs, want * ro.response_mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(ro.engine_entropy, want_entropy * ro.response_mask, atol=1e-5, rtol=0)
    assert (ro.engine_logprobs[ro.response_mask == 0] == 0).all()
    # untruncated: a top-20 log-prob would be larger than the full softmax's
    P = ro.prompt_ids.shape[1]
    full, _ = logprobs_and_entropy(logits[:, P - 1 : -1], ro.response_ids, 0.8)
    torch.testing.assert_close(ro.engine_logprobs, full * ro.response_mask, atol=1e-5, rtol=0)
    assert engine.generate(ids, mask, greedy=True).engine_logprobs is None
