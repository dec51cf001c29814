"""The experience maker (trainers/experience.py) on its own: one iteration's Rollout from a tiny policy, its
prompt order, the gather onto every process, the per-iteration seeds and the rollout statistics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from builders import tiny_ppo
from quartet.config import validate
from quartet.data import encode_prompts, load_prompts
from quartet.rollout.engine import make_engine
from quartet.rollout.record import Rollout
from quartet.trainers import loop
from quartet.trainers.experience import ExperienceMaker, gather_experience, rollout_stats, step_seed
from quartet.trainers.plan import Facts, plan_forward_paths
from quartet.trainers.ppo_roles import PolicyModel, actor_logprobs, build_roles

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA


def _maker(tmp_path, **fields) -> tuple[ExperienceMaker, PolicyModel]:
    """An ExperienceMaker and the policy it scores with, built as PPOTrainer builds them on one process (the
    tiny config's shared value head, hf engine in fp32), without the trainer."""
    cfg = tiny_ppo(tmp_path, **fields)
    validate(cfg)
    accelerator = loop.make_accelerator(cfg.precision, grad_accum=1)
    torch.manual_seed(cfg.seed)
    roles = build_roles(cfg, needs_critic=cfg.critic_kind != "none")
    examples = load_prompts(cfg.prompts)
    encoded = encode_prompts(roles.tokenizer, [e.prompt for e in examples], cfg.prompts.max_prompt_tokens,
                             cfg.prompts.truncation, cfg.prompts.chat_template, where=cfg.prompts.path)
    plan = plan_forward_paths(cfg, Facts(1, None, torch.float32))
    policy = PolicyModel(roles.actor, roles.critic, roles.shared_critic, roles.temperature)
    engine = make_engine(roles.actor, roles.tokenizer, cfg.generation, torch.float32,
                         share_weights=plan.engine_shares_weights, record_logprobs=plan.reuse_sampling_logprobs)
    maker = ExperienceMaker(cfg, roles, engine, accelerator, [examples[i].prompt for i in encoded.kept],
                            encoded.input_ids, None, False, plan)
    return maker, policy


def test_one_iterations_experience_has_the_rollouts_shapes_and_masks(tmp_path):
    maker, policy = _maker(tmp_path)
    exp = maker.make(policy, 1)
    ro, B = exp.rollout, 16  # rollout_batch_size 16, one sample per prompt
    R = ro.response_ids.shape[1]
    assert ro.prompt_ids.shape == ro.prompt_mask.shape and ro.prompt_ids.shape[0] == B
    assert 1 <= R <= maker.cfg.generation.max_new_tokens
    mask = ro.response_mask
    assert set(mask.unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(mask, (torch.arange(R) < ro.lengths[:, None]).float())  # real tokens first, then padding
    assert (ro.response_ids[mask == 0] == maker.roles.tokenizer.pad_token_id).all()
    eos_id = maker.roles.tokenizer.eos_token_id
    last = ro.response_ids.gather(1, (ro.lengths.long() - 1).clamp(min=0)[:, None])[:, 0]
    assert torch.equal(ro.eos, last == eos_id)  # an answer ends with EOS or at max_new_tokens
    for x in (ro.old_logprobs, ro.ref_logprobs, ro.values, exp.entropy):
        assert x.shape == (B, R) and (x[mask == 0] == 0).all()
    assert (ro.old_logprobs[mask == 1] < 0).all()
    assert exp.raw_scores.shape == ro.scores.shape == ro.eos.shape == (B,)
    assert len(ro.prompts) == len(ro.responses) == B and ro.prompts == [maker.prompts[i] for i in maker.batch_indices(1)]
    assert exp.gold is None and exp.greedy_scores is None and exp.monitors == {}
    assert ro.engine_logprobs is None and ro.trunk is None
    assert set(exp.timing) == {"timing/generate", "timing/score", "timing/forward", "timing/reference"}
    records = exp.sample_records(1)
    assert [r["response"] for r in records] == ro.responses and {r["step"] for r in records} == {1}


def test_old_and_reference_logprobs_are_the_forwards_over_each_micro_batch(tmp_path):
    """What `make` computes, done here by hand: each micro-batch (rows in order of length, cut to their longest
    row) through the policy and through the reference, put back in row order with 0 on padding. Before any update
    the reference is the actor's copy: the same log-probs."""
    maker, policy = _maker(tmp_path)
    ro = maker.make(policy, 1).rollout
    old, ref, values = torch.zeros_like(ro.old_logprobs), torch.zeros_like(ro.old_logprobs), torch.zeros_like(ro.values)
    with torch.no_grad():
        for rows, mb in ro.by_length(maker.cfg.micro_batch_size):
            mb = mb.to(next(policy.parameters()).device)  # the models' device (the GPU where there is one)
            lp, _, v = policy(mb)
            width = lp.shape[1]
            old[rows, :width], values[rows, :width] = lp.cpu(), v.cpu()
            ref[rows, :width] = actor_logprobs(maker.roles.reference, mb, maker.roles.temperature)[0].cpu()
    mask = ro.response_mask
    assert torch.equal(ro.old_logprobs, old * mask)
    assert torch.equal(ro.values, values * mask)
    assert torch.equal(ro.ref_logprobs, ref * mask)
    assert torch.equal(ro.ref_logprobs, ro.old_logprobs)


def test_an_iteration_is_the_same_from_a_fresh_maker_and_the_next_one_differs(tmp_path):
    a, policy_a = _maker(tmp_path / "a")
    b, policy_b = _maker(tmp_path / "b")
    first, again = a.make(policy_a, 1).rollout, b.make(policy_b, 1).rollout
    for name in ("prompt_ids", "response_ids", "response_mask", "old_logprobs", "ref_logprobs", "values", "scores"):
        assert torch.equal(getattr(first, name), getattr(again, name)), name
    assert first.responses == again.responses
    second = a.make(policy_a, 2).rollout
    assert second.prompts != first.prompts or not torch.equal(second.response_ids, first.response_ids)


def _prompt_order(n: int, size: int, rank: int = 0, world: int = 1, seed: int = 0) -> ExperienceMaker:
    """A maker that only orders prompts: `n` prompts, `size` per process and iteration."""
    cfg = SimpleNamespace(rollout_batch_size=size, seed=seed)
    accelerator = SimpleNamespace(process_index=rank, num_processes=world)
    return ExperienceMaker(cfg, None, None, accelerator, [], [[i] for i in range(n)], None, False, None)


def test_batch_indices_take_each_prompt_once_per_pass_and_do_not_depend_on_resume_or_split():
    n, size = 12, 4
    maker = _prompt_order(n, size)
    passes = [sum((maker.batch_indices(it) for it in range(1 + p * 3, 4 + p * 3)), []) for p in range(2)]
    assert all(sorted(p) == list(range(n)) for p in passes)  # every prompt once per pass of n / size iterations
    assert passes[0] != passes[1]  # each pass in its own seeded order
    assert _prompt_order(n, size).batch_indices(5) == maker.batch_indices(5)  # a resumed run: the same batch
    assert _prompt_order(n, size, seed=1).batch_indices(1) != maker.batch_indices(1)
    # two processes of 2 prompts take, in rank order, the batch one process of 4 takes
    for it in (1, 2, 7):
        split = _prompt_order(n, 2, 0, 2).batch_indices(it) + _prompt_order(n, 2, 1, 2).batch_indices(it)
        assert split == maker.batch_indices(it)


def test_gather_on_one_process_returns_the_rows_as_they_are(tmp_path):
    maker, policy = _maker(tmp_path)
    exp = maker.make(policy, 1)
    ro, pad = exp.rollout, maker.roles.tokenizer.pad_token_id
    out, raw, none, eos = gather_experience(maker.accelerator, ro, pad, exp.raw_scores, None, ro.eos)
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "eos", "old_logprobs", "ref_logprobs",
                 "values"):
        assert torch.equal(getattr(out, name), getattr(ro, name)), name
    assert out.prompts == ro.prompts and out.responses == ro.responses and out.engine_logprobs is None
    assert torch.equal(raw, exp.raw_scores) and none is None
    assert eos.dtype == torch.bool and torch.equal(eos, ro.eos)


def test_step_seed_is_one_stream_per_iteration_and_use():
    assert step_seed(0, 1, 1) == 7919 + 104_729
    assert step_seed(3, 2, 3) == (3 * 1_000_003 + 2 * 7919 + 3 * 104_729) % 2**31
    seeds = {step_seed(seed, it, stream) for seed in (0, 1) for it in range(1, 50) for stream in (1, 2, 3)}
    assert len(seeds) == 2 * 49 * 3  # no two streams of these runs share a seed
    assert all(0 <= s < 2**31 for s in seeds)
    assert 0 <= step_seed(2**40, 10**6, 3) < 2**31


def test_rollout_stats_by_hand():
    """Two responses, [5, 6, 5, 6, 5, 6, EOS=2] and [7, 8, pad...]: lengths 7 and 2 (the second cut at max)."""
    pad = 0
    response_ids = torch.tensor([[5, 6, 5, 6, 5, 6, 2], [7, 8, pad, pad, pad, pad, pad]])
    mask = torch.tensor([[1.0] * 7, [1.0, 1.0] + [0.0] * 5])
    ro = Rollout(prompt_ids=torch.ones(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1, dtype=torch.long),
                 response_ids=response_ids, response_mask=mask, eos=torch.tensor([True, False]))
    stats = rollout_stats(ro)
    assert stats["rollout/length_mean"] == 4.5 and stats["rollout/length_max"] == 7.0
    assert stats["rollout/eos_rate"] == 0.5
    # unigrams over both: 5 6 5 6 5 6 2 7 8: 5 distinct of 9
    assert stats["rollout/distinct_1"] == pytest.approx(5 / 9)
    # bigrams: (5,6) (6,5) (5,6) (6,5) (5,6) (6,2) | (7,8): 4 distinct of 7
    assert stats["rollout/distinct_2"] == pytest.approx(4 / 7)
    # 4-grams of the first: 5656 6565 5656 6562: one of 4 repeats an earlier one; the second has none
    assert stats["rollout/repetition"] == pytest.approx((1 / 4 + 0) / 2)
    assert "rollout/logprob_diff_mean" not in stats
    ro.old_logprobs = torch.full((2, 7), -1.0) * mask
    ro.engine_logprobs = torch.full((2, 7), -1.5) * mask  # an engine that finds every real token less likely
    ro.engine_logprobs[0, 0] = -3.0
    stats = rollout_stats(ro)
    assert stats["rollout/logprob_diff_mean"] == pytest.approx((8 * 0.5 + 2.0) / 9)
    assert stats["rollout/logprob_diff_max"] == 2.0
