"""PPO with an engine that returns its own log-probs (as vLLM does), without vLLM: an HF engine that also
reports the log-probs of its own sampling copy, optionally shifted to stand for a mismatched engine. The
trainer logs the gap every iteration and, with tis_cap, weights the policy loss by min(pi_old / pi_engine, C)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from builders import tiny_ppo
from quartet.rollout.engine import HFEngine
from quartet.trainers import ppo
from quartet.trainers.ppo_roles import actor_logprobs

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA


class LogprobHFEngine(HFEngine):
    shift = 0.0  # added to the reported log-probs: -1.0 = the engine found every token e times less likely

    def generate(self, *args, **kwargs):
        ro = super().generate(*args, **kwargs)
        with torch.no_grad():  # on the model's device (the GPU where there is one); the rollout stays on the CPU
            lp, _, _ = actor_logprobs(self.model, ro.to(next(self.model.parameters()).device), self.cfg.temperature)
        ro.engine_logprobs = (lp.to(ro.response_mask.device) + self.shift) * ro.response_mask
        return ro


def run(tmp_path, monkeypatch, shift, **overrides):
    def make(actor, tok, gen_cfg, dtype, share_weights=False, record_logprobs=False):  # its own copy, as vLLM
        engine = LogprobHFEngine(actor, tok, gen_cfg, dtype)
        engine.shift = shift
        return engine

    monkeypatch.setattr(ppo, "make_engine", make)
    cfg = tiny_ppo(tmp_path, iterations=2, **{"generation.engine": "vllm"}, **overrides)
    trainer = ppo.PPOTrainer(cfg, progress=False)
    before = {n: p.detach().clone() for n, p in trainer.roles.actor.named_parameters()}
    result = trainer.train()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    changed = any(not torch.equal(before[n], p) for n, p in trainer.roles.actor.named_parameters())
    return records, changed


def test_gap_is_logged_every_iteration_and_tis_is_off_by_default(tmp_path, monkeypatch):
    records, changed = run(tmp_path, monkeypatch, shift=0.0)
    assert len(records) == 2 and changed
    for r in records:
        assert 0 <= r["rollout/logprob_diff_mean"] < 1e-3  # fp32 copy of the same weights
        assert r["rollout/logprob_diff_max"] >= r["rollout/logprob_diff_mean"]
        assert "policy/tis_weight" not in r


def test_tis_weights_reach_the_loss(tmp_path, monkeypatch):
    one_step = {"minibatch_size": 16, "ppo_epochs": 1}  # the logged loss is that of the weights that sampled
    records, changed = run(tmp_path, monkeypatch, shift=-1.0, tis_cap=2.0, **one_step)
    assert changed
    for r in records:
        assert r["rollout/logprob_diff_mean"] == pytest.approx(1.0, abs=1e-3)
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))
        # every ratio is ~e > 2: every token weighs exactly the cap
        assert r["policy/tis_weight"] == pytest.approx(2.0, abs=1e-6)
        assert r["policy/tis_capped"] == pytest.approx(1.0)
    # a weight of 2 on every token doubles the policy loss of the unweighted run with the same samples
    plain, _ = run(tmp_path / "plain", monkeypatch, shift=-1.0, **one_step)
    assert records[0]["policy/loss"] == pytest.approx(2 * plain[0]["policy/loss"], rel=1e-6)
