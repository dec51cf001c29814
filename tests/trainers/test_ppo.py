"""PPO trainer: the KL-regularised closed form, learning on tiny-target, exact resume, weights and roles."""

from __future__ import annotations

import dataclasses
import json
import math
import string

import pytest
import torch

from builders import TINY, tiny_ppo
from equivalence import LINEAR_ADAM, METRIC_TOL, update_atol
from quartet.config import validate
from quartet.errors import ConfigError
from quartet.trainers.plan import plan_forward_paths
from quartet.trainers.ppo import PPOTrainer

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA


def _params(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _force_plan(monkeypatch, **decisions) -> None:
    """Trainers made from now on run the plan their start-up computes, with `decisions` changed (trainers/plan.py)."""
    monkeypatch.setattr("quartet.trainers.ppo.plan_forward_paths",
                        lambda cfg, facts: dataclasses.replace(plan_forward_paths(cfg, facts), **decisions))


# ---------------------------------------------------------------------------- closed form
def _exact_objective(trainer: PPOTrainer, beta: float) -> tuple[float, float, float]:
    """J(pi), J*, J(pi_ref) for one-token responses to the single prompt, from exact softmaxes."""
    tok = trainer.roles.tokenizer
    ids = torch.tensor([trainer.experience.prompt_ids[0]], device=trainer.accelerator.device)
    with torch.no_grad():
        logits = trainer.roles.actor(input_ids=ids).logits[0, -1].double().cpu()
        ref_logits = trainer.roles.reference(input_ids=ids).logits[0, -1].double().cpu()
    logp, ref_logp = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    texts = [tok.decode([a], skip_special_tokens=True).strip() for a in range(logits.shape[0])]
    r = torch.tensor([1.0 if len(t) == 1 and t in string.ascii_lowercase else 0.0 for t in texts], dtype=torch.float64)
    p = logp.exp()
    j = float((p * r).sum() - beta * (p * (logp - ref_logp)).sum())
    j_star = float(beta * torch.logsumexp(ref_logp + r / beta, dim=0))
    j_ref = float((ref_logp.exp() * r).sum())
    return j, j_star, j_ref


def test_ppo_reaches_the_kl_regularised_optimum(tmp_path):
    """One-token responses with reward table r(a): pi* ~ pi_ref * exp(r / beta), J* = beta log E_ref[exp(r / beta)]."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "pick"}) + "\n" for _ in range(64)))
    beta = 0.5
    cfg = tiny_ppo(
        tmp_path,
        reward="ppo_rewards:letter",
        **{"prompts.path": str(prompts)},
        critic="separate",
        reference=TINY,
        iterations=40,
        rollout_batch_size=64,
        minibatch_size=32,
        micro_batch_size=32,
        ppo_epochs=4,
        kl_coef=beta,
        **{"generation.max_new_tokens": 1, "generation.batch_size": 64, "optim.lr": 1e-2, "critic_lr": 1e-2},
    )
    trainer = PPOTrainer(cfg, progress=False)
    j0, j_star, j_ref = _exact_objective(trainer, beta)
    assert j0 == pytest.approx(j_ref)
    trainer.train()
    j, j_star, _ = _exact_objective(trainer, beta)
    gap = abs(j_star - j_ref)
    assert j >= j_star - 0.05 * gap, f"J={j:.4f} J*={j_star:.4f} J_ref={j_ref:.4f}"


# ---------------------------------------------------------------------------- learning
def test_ppo_learns_tiny_target_and_only_trains_actor_and_critic(tmp_path):
    cfg = tiny_ppo(tmp_path, iterations=60, rollout_batch_size=32, minibatch_size=16, micro_batch_size=16,
                   ppo_epochs=4, critic="separate", reference=TINY, **{"generation.batch_size": 32})
    trainer = PPOTrainer(cfg, progress=False)
    actor0, critic0, ref0 = (_params(m) for m in (trainer.roles.actor, trainer.roles.critic, trainer.roles.reference))
    result = trainer.train()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    scores = [r["objective/score"] for r in records]
    assert len(records) == 60
    assert all(math.isfinite(v) for r in records for v in r.values() if isinstance(v, float))
    assert sum(scores[:3]) / 3 < 0.08  # 11 of 256 byte tokens score
    assert sum(scores[-3:]) / 3 > 0.2, scores  # several times the start
    assert any(not torch.equal(actor0[n], p) for n, p in trainer.roles.actor.named_parameters())
    assert any(not torch.equal(critic0[n], p) for n, p in trainer.roles.critic.named_parameters())
    assert all(torch.equal(ref0[n], p) for n, p in trainer.roles.reference.named_parameters())
    assert (result.model_dir / "model.safetensors").is_file()


def test_lora_actor_keeps_base_weights_and_reference_is_the_disabled_adapter(tmp_path):
    cfg = tiny_ppo(tmp_path, iterations=2, **{"lora.enabled": True, "lora.r": 4})
    trainer = PPOTrainer(cfg, progress=False)
    assert trainer.roles.reference is None
    assert not trainer.experience.engine.shares_weights  # the engine samples a merged copy
    base0 = {n: p.detach().clone() for n, p in trainer.roles.actor.named_parameters() if not p.requires_grad}
    lora0 = {n: p.detach().clone() for n, p in trainer.roles.actor.named_parameters() if p.requires_grad}
    metrics = trainer.step(1).metrics
    # before any update the actor equals its reference: KL is exactly zero
    assert metrics["objective/kl"] == pytest.approx(0.0, abs=1e-6)
    trainer.step(2)
    named = dict(trainer.roles.actor.named_parameters())
    assert all(torch.equal(base0[n], named[n]) for n in base0)
    assert any(not torch.equal(lora0[n], named[n]) for n in lora0)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_lora_on_the_top_layers_runs_the_frozen_bottom_once_per_rollout(tmp_path, monkeypatch, recompute):
    """`lora.layers_to_transform` above layer 0: the layers below run once per rollout (models/trunk.py), not in
    the old-log-prob, reference and every update forward; the step is that of full forwards (with activation
    checkpointing too, which runs the top layers' forwards again in the backward)."""
    tiny2 = TINY.replace("layers=1", "layers=2")
    lora = {"policy": tiny2, "lora.enabled": True, "lora.r": 4, "lora.layers_to_transform": [1],
            "activation_checkpointing": recompute, **LINEAR_ADAM}
    runs = {}
    for name in ("trunk", "full"):
        if name == "full":
            _force_plan(monkeypatch, trunk=False)
        trainer = PPOTrainer(tiny_ppo(tmp_path / name, iterations=2, **lora), progress=False)
        assert trainer.plan.trunk == (trainer.experience.trunk is not None) == (name == "trunk")
        bottom = trainer.roles.actor.get_base_model().model.layers[0]
        calls = []
        bottom.register_forward_hook(lambda *a, calls=calls: calls.append(1))
        base0 = {n: p.detach().clone() for n, p in trainer.roles.actor.named_parameters() if not p.requires_grad}
        lora0 = {n: p.detach().clone() for n, p in trainer.roles.actor.named_parameters() if p.requires_grad}
        metrics = trainer.step(1).metrics
        named = dict(trainer.roles.actor.named_parameters())
        assert all(torch.equal(base0[n], named[n]) for n in base0)
        assert any(not torch.equal(lora0[n], named[n]) for n in lora0)
        assert all(math.isfinite(v) for v in metrics.values())
        after = {n: p.detach().clone() for n, p in named.items() if p.requires_grad}
        runs[name] = (lora0, after, metrics), len(calls)
    (step_trunk, calls_trunk), (step_full, calls_full) = runs["trunk"], runs["full"]
    assert calls_trunk == 16 // 4  # one forward per micro-batch of the rollout
    assert calls_full == 16 // 4 * 2 + 2 * 16 // 4  # old log-probs, reference, 2 epochs of 4 micro-batches
    assert step_trunk[2]["objective/kl"] == pytest.approx(0.0, abs=1e-6)  # the reference ran on the trunk too
    # the adapters (under PEFT's "base_model." names) moved the same way; the shared value head is not the actor's
    _assert_same_update(step_full, step_trunk, keys=("policy/loss", "value/loss", "policy/clipfrac", "policy/entropy"),
                        roles=("base_model",))


@pytest.mark.parametrize("critic", ["shared", "separate"])
def test_critic_warmup_trains_only_the_critic_first(tmp_path, critic):
    cfg = tiny_ppo(tmp_path, iterations=3, critic=critic, critic_warmup=2, reference=TINY,
                   **{"lora.enabled": critic == "shared", "lora.r": 4})
    trainer = PPOTrainer(cfg, progress=False)
    actor, value = trainer.roles.actor, trainer.roles.critic
    trained = {n for n, p in actor.named_parameters() if p.requires_grad}
    before = _params(actor), _params(value)
    for it in (1, 2):
        metrics = trainer.step(it).metrics
        assert metrics["optim/actor_frozen"] == 1.0
        assert all(torch.equal(before[0][n], p) for n, p in actor.named_parameters()), f"actor moved at {it}"
        assert any(not torch.equal(before[1][n], p) for n, p in value.named_parameters()), f"critic still at {it}"
        assert all(math.isfinite(v) for v in metrics.values())
    assert trainer.step(3).metrics["optim/actor_frozen"] == 0.0
    assert any(not torch.equal(before[0][n], p) for n, p in actor.named_parameters() if n in trained)


def test_critic_warmup_needs_a_critic_and_actor_iterations(tmp_path):
    with pytest.raises(ConfigError, match="critic_warmup: 1 iterations of critic-only training, but this run has no"):
        validate(tiny_ppo(tmp_path, critic="none", advantage="grpo", samples_per_prompt=2, critic_warmup=1))
    with pytest.raises(ConfigError, match=r"critic_warmup: 3 must be below iterations \(3\)"):
        validate(tiny_ppo(tmp_path, critic_warmup=3))


# ---------------------------------------------------------------------------- resume
def test_resume_repeats_the_uninterrupted_run(tmp_path, monkeypatch):
    common = dict(iterations=4, save_every=2, critic="separate", reference=TINY, reward_norm=True, adaptive_kl=True)
    full = PPOTrainer(tiny_ppo(tmp_path / "a", **common), progress=False).train()

    crashing = PPOTrainer(tiny_ppo(tmp_path / "b", **common), progress=False)
    real_step = crashing.step

    def step(iteration):
        if iteration == 3:
            raise KeyboardInterrupt
        return real_step(iteration)

    monkeypatch.setattr(crashing, "step", step)
    with pytest.raises(KeyboardInterrupt):
        crashing.train()
    resumed = PPOTrainer(tiny_ppo(tmp_path / "b", **common), resume=True, progress=False)
    assert resumed.start_iteration == 2
    resumed.train()

    def steps(run_dir):
        out = {}
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            out[rec["step"]] = {k: v for k, v in rec.items() if not k.startswith(("timing/", "memory/", "time"))}
        return out

    a, b = steps(full.run_dir), steps(tmp_path / "b" / "ppo")
    assert sorted(b) == [1, 2, 3, 4]
    for it in (3, 4):
        assert a[it] == b[it], it


def test_existing_run_needs_resume(tmp_path):
    cfg = tiny_ppo(tmp_path, iterations=1, save_every=1)  # save_every: 0 keeps no checkpoint to continue from
    PPOTrainer(cfg, progress=False).train()
    with pytest.raises(ConfigError, match="--resume"):
        PPOTrainer(cfg, progress=False)


# ---------------------------------------------------------------------------- live doctor
def test_reward_hacking_is_flagged_and_stop_on_ends_the_run(tmp_path):
    """beta = 0 and a reward that pays for repeating one character: the doctor sees distinct-n fall as score rises."""
    cfg = tiny_ppo(tmp_path, reward="ppo_rewards:repeated_char", kl_coef=0.0, iterations=40,
                   rollout_batch_size=32, minibatch_size=16, micro_batch_size=16, ppo_epochs=4,
                   stop_on=["reward_hacking_repetition"],
                   **{"generation.batch_size": 32, "generation.max_new_tokens": 12, "optim.lr": 1e-2})
    result = PPOTrainer(cfg, progress=False).train()
    assert result.stopped_by is not None and "reward_hacking_repetition" in result.stopped_by
    assert result.iterations < 40
    findings = [json.loads(line) for line in (result.run_dir / "findings.jsonl").read_text().splitlines()]
    assert "reward_hacking_repetition" in {f["rule"] for f in findings}
    assert (result.run_dir / "model" / "model.safetensors").is_file()


def test_one_backward_per_role_gives_the_joint_backwards_gradients(tmp_path, monkeypatch):
    """A separate critic on one process back-propagates the actor's loss and then the critic's (less memory
    at the peak); the update must be the one a single backward of the summed loss makes."""
    runs = {}
    cfg = {"iterations": 2, "critic": "separate", "reference": TINY, **LINEAR_ADAM}
    assert PPOTrainer(tiny_ppo(tmp_path / "planned", **cfg), progress=False).plan.split_backward
    for split in (True, False):
        _force_plan(monkeypatch, split_backward=split)
        trainer = PPOTrainer(tiny_ppo(tmp_path / str(split), **cfg), progress=False)
        before = _params(trainer.model)
        metrics = trainer.step(1).metrics
        runs[split] = (before, _params(trainer.model), metrics)
    _assert_same_update(runs[False], runs[True], keys=("policy/loss", "value/loss", "policy/clipfrac", "optim/grad_norm"))


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_makes_the_same_update(tmp_path, mode):
    """Recomputing the actor's and the separate critic's activations changes what is held, not the update."""
    runs = {}
    for m in ("none", mode):
        trainer = PPOTrainer(tiny_ppo(tmp_path / m, iterations=2, critic="separate", reference=TINY,
                                      activation_checkpointing=m, **LINEAR_ADAM), progress=False)
        on = [trainer.roles.actor.model.gradient_checkpointing,
              trainer.roles.critic.backbone.gradient_checkpointing]
        assert on == [m != "none"] * 2
        assert trainer.experience.engine.model is trainer.roles.actor  # a full fine-tune is sampled as it is
        before = _params(trainer.model)
        metrics = trainer.step(1).metrics
        runs[m] = (before, _params(trainer.model), metrics)
    _assert_same_update(runs["none"], runs[mode])


def test_lean_ops_make_the_same_update(tmp_path):
    """The lean norms and SwiGLU product (quartet.models.lean_ops) change what the backward keeps, not the update:
    both roles' layers get them, and a PPO step moves the weights as the plain modules do."""
    runs = {}
    for lean in (False, True):
        trainer = PPOTrainer(tiny_ppo(tmp_path / str(lean), iterations=2, critic="separate", reference=TINY,
                                      lean_ops=lean, **LINEAR_ADAM), progress=False)
        layers = [trainer.roles.actor.model.layers[0], trainer.roles.critic.backbone.layers[0]]
        assert [getattr(layer.mlp, "_quartet_lean", False) for layer in layers] == [lean, lean]
        before = _params(trainer.model)
        metrics = trainer.step(1).metrics
        runs[lean] = (before, _params(trainer.model), metrics)
    _assert_same_update(runs[False], runs[True])


def _prefix_prompts(tmp_path):
    """Prompts that begin with the same instruction (as a chat template's system prompt makes them)."""
    path = tmp_path / "prefixed.jsonl"
    words = "red blue green cat dog sun moon tree river stone bird fish cloud rain wind sky".split()
    path.write_text("".join(json.dumps({"prompt": f"Answer with one short word: {w}"}) + "\n" for w in words))
    return str(path)


@pytest.mark.parametrize("setup", ["separate", "lora-top-layers"])
def test_the_shared_prompt_prefix_makes_the_same_update(tmp_path, setup):
    """Running the prompts' shared beginning once (models/prefix.py) in the old-log-prob, value, reference and
    update forwards changes the work, not the step."""
    cfg = {"critic": "separate", "reference": TINY} if setup == "separate" else {
        "policy": TINY.replace("layers=1", "layers=2"), "lora.enabled": True, "lora.r": 4,
        "lora.layers_to_transform": [1]}
    runs, tokens = {}, {}
    for share in (False, True):
        trainer = PPOTrainer(tiny_ppo(tmp_path / str(share), iterations=2, share_prompt_prefix=share, **LINEAR_ADAM,
                                      **{"prompts.path": _prefix_prompts(tmp_path), "prompts.max_prompt_tokens": 64}, **cfg), progress=False)
        plan, actor = trainer.plan, trainer.roles.actor
        assert [plan.actor_shares_prefix, plan.reference_shares_prefix] == [share, share]
        assert plan.critic_shares_prefix == (share and setup == "separate")
        assert plan.trunk == (setup != "separate")
        layer = (actor.get_base_model() if setup != "separate" else actor).model.layers[-1]
        seen = []
        layer.register_forward_hook(lambda m, a, out, seen=seen: seen.append(a[0].shape[0] * a[0].shape[1]))
        before = _params(trainer.model)
        metrics = trainer.step(1).metrics
        runs[share], tokens[share] = (before, _params(trainer.model), metrics), sum(seen)
    assert tokens[True] < 0.8 * tokens[False]  # "Answer with one short word: " ran once per forward, not per row
    # the prefix's products at batch 1 round apart from the batch's in the last bits (argued with
    # _assert_same_update). With LoRA the "critic" that moves is the shared value head
    _assert_same_update(runs[False], runs[True], keys=("policy/loss", "value/loss", "optim/grad_norm", "objective/kl"))


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_on_the_shared_prompt_prefix_makes_the_same_update(tmp_path, mode):
    """The layers run again in the backward read the same read-only prefix cache: the step is that of whole rows
    without recompute."""
    runs = {}
    for name, share, recompute in (("plain", False, "none"), ("shared", True, mode)):
        trainer = PPOTrainer(tiny_ppo(tmp_path / name, iterations=2, critic="separate", reference=TINY,
                                      share_prompt_prefix=share, activation_checkpointing=recompute, **LINEAR_ADAM,
                                      **{"prompts.path": _prefix_prompts(tmp_path), "prompts.max_prompt_tokens": 64}),
                             progress=False)
        plan = trainer.plan
        assert [plan.actor_shares_prefix, plan.critic_shares_prefix, plan.reference_shares_prefix] == [share] * 3
        before = _params(trainer.model)
        metrics = trainer.step(1).metrics
        runs[name] = (before, _params(trainer.model), metrics)
    _assert_same_update(runs["plain"], runs["shared"])


def test_without_a_cache_kept_under_checkpointing_the_trained_roles_run_whole_rows(tmp_path, monkeypatch):
    """Where transformers has no switch for a layer to keep a cache under checkpointing, the actor and critic run
    whole rows; the reference, which never back-propagates, still shares the prefix."""
    import quartet.models.prefix as prefix

    monkeypatch.setattr(prefix, "keep_cache_under_checkpointing", lambda model: False)
    trainer = PPOTrainer(tiny_ppo(tmp_path, iterations=2, critic="separate", reference=TINY,
                                  activation_checkpointing="selective",
                                  **{"prompts.path": _prefix_prompts(tmp_path), "prompts.max_prompt_tokens": 64}),
                         progress=False)
    plan = trainer.plan
    assert [plan.actor_shares_prefix, plan.critic_shares_prefix, plan.reference_shares_prefix] == [False, False, True]
    assert all(math.isfinite(v) for v in trainer.step(1).metrics.values())


@pytest.mark.parametrize("setup", ["separate", "rloo", "lora"])
def test_the_sampling_passs_logprobs_make_the_same_update(tmp_path, monkeypatch, setup):
    """fp32 sampling of the fp32 actor's weights (its own, or a LoRA actor's merged into the engine's fp32 copy):
    the old log-probs come from the sampling pass, the actor runs no scoring forward (only the update's), and the
    step is the one with the actor's forward over the rollout."""
    import quartet.trainers.ppo_roles as ppo_roles

    cfg = {"reference": TINY, **LINEAR_ADAM, **{
        "separate": {"critic": "separate"}, "lora": {"critic": "separate", "lora.enabled": True, "lora.r": 4},
        "rloo": {"critic": "none", "advantage": "rloo", "samples_per_prompt": 2}}[setup]}
    calls = []
    forward = ppo_roles.actor_logprobs
    monkeypatch.setattr(ppo_roles, "actor_logprobs", lambda *a, **k: calls.append(1) or forward(*a, **k))
    runs = {}
    for reuse in (False, True):
        trainer = PPOTrainer(tiny_ppo(tmp_path / str(reuse), iterations=2, reuse_sampling_logprobs=reuse, **cfg),
                             progress=False)
        assert trainer.plan.reuse_sampling_logprobs is trainer.experience.engine.record_logprobs is reuse
        before = _params(trainer.model)
        calls.clear()
        experience = trainer.experience.make(trainer.model, 1)
        assert (len(calls) == 0) is reuse and experience.rollout.engine_logprobs is None
        assert experience.entropy.abs().sum() > 0
        sampled = (experience.rollout.old_logprobs, experience.entropy)
        calls.clear()
        metrics = trainer.step(1).metrics
        assert calls  # the update's forwards
        runs[reuse] = (before, _params(trainer.model), metrics, sampled)
    for got, want in zip(runs[True][3], runs[False][3]):  # old log-probs, entropy
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    if setup != "rloo":
        _assert_same_update(runs[False][:3], runs[True][:3])
    else:
        _assert_same_update(runs[False][:3], runs[True][:3], keys=("policy/loss",), roles=("actor",))


@pytest.mark.parametrize("overrides", [{"precision": "bf16"}, {"critic": "shared"}])
def test_the_sampling_passs_logprobs_are_not_reused_where_they_differ_or_save_nothing(tmp_path, overrides):
    """bf16 sampling rounds apart from the training forward (by more than the update's first ratios should see);
    a shared value head needs the actor's forward anyway: the actor's forward gives the old log-probs there."""
    cfg = {"critic": "separate", **overrides}
    trainer = PPOTrainer(tiny_ppo(tmp_path, **cfg), progress=False)
    assert not trainer.plan.reuse_sampling_logprobs and not trainer.experience.engine.record_logprobs


# ---------------------------------------------------------------------------- one update, two computations
# 2 epochs x 2 minibatches: 4 AdamW steps per role at lr 1e-2 (the argument is in tests/equivalence.py)
UPDATE_ATOL = update_atol(steps=4, lr=1e-2)


def _assert_same_update(plain, other, keys=("policy/loss", "value/loss", "optim/grad_norm"), roles=("actor", "critic")):
    """Two (weights before, weights after, metrics) of one PPO step in AdamW's linear regime (LINEAR_ADAM): the
    same start, the named roles moved, the same update and losses (tolerances argued above)."""
    (b0, a0, m0), (b1, a1, m1) = plain, other
    assert all(torch.equal(b1[n], b0[n]) for n in b1)
    assert {n.split(".")[0] for n in a1 if not torch.equal(a1[n], b1[n])} == set(roles)
    steps = {n: (a0[n] - b0[n], a1[n] - b1[n]) for n in a1}
    assert max(float(s0.abs().max()) for s0, _ in steps.values()) >= 20 * UPDATE_ATOL
    for n, (s0, s1) in steps.items():
        torch.testing.assert_close(s1, s0, rtol=0, atol=UPDATE_ATOL, msg=lambda m, n=n: f"{n}: {m}")
    for key in keys:
        assert m1[key] == pytest.approx(m0[key], rel=METRIC_TOL, abs=METRIC_TOL), key


def test_bf16_reference_stores_its_linears_in_bf16_and_starts_at_zero_kl(tmp_path):
    """Under bf16 autocast the frozen reference keeps its linear layers in bf16 (less memory, no cast per
    forward); its log-probs are still those of the fp32 actor under the same autocast: KL exactly 0 at first."""
    cfg = tiny_ppo(tmp_path, iterations=1, precision="bf16", critic="separate", reference=TINY)
    trainer = PPOTrainer(cfg, progress=False)
    ref = dict(trainer.roles.reference.named_parameters())
    assert ref["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert ref["model.embed_tokens.weight"].dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in trainer.roles.actor.parameters())
    metrics = trainer.step(1).metrics
    assert metrics["objective/kl"] == 0.0


def test_a_separate_critic_is_clipped_by_its_own_norm(tmp_path, monkeypatch):
    """A separate critic's gradient is clipped by its own norm, the actor's by its own (OpenRLHF and veRL give
    each its own optimizer): a value loss 1000x larger must not shrink the actor's steps, on one backward per
    role or one backward for both."""
    runs = {}
    for split in (True, False):
        _force_plan(monkeypatch, split_backward=split)
        for vf_coef in (0.1, 100.0):
            cfg = tiny_ppo(tmp_path / f"{split}-{vf_coef}", iterations=1, critic="separate", reference=TINY,
                           vf_coef=vf_coef, **{"optim.max_grad_norm": 0.05})
            trainer = PPOTrainer(cfg, progress=False)
            metrics = trainer.step(1).metrics
            runs[split, vf_coef] = (_params(trainer.roles.actor), _params(trainer.roles.critic), metrics)
    for split in (True, False):
        (actor_a, critic_a, m_a), (actor_b, critic_b, m_b) = runs[split, 0.1], runs[split, 100.0]
        assert all(torch.equal(actor_a[n], actor_b[n]) for n in actor_a)
        assert any(not torch.equal(critic_a[n], critic_b[n]) for n in critic_a)
        assert m_a["policy/grad_norm"] == m_b["policy/grad_norm"] > 0.05  # clipping was active
        assert m_b["value/grad_norm"] > 100 * m_a["value/grad_norm"] > 0.05
        assert m_b["optim/grad_norm"] == pytest.approx(math.hypot(m_b["policy/grad_norm"], m_b["value/grad_norm"]))


@pytest.mark.parametrize("field, value, message", [
    ("optim", {"lr": -1.0}, r"^optim\.lr: must be > 0, got -1\.0$"),
    ("lora", {"enabled": True, "r": 0}, r"^lora\.r: must be > 0, got 0$"),
    ("generation", {"top_p": 2.0}, r"^generation\.top_p: must be in \[1e-06, 1\.0\], got 2\.0$"),
    ("prompts", {"path": "task:tiny-target/train", "limit": 0}, r"^prompts\.limit: must be > 0, got 0$"),
], ids=["optim", "lora", "generation", "prompts"])
def test_a_bad_nested_setting_built_in_python_is_refused_before_any_model_loads(tmp_path, monkeypatch, field,
                                                                               value, message):
    """`PPOTrainer(cfg)` checks the whole config tree, as SFT and DPO do: a sub-config set in Python (never read
    from YAML) with a bad value is one ConfigError naming the dotted field, raised before a model is loaded or
    the output folder is made."""
    import dataclasses

    from quartet.trainers import ppo

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was checked")

    monkeypatch.setattr(ppo, "build_roles", no_model)
    cfg = tiny_ppo(tmp_path)
    setattr(cfg, field, dataclasses.replace(getattr(cfg, field), **value))
    with pytest.raises(ConfigError, match=message):
        PPOTrainer(cfg, progress=False)
    assert not (tmp_path / "ppo").exists()


def test_ppo_and_grpo_take_their_prompts_from_a_preference_file(tmp_path):
    """The HH file `rm` and `dpo` read (several pairs per prompt) is a prompts file to PPO: each prompt once, the
    conversation before the answers, as rm and dpo see it."""
    from quartet.data import load_preferences

    def hh(question: str, answer: str) -> str:
        return f"\n\nHuman: {question}\n\nAssistant: {answer}"

    rows = [{"chosen": hh(q, "a"), "rejected": hh(q, f"no {n}")} for q in ("pick one", "say a letter") for n in range(3)]
    pairs = tmp_path / "hh.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = [[{"role": "user", "content": "pick one"}], [{"role": "user", "content": "say a letter"}]]
    for advantage, critic in (("gae", "shared"), ("grpo", None)):
        cfg = tiny_ppo(tmp_path / advantage, reward="ppo_rewards:repeated_char", advantage=advantage, critic=critic,
                       samples_per_prompt=1 if critic else 4, iterations=2, **{"prompts.path": str(pairs)})
        trainer = PPOTrainer(cfg, progress=False)
        assert trainer.experience.prompts == prompts == [load_preferences(cfg.prompts)[i].prompt for i in (0, 3)]
        actor0 = _params(trainer.roles.actor)
        result = trainer.train()
        records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        assert len(records) == 2 and all(math.isfinite(r["objective/score"]) for r in records)
        assert any(not torch.equal(actor0[n], p) for n, p in trainer.roles.actor.named_parameters())
