"""The policy-gradient family in the one trainer: closed forms on a one-token bandit, learning on
tiny-target for every estimator, critic-free runs through the doctor and the report, presets and
config errors."""

from __future__ import annotations

import json
import math
import string
import subprocess
import sys

import pytest
import torch
from test_ppo import _exact_objective

from builders import TINY, tiny_ppo
from quartet.algo import ESTIMATORS
from quartet.config import PPOConfig, from_dict, load_config
from quartet.errors import ConfigError
from quartet.trainers.ppo import PRESETS, PPOTrainer

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA

BETA = 0.5


def bandit_cfg(tmp_path, advantage: str, **overrides) -> PPOConfig:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "pick"}) + "\n" for _ in range(64)))
    base = {
        "reward": "ppo_rewards:letter", "prompts.path": str(prompts), "reference": TINY, "advantage": advantage,
        "critic": None, "iterations": 60, "rollout_batch_size": 32, "samples_per_prompt": 4,
        "minibatch_size": 64, "micro_batch_size": 64, "ppo_epochs": 4, "kl_coef": BETA,
        "generation.max_new_tokens": 1, "generation.batch_size": 128, "optim.lr": 1e-2,
    }
    base.update(overrides)
    return tiny_ppo(tmp_path, **base)


def _letter_table(trainer):
    tok = trainer.roles.tokenizer
    ids = torch.tensor([trainer.experience.prompt_ids[0]], device=trainer.accelerator.device)
    with torch.no_grad():
        logp = trainer.roles.actor(input_ids=ids).logits[0, -1].double().log_softmax(-1).cpu()
        ref = trainer.roles.reference(input_ids=ids).logits[0, -1].double().log_softmax(-1).cpu()
    texts = [tok.decode([a], skip_special_tokens=True).strip() for a in range(logp.shape[0])]
    r = torch.tensor([1.0 if len(t) == 1 and t in string.ascii_lowercase else 0.0 for t in texts], dtype=torch.float64)
    return logp, ref, r


@pytest.mark.parametrize("advantage", ["rloo", "dr_grpo", "reinforce_pp", "grpo"])
def test_k1_kl_in_the_reward_reaches_the_regularised_optimum(tmp_path, advantage):
    """J = E[r] - beta KL(pi || pi_ref) is maximised by pi* ~ pi_ref exp(r / beta), J* = beta log E_ref exp(r / beta).

    rloo, dr_grpo and reinforce_pp are unbiased estimators of this gradient. grpo divides each group by its
    std; measured here it reaches J* as well (0.6% of the gap at 60 iterations): with the KL in the reward
    the division rescales reward and penalty together, so the fixed point stays where it was.
    """
    trainer = PPOTrainer(bandit_cfg(tmp_path, advantage), progress=False)
    j0, j_star, j_ref = _exact_objective(trainer, BETA)
    assert j0 == pytest.approx(j_ref)
    assert trainer.roles.critic is None
    trainer.train()
    j, _, _ = _exact_objective(trainer, BETA)
    assert j >= j_star - 0.05 * abs(j_star - j_ref), f"{advantage}: J={j:.4f} J*={j_star:.4f} J_ref={j_ref:.4f}"


def test_k3_kl_in_the_loss_follows_the_reverse_kl(tmp_path):
    """The k3 estimate as a loss term, on tokens drawn from pi, has the gradient of KL(pi_ref || pi), not of
    KL(pi || pi_ref): sum_a (pi(a) - pi_ref(a)) grad log pi(a). Its fixed point maximises
    F = E[r] - beta KL(pi_ref || pi), whose optimum pays for reward more than pi* does. Measured with rloo
    (an unbiased baseline): within 1.5% of the gap to F* after 150 iterations. (dr_grpo's baseline includes the
    sample itself, which scales the policy gradient, but not this loss term, by (G - 1) / G: its fixed point is
    F's at beta G / (G - 1), 8% short of F* here; with the KL in the reward both scale and nothing moves.)"""
    trainer = PPOTrainer(bandit_cfg(tmp_path, "rloo", kl_in_reward=False, kl_estimator="k3", iterations=150),
                         progress=False)
    trainer.train()
    logp, ref, r = _letter_table(trainer)

    def F(logits):  # E[r] - beta KL(pi_ref || pi)
        lp = logits.log_softmax(-1)
        return (lp.exp() * r).sum() - BETA * (ref.exp() * (ref - lp)).sum()

    x = ref.clone().requires_grad_(True)  # F* by gradient ascent on the logits of a free softmax
    opt = torch.optim.Adam([x], lr=0.05)
    for _ in range(3000):
        opt.zero_grad()
        (-F(x)).backward()
        opt.step()
    f, f_star, f_ref = float(F(logp)), float(F(x.detach())), float(F(ref))
    assert f >= f_star - 0.05 * abs(f_star - f_ref), (f, f_star, f_ref)
    # pi* ~ pi_ref exp(r / beta) holds E[r] = 0.453 here; the reverse-KL optimum more than 0.5
    pi_star = (ref + r / BETA).softmax(-1)
    assert float((logp.exp() * r).sum()) > float((pi_star * r).sum())


@pytest.mark.parametrize("advantage", sorted(ESTIMATORS))
def test_every_estimator_learns_tiny_target(tmp_path, advantage):
    group = ESTIMATORS[advantage].group
    # ReMax (one sample per prompt, the greedy answer's score as baseline) learns slowest here: after 30
    # iterations seeds 0-3 reached 0.07-0.145 against a bar of 0.09-0.144 (2 failed), after 60 all of
    # seeds 0-9 cleared it (0.114-0.235 against 0.09-0.124). Any change in rounding draws other trajectories:
    # with the old log-probs taken from the sampling pass (2026-11-26) 60 iterations cleared it for 3 of seeds
    # 0-4 (0.075-0.272 against 0.1-0.14), and 4 of 5 without; after 100, 7 of seeds 0-7 either way (the one
    # short, seed 4, started high: 0.085-0.115 against 0.137), this test's seed 0 at 0.14-0.16 against 0.11
    iterations = 100 if advantage == "remax" else 30
    cfg = tiny_ppo(
        tmp_path, advantage=advantage, critic="shared" if advantage == "gae" else None, iterations=iterations,
        rollout_batch_size=8 if group else 32, samples_per_prompt=4 if group else 1, minibatch_size=16,
        micro_batch_size=16, ppo_epochs=2, **{"generation.batch_size": 32},
    )
    trainer = PPOTrainer(cfg, progress=False)
    actor0 = {n: p.detach().clone() for n, p in trainer.roles.actor.named_parameters()}
    result = trainer.train()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    scores = [r["objective/score"] for r in records]
    assert len(records) == iterations
    assert all(math.isfinite(v) for r in records for v in r.values() if isinstance(v, float))
    assert sum(scores[-5:]) / 5 > 2 * max(sum(scores[:5]) / 5, 0.05), (advantage, scores)
    assert any(not torch.equal(actor0[n], p) for n, p in trainer.roles.actor.named_parameters())
    has_values = any("value/loss" in r for r in records)
    assert has_values == (advantage == "gae")


def test_critic_free_run_through_doctor_and_report(tmp_path):
    from quartet.monitor.doctor import diagnose_run
    from quartet.monitor.report import write_report

    cfg = tiny_ppo(tmp_path, advantage="rloo", critic=None, samples_per_prompt=4, rollout_batch_size=4,
                   iterations=6, minibatch_size=16, micro_batch_size=8)
    result = PPOTrainer(cfg, progress=False).train()
    assert not (result.run_dir / "value_head.safetensors").exists() and not (result.run_dir / "critic").exists()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not any(k.startswith("value/") for r in records for k in r)
    # the random tiny model never says EOS: that finding is true; nothing may fire about a critic it lacks
    assert {f.rule for f in diagnose_run(result.run_dir)} <= {"truncation"}
    html = write_report(result.run_dir).read_text()
    assert "objective/score" in html or "score" in html


def test_group_samples_are_contiguous_and_share_their_prompt(tmp_path):
    cfg = tiny_ppo(tmp_path, advantage="grpo", critic=None, samples_per_prompt=4, rollout_batch_size=4,
                   minibatch_size=16, micro_batch_size=8, iterations=1)
    trainer = PPOTrainer(cfg, progress=False)
    exp = trainer.experience.make(trainer.model, 1)
    ro = exp.rollout
    assert len(ro) == 16
    for g in range(4):
        rows = range(4 * g, 4 * g + 4)
        assert len({repr(ro.prompts[i]) for i in rows}) == 1
        assert all(torch.equal(ro.prompt_ids[4 * g], ro.prompt_ids[i]) for i in rows)


def test_remax_scores_one_greedy_response_per_prompt(tmp_path):
    cfg = tiny_ppo(tmp_path, advantage="remax", critic=None, rollout_batch_size=8, minibatch_size=8,
                   micro_batch_size=8, iterations=1)
    trainer = PPOTrainer(cfg, progress=False)
    exp = trainer.experience.make(trainer.model, 1)
    greedy = trainer.experience.engine.generate(*_prompt_batch(trainer, 1), greedy=True)
    want = trainer.roles.scorer(exp.rollout.prompts, greedy.responses)
    assert torch.allclose(exp.greedy_scores, want)
    again = trainer.experience.engine.generate(*_prompt_batch(trainer, 1), greedy=True)
    assert again.responses == greedy.responses  # greedy: no randomness


def _prompt_batch(trainer, iteration):
    from quartet.data import left_pad

    batch = trainer.experience.batch_indices(iteration)
    return left_pad([trainer.experience.prompt_ids[i] for i in batch], trainer.roles.tokenizer.pad_token_id)


# ---------------------------------------------------------------------------- config and presets
@pytest.mark.parametrize("overrides, message", [
    ({"advantage": "grpo", "samples_per_prompt": 1}, "ppo.samples_per_prompt: advantage 'grpo' compares"),
    ({"advantage": "rloo", "samples_per_prompt": 4, "critic": "shared"}, "ppo.critic: advantage 'rloo' uses no critic"),
    ({"advantage": "gae", "critic": "none"}, "ppo.critic: advantage 'gae' needs a critic"),
    ({"samples_per_prompt": 3, "rollout_batch_size": 4, "minibatch_size": 8},
     "ppo.minibatch_size: 8 does not divide the 12 sequences"),
    ({"advantage": "ppo2"}, "advantage: must be one of"),
    ({"ratio_level": "seq"}, "ratio_level: must be one of"),
])
def test_config_errors_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(PPOConfig, overrides=[f"{k}={json.dumps(v)}" for k, v in overrides.items()])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_presets_are_the_same_trainer_with_paper_defaults():
    grpo = load_config(PPOConfig, defaults=PRESETS["grpo"])
    assert (grpo.advantage, grpo.critic_kind, grpo.kl_in_reward, grpo.kl_estimator) == ("grpo", "none", False, "k3")
    assert grpo.samples_per_prompt >= 2 and not grpo.whiten
    rloo = load_config(PPOConfig, overrides=["samples_per_prompt=2"], defaults=PRESETS["rloo"])
    assert (rloo.advantage, rloo.samples_per_prompt, rloo.kl_in_reward) == ("rloo", 2, True)
    ppo = from_dict(PPOConfig, {})
    assert (ppo.advantage, ppo.critic_kind, ppo.whiten) == ("gae", "separate", True)


def test_quartet_grpo_command_runs_the_preset(tmp_path):
    out = tmp_path / "grpo"
    run = subprocess.run(
        [sys.executable, "-m", "quartet.cli", "grpo", f"policy={TINY}", "reward=task:tiny-target",
         "prompts.path=task:tiny-target/train", f"output_dir={out}", "iterations=2", "rollout_batch_size=4",
         "minibatch_size=8", "micro_batch_size=8", "generation.max_new_tokens=4", "precision=fp32"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    saved = (out / "config.yaml").read_text()
    assert "advantage: grpo" in saved and "kl_estimator: k3" in saved
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert (out / "model" / "model.safetensors").is_file()
