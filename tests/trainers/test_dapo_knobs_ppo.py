"""The reasoning-RL knobs (issue 39) wired into the PPO trainer on the tiny model: each trains, logs exactly what
`logged_metrics` says, and does what its reference in tests/algo/test_dapo_knobs.py does; at their neutral values
the run is the default run bit for bit; reward_funcs from YAML and from Python; each bad value one ConfigError."""

from __future__ import annotations

import json
import math
import typing
from pathlib import Path

import pytest
import torch

import quartet
from builders import tiny_ppo
from quartet.algo import (
    POLICY_LOSSES,
    SCALES,
    group_advantages,
    kept_rows_scale,
    masked_sum,
    overlong_penalty,
)
from quartet.config import PPOConfig, validate
from quartet.config.stages import reward_term_names
from quartet.errors import ConfigError
from quartet.rollout.record import Rollout, concat
from quartet.trainers.ppo import PPOTrainer

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA

GRPO = dict(advantage="grpo", samples_per_prompt=4, critic=None, rollout_batch_size=4, kl_in_reward=False,
            kl_estimator="k3")
BINARY = "ppo_rewards:has_digit"


def records(cfg) -> list[dict]:
    return [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]


def weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}


KNOBS = {
    "clip-higher-dual-clip": dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0),
    "cispo": dict(GRPO, policy_loss="cispo", cispo_max_weight=2.0, cispo_min_weight=0.5),
    "dynamic-sampling": dict(GRPO, reward=BINARY, dynamic_sampling=True, dynamic_sampling_rounds=3),
    "mask-truncated": dict(GRPO, mask_truncated_completions=True, entropy_coef=0.01),
    "overlong": dict(GRPO, overlong_buffer=4, overlong_penalty=0.5, missing_eos_penalty=0.1),
    "length-penalty": dict(length_penalty=0.01),
    "scale-batch": dict(GRPO, scale_rewards="batch"),
    # `reward` at its default: tiny_ppo sets it, and the two are one or the other
    "reward-funcs": dict(GRPO, reward=PPOConfig.reward, reward_funcs=["task:tiny-target", BINARY],
                         reward_weights=[1.0, 0.5]),
}


@pytest.mark.parametrize("kw", list(KNOBS.values()), ids=list(KNOBS))
def test_each_knob_trains_and_logs_exactly_its_metrics(tmp_path, kw):
    cfg = tiny_ppo(tmp_path, iterations=2, **kw)
    trainer = PPOTrainer(cfg, progress=False)
    before = weights(trainer)
    trainer.train()
    recs = records(cfg)
    assert set().union(*recs) - {"stage", "algorithm", "step", "time"} == set(cfg.logged_metrics)
    assert all(math.isfinite(v) for r in recs for v in r.values() if isinstance(v, float))
    assert any(not torch.equal(before[n], p) for n, p in weights(trainer).items())


def test_the_knobs_at_their_neutral_values_are_the_default_run_bit_for_bit(tmp_path):
    base = dict(GRPO, iterations=2)
    plain = PPOTrainer(tiny_ppo(tmp_path / "a", **base), progress=False)
    plain.train()
    neutral = dict(base, clip_low=0.2, clip_high=0.2, scale_rewards="group", length_penalty=0.0,
                   reward=PPOConfig.reward, reward_funcs=["task:tiny-target"], reward_weights=[1.0])
    knobs = PPOTrainer(tiny_ppo(tmp_path / "b", **neutral), progress=False)
    knobs.train()
    a, b = weights(plain), weights(knobs)
    assert all(torch.equal(a[n], b[n]) for n in a)
    for ra, rb in zip(records(plain.cfg), records(knobs.cfg)):
        assert {k: v for k, v in ra.items() if not k.startswith(("timing/", "memory/", "time"))} == \
            {k: v for k, v in rb.items() if not k.startswith(("timing/", "memory/", "time", "rollout/reward_"))}


def test_reward_funcs_optimise_the_weighted_sum_and_log_each_term(tmp_path):
    cfg = tiny_ppo(tmp_path, iterations=1, **KNOBS["reward-funcs"])
    trainer = PPOTrainer(cfg, progress=False)
    trainer.train()
    (m,) = records(cfg)
    assert m["objective/score"] == pytest.approx(m["rollout/reward_tiny_target"] + 0.5 * m["rollout/reward_has_digit"],
                                                 abs=1e-6)
    samples = [json.loads(x) for x in (Path(cfg.output_dir) / "samples.jsonl").read_text().splitlines()]
    for s in samples:
        assert s["reward_has_digit"] == float(any(c.isdigit() for c in s["response"]))
        assert s["score"] == pytest.approx(s["reward_tiny_target"] + 0.5 * s["reward_has_digit"], abs=1e-5)
    assert "1 x task:tiny-target + 0.5 x ppo_rewards:has_digit" in (Path(cfg.output_dir) / "summary.md").read_text()


def test_the_python_api_takes_reward_funcs_in_a_config_as_callables():
    def accuracy(prompts, responses):
        return [1.0] * len(responses)

    trainer = quartet.GRPOTrainer(args=quartet.GRPOConfig(reward_funcs=[accuracy, "task:tiny-target"],
                                                          reward_weights=[1.0, 0.2]))
    assert trainer.config.reward_funcs[0].startswith("memory:accuracy.")
    assert list(trainer.config.reward_terms) == ["reward_accuracy", "reward_tiny_target"]


def test_the_config_offers_the_policy_losses_and_scales_algo_has():
    hints = typing.get_type_hints(PPOConfig)
    assert typing.get_args(hints["policy_loss"]) == tuple(POLICY_LOSSES)
    assert typing.get_args(typing.get_args(hints["scale_rewards"])[0]) == SCALES


def test_reward_term_names():
    assert reward_term_names(["task:arithmetic/format", "judge:vader", "my_rewards:accuracy", "memory:accuracy.3",
                              "runs/rm/model", "task:arithmetic", "task:arithmetic"]) == [
        "reward_arithmetic_format", "reward_vader", "reward_accuracy", "reward_accuracy_2", "reward_runs_rm_model",
        "reward_arithmetic", "reward_arithmetic_2"]


# ---------------------------------------------------------------------------- dynamic sampling
def test_dynamic_sampling_keeps_the_first_rounds_groups_with_signal_and_fills_the_batch(tmp_path):
    plain = PPOTrainer(tiny_ppo(tmp_path / "a", reward=BINARY, **GRPO), progress=False)
    dyn = PPOTrainer(tiny_ppo(tmp_path / "b", reward=BINARY, dynamic_sampling=True, **GRPO), progress=False)
    first, filled = plain.experience.make(plain.model, 1), dyn.experience.make(dyn.model, 1)
    G, n = 4, 4
    flat = [len(set(first.raw_scores[i * G : (i + 1) * G].tolist())) == 1 for i in range(n)]
    assert any(flat)  # else this seed tests nothing
    kept = [first.rollout.responses[i * G : (i + 1) * G] for i in range(n) if not flat[i]]
    got = [filled.rollout.responses[i * G : (i + 1) * G] for i in range(n)]
    assert got[: len(kept)] == kept  # round 1's groups with signal, sampled as without dynamic sampling, first
    assert len(filled.rollout) == n * G and filled.stats["rollout/sampling_rounds"] >= 2
    assert filled.stats["rollout/zero_std_groups"] == 0.0  # filled with groups that carry signal
    assert filled.stats["rollout/dropped_groups"] > 0
    assert "rollout/zero_std_groups" in first.stats and "rollout/dropped_groups" not in first.stats


def test_dynamic_sampling_out_of_rounds_fills_the_batch_with_the_dropped_groups(tmp_path):
    cfg = tiny_ppo(tmp_path, reward="ppo_rewards:letter", dynamic_sampling=True, dynamic_sampling_rounds=2, **GRPO)
    trainer = PPOTrainer(cfg, progress=False)  # `letter` pays only one-letter answers: 8 tokens never are one
    exp = trainer.experience.make(trainer.model, 1)
    assert len(exp.rollout) == 16 and exp.stats["rollout/sampling_rounds"] == 2.0
    assert exp.stats["rollout/zero_std_groups"] == 1.0 and exp.stats["rollout/dropped_groups"] == 0.5


def test_concat_pads_prompts_left_and_responses_right():
    def ro(P, R, B, pad):
        return Rollout(prompt_ids=torch.full((B, P), 7), prompt_mask=torch.ones(B, P, dtype=torch.long),
                       response_ids=torch.full((B, R), 9), response_mask=torch.ones(B, R), eos=torch.ones(B).bool(),
                       prompts=["p"] * B, responses=["r"] * B, engine_logprobs=torch.full((B, R), -1.0))

    out = concat([ro(2, 3, 1, 0), ro(4, 1, 2, 0)], pad_id=0)
    assert out.prompt_ids.tolist() == [[0, 0, 7, 7], [7, 7, 7, 7], [7, 7, 7, 7]]
    assert out.prompt_mask.tolist() == [[0, 0, 1, 1], [1] * 4, [1] * 4]
    assert out.response_ids.tolist() == [[9, 9, 9], [9, 0, 0], [9, 0, 0]]
    assert out.engine_logprobs.tolist() == [[-1.0] * 3, [-1.0, 0.0, 0.0], [-1.0, 0.0, 0.0]]
    assert out.responses == ["r"] * 3 and out.old_logprobs is None and out.eos.tolist() == [True] * 3


# ---------------------------------------------------------------------------- overlong, length, scaling
def test_truncated_answers_leave_the_actors_loss(tmp_path):
    """The masked loss over the whole minibatch equals the loss over its answers that ended, alone."""
    cfg = tiny_ppo(tmp_path, mask_truncated_completions=True, entropy_coef=0.01, **GRPO)
    trainer = PPOTrainer(cfg, progress=False)
    ro = trainer.experience.make(trainer.model, 1).rollout
    ro.advantages = torch.randn(ro.response_mask.shape, generator=torch.Generator().manual_seed(0)) * ro.response_mask
    ro.eos = torch.tensor([True, False, False, True] * 4)
    ro = ro.to(trainer.accelerator.device)  # the update's device, as `_update` moves each micro-batch
    for agg in ("token-mean", "seq-mean-token-mean"):
        trainer.cfg.loss_aggregation = agg
        with torch.no_grad():
            logprobs, entropy, _ = trainer.model(ro)
        scale = kept_rows_scale(ro.response_mask, ro.eos.float(), agg)
        masked, stats = trainer._policy_loss(ro, 0.04, logprobs, entropy, scale)
        rows = ro.eos.nonzero().flatten().cpu()
        alone, _ = trainer._policy_loss(ro.select(rows), 0.04, logprobs[rows], entropy[rows])
        assert masked.item() == pytest.approx(alone.item(), abs=1e-6) and "policy/kl_loss" in stats


def test_overlong_penalty_shapes_the_scores(tmp_path):
    cfg = tiny_ppo(tmp_path, **KNOBS["overlong"])
    trainer = PPOTrainer(cfg, progress=False)
    exp = trainer.experience.make(trainer.model, 1)
    ro = exp.rollout
    penalty = overlong_penalty(ro.lengths, 8, 4, 0.5)
    assert penalty.min() < 0  # some answers reach the buffer
    assert torch.allclose(ro.scores, exp.raw_scores - 0.1 * (~ro.eos).float() + penalty)
    assert exp.stats["objective/overlong_penalty"] == pytest.approx(penalty.mean().item())


def test_length_penalty_lowers_the_reward_by_its_share(tmp_path):
    cfg = tiny_ppo(tmp_path, iterations=1, length_penalty=0.01)
    PPOTrainer(cfg, progress=False).train()
    (m,) = records(cfg)
    assert m["objective/length_penalty"] == pytest.approx(-0.01 * m["rollout/length_mean"])
    assert m["objective/reward"] == pytest.approx(m["objective/score"] + m["objective/non_score_reward"]
                                                  + m["objective/length_penalty"], abs=1e-5)


def test_scale_rewards_batch_reaches_the_advantages(tmp_path):
    trainer = PPOTrainer(tiny_ppo(tmp_path, **KNOBS["scale-batch"]), progress=False)
    seen = []
    make = trainer.experience.make
    trainer.experience.make = lambda model, it: seen.append(make(model, it)) or seen[-1]
    trainer.step(1)
    ro = seen[0].rollout
    want = group_advantages(masked_sum(ro.rewards, ro.response_mask, dim=1), 4, "grpo", scale="batch")
    assert torch.allclose(ro.advantages, want.unsqueeze(1) * ro.response_mask)


# ---------------------------------------------------------------------------- one-line errors
@pytest.mark.parametrize("kw, message", [
    (dict(reward_weights=[1.0]), "ppo.reward_weights: given without reward_funcs"),
    (dict(reward_funcs=["task:tiny-target"]), "ppo.reward_funcs: give the reward once"),
    (dict(reward="task:positive-review", reward_funcs=["task:tiny-target", 3]), r"ppo.reward_funcs\[1\]: must be a"),
    (dict(reward="task:positive-review", reward_funcs=["a:b"], reward_weights=[1, 2]),
     "ppo.reward_weights: 2 weights for 1 reward functions"),
    (dict(reward="task:positive-review", reward_funcs=["a:b"], reward_weights=["x"]),
     r"ppo.reward_weights\[0\]: must be a number, got 'x'"),
    (dict(reward="task:positive-review", reward_funcs=["judge:vader"], monitor_judges={"reward_vader": "judge:vader"}),
     "ppo.monitor_judges: reward_vader is also a reward_funcs term's name"),
    (dict(clip_low=1.5), r"ppo.clip_low: must be in \[1e-06, 1.0\]"),
    (dict(clip_high=0.0), "ppo.clip_high: must be in"),
    (dict(dual_clip=1.0), "ppo.dual_clip: must be > 1"),
    (dict(policy_loss="cispo", clip_high=0.28), "ppo.clip_high: bounds PPO's clipped ratio"),
    (dict(policy_loss="cispo", cispo_max_weight=0.5), "ppo.cispo_max_weight: must be >= 1"),
    (dict(cispo_min_weight=-0.1), "ppo.cispo_min_weight: must be in"),
    (dict(scale_rewards="batch"), "ppo.scale_rewards: divides grpo's and dr_grpo's"),
    (dict(dynamic_sampling=True), "ppo.dynamic_sampling: drops groups of samples"),
    (dict(GRPO, dynamic_sampling=True, dynamic_sampling_rounds=0), "ppo.dynamic_sampling_rounds: must be > 0"),
    (dict(overlong_buffer=9), r"ppo.overlong_buffer: 9 tokens is more than generation.max_new_tokens \(8\)"),
    (dict(overlong_buffer=-1), "ppo.overlong_buffer: must be >= 0"),
    (dict(overlong_penalty=-1.0), "ppo.overlong_penalty: must be >= 0"),
    (dict(length_penalty=-0.1), "ppo.length_penalty: must be >= 0"),
])
def test_each_bad_knob_is_one_config_error(tmp_path, kw, message):
    with pytest.raises(ConfigError, match=message) as e:
        validate(tiny_ppo(tmp_path, **kw))
    assert "\n" not in str(e.value)
