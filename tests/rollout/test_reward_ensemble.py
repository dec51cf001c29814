"""An ensemble of reward models with an uncertainty penalty (ppo.reward_uncertainty_coef, issue 40): the score is
the weighted sum of reward_funcs less coef x the population variance of the reward models' scores per response
(Coste et al. 2023), checked against a slow per-response loop; judges among the terms stay out of the variance;
coef 0 is the plain weighted sum; the PPO trainer logs the variance and optimises the penalised score."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from builders import tiny_ppo
from quartet.config import PPOConfig, validate
from quartet.errors import ConfigError
from quartet.models import load_reward_model, save_reward_model
from quartet.rollout.scoring import ENSEMBLE_VAR, RewardSum, Scorer
from quartet.trainers.ppo import PPOTrainer

TINY = "tiny:llama?hidden=32&layers=2&heads=4&vocab=300"
PROMPTS = ["Say something."] * 4
RESPONSES = ["short one", "a somewhat longer response text", "mid length", "7 is a digit"]
JUDGE = "task:tiny-target"


def reward_models(tmp_path: Path, n: int) -> list[str]:
    """n tiny reward models, each from its own seed (members that disagree), each with its own normalisation."""
    out = []
    for k in range(n):
        torch.manual_seed(k)
        rm = load_reward_model(TINY)
        rm.set_normalization(0.1 * k, 1.0 + k)
        out.append(str(save_reward_model(rm, tmp_path / f"rm{k}")))
    return out


def test_the_penalty_is_coef_times_the_members_variance_per_response(tmp_path):
    rms = reward_models(tmp_path, 3)
    terms = [("a", 0.3, rms[0]), ("b", 0.3, rms[1]), ("c", 0.4, rms[2]), ("judge", 2.0, JUDGE)]
    plain = RewardSum(terms)
    penalised = RewardSum(terms, uncertainty_coef=0.5)
    total, parts = penalised.terms(PROMPTS, RESPONSES)
    base, base_parts = plain.terms(PROMPTS, RESPONSES)
    assert ENSEMBLE_VAR not in base_parts and penalised.members == ["a", "b", "c"]
    for i in range(len(RESPONSES)):  # the slow loop: each response's three scores, their population variance
        members = [float(parts[name][i]) for name in ("a", "b", "c")]
        var = statistics.pvariance(members)
        assert var > 1e-4  # the members do disagree, so the test can see the penalty
        assert float(parts[ENSEMBLE_VAR][i]) == pytest.approx(var, rel=1e-5)
        weighted = 0.3 * members[0] + 0.3 * members[1] + 0.4 * members[2] + 2.0 * float(parts["judge"][i])
        assert float(total[i]) == pytest.approx(weighted - 0.5 * var, rel=1e-5, abs=1e-6)
        assert float(base[i]) == pytest.approx(weighted, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(parts["judge"], Scorer(JUDGE)(PROMPTS, RESPONSES))  # scored, not pooled
    assert "- 0.5 x var(a, b, c)" in penalised.spec


def test_the_penalty_needs_two_reward_models_among_the_terms(tmp_path):
    (rm,) = reward_models(tmp_path, 1)
    with pytest.raises(ConfigError, match="two or more reward models, and reward_funcs has 1") as e:
        RewardSum([("a", 1.0, rm), ("judge", 1.0, JUDGE)], uncertainty_coef=0.1)
    assert "\n" not in str(e.value)
    RewardSum([("a", 1.0, rm), ("judge", 1.0, JUDGE)])  # without the penalty the mix is fine


@pytest.mark.parametrize("kw, message", [
    (dict(reward_uncertainty_coef=-0.1), "ppo.reward_uncertainty_coef: must be >= 0"),
    (dict(reward_uncertainty_coef=0.1), "ppo.reward_uncertainty_coef: penalises the disagreement of two or more"),
    (dict(reward=PPOConfig.reward, reward_funcs=["task:tiny-target"], reward_uncertainty_coef=0.1),
     r"reward_funcs \(it has 1\)"),
])
def test_each_bad_coefficient_is_one_config_error(tmp_path, kw, message):
    with pytest.raises(ConfigError, match=message) as e:
        validate(tiny_ppo(tmp_path, **kw))
    assert "\n" not in str(e.value)


def test_ppo_optimises_the_penalised_score_and_logs_the_variance(tmp_path):
    rms = reward_models(tmp_path, 2)
    cfg = tiny_ppo(tmp_path, iterations=2, reward=PPOConfig.reward, reward_funcs=rms, reward_weights=[0.5, 0.5],
                   reward_uncertainty_coef=0.25)
    trainer = PPOTrainer(cfg, progress=False)
    before = {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}
    trainer.train()
    recs = [json.loads(x) for x in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert set().union(*recs) - {"stage", "algorithm", "step", "time"} == set(cfg.logged_metrics)
    a, b = (f"rollout/{name}" for name in cfg.reward_terms)
    for m in recs:
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float))
        assert m["rollout/reward_ensemble_var"] > 0
        assert m["objective/score"] == pytest.approx(0.5 * m[a] + 0.5 * m[b] - 0.25 * m["rollout/reward_ensemble_var"],
                                                     abs=1e-5)
    after = dict(trainer.accelerator.unwrap_model(trainer.model).named_parameters())
    assert any(not torch.equal(before[n], p) for n, p in after.items())
    assert "0.5 x " + rms[1] + " - 0.25 x the reward models' variance" in (Path(cfg.output_dir) / "summary.md").read_text()
