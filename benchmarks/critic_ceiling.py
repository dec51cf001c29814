"""How much of a PPO run's return variance a critic could explain: the ceiling to read `value/explained_variance`
against.

    .venv/bin/python benchmarks/critic_ceiling.py runs/demo/ppo            # the demo's PPO run, newest checkpoint
    .venv/bin/python benchmarks/critic_ceiling.py RUN --prompts 32 --samples 4 --batches 4

The run's newest checkpoint is resumed in a scratch copy (the run itself is only read): actor, value head,
reward normalisation and KL coefficient as they were. Nothing is trained. It samples `--batches` rollouts of
`--prompts` prompts x `--samples` responses each with the run's own settings, computes per-token rewards and
GAE returns exactly as the trainer does, and prints:

- the trained critic's explained variance on these fresh samples (what the run logs, on more data);
- a linear head's ceiling on the same features: ridge regression from the actor's last hidden state (what the
  shared value head reads) to the returns, fitted on 75% of the prompts and scored on the other 25%, with the
  ridge strength chosen on those held-out prompts (so the ceiling is, if anything, optimistic); overall, at the
  first response token and at the last;
- a model-free ceiling at the first response token: the share of the return's variance that lies between prompts
  (samples of one prompt share everything a critic can see before the first token; what differs between them
  no critic can predict there), from the `--samples` responses per prompt with the within-prompt noise removed;
- how much of the return variance the per-token KL penalty adds (returns with the run's beta against beta 0).

The critic's number is on prompts it was trained on; the ridge's on prompts held out from its fit, so the two
bracket rather than bound each other. Measured (2-core AMD EPYC with AVX-512 BF16, OMP_NUM_THREADS=1, beside
another job, 2026-11-24): `make demo`'s PPO run at its last checkpoint, `--prompts 32 --samples 4 --batches 4`
(512 responses, 13,686 tokens): critic 0.13 over all tokens (0.10 at the first token); ridge 0.17 over all
tokens, 0.04 at the first, 0.20 at the last; between-prompt share at the first token 0.23; return variance
0.270 with the KL penalty, 0.284 without. So the value head explains about as much as any linear head on its
features, and most of the return is decided by what gets sampled after the first token.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch


def ridge_r2(x_fit, y_fit, x_test, y_test, lam: float) -> float:
    """R^2 on the test rows of ridge regression (with intercept) fitted on the fit rows."""
    mu, ym = x_fit.mean(0), y_fit.mean()
    a, b = x_fit - mu, y_fit - ym
    w = torch.linalg.solve(a.T @ a + lam * torch.eye(a.shape[1], dtype=a.dtype), a.T @ b)
    pred = (x_test - mu) @ w + ym
    return float(1 - ((y_test - pred) ** 2).sum() / ((y_test - y_test.mean()) ** 2).sum())


def explained_variance(pred, y) -> float:
    return float(1 - (y - pred).var() / y.var())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a PPO run dir with a critic and a checkpoint (e.g. runs/demo/ppo)")
    p.add_argument("--prompts", type=int, default=32, help="prompts per batch")
    p.add_argument("--samples", type=int, default=4, help="responses per prompt (>= 2)")
    p.add_argument("--batches", type=int, default=4)
    args = p.parse_args()

    import yaml

    from quartet.algo import explained_variance as masked_ev
    from quartet.algo import token_rewards
    from quartet.config import PPOConfig, from_dict
    from quartet.trainers import checkpoint as ckpt
    from quartet.trainers.ppo import PPOTrainer
    from quartet.trainers.ppo_roles import actor_logprobs

    run = Path(args.run)
    newest = ckpt.list_checkpoints(run)
    if not newest or not (run / "config.yaml").is_file():
        raise SystemExit(f"error: {run}: not a PPO run with a checkpoint (config.yaml, checkpoints/iter-N)")
    scratch = Path(tempfile.mkdtemp(prefix="quartet-ceiling-"))
    try:
        for name in (".quartet-run", "metrics.jsonl", "samples.jsonl"):
            if (run / name).exists():
                shutil.copy(run / name, scratch / name)
        shutil.copytree(newest[-1], scratch / "checkpoints" / newest[-1].name)
        raw = {**yaml.safe_load((run / "config.yaml").read_text()), "output_dir": str(scratch)}
        (scratch / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        start = int(newest[-1].name.split("-")[1])
        cfg = from_dict(PPOConfig, raw)  # the run's own settings, so the checkpoint resumes
        trainer = PPOTrainer(cfg, resume=True, progress=False)
        if trainer.roles.critic is None or not trainer.roles.shared_critic:
            raise SystemExit("error: this measures a shared value head (critic: shared); the run has none")
        # sample --samples responses to each of --prompts prompts (the run's own G and batch otherwise)
        trainer.cfg.samples_per_prompt, trainer.cfg.rollout_batch_size = args.samples, args.prompts
        moments = trainer.moments.state_dict() if trainer.moments is not None else None
        beta = trainer.kl_ctl.value
        feats, rets, rets0, vals, masks, groups = [], [], [], [], [], []
        for k in range(args.batches):
            if moments is not None:  # the run's normalisation, not one updated by these samples
                trainer.moments.load_state_dict(moments)
            exp = trainer.experience.make(trainer.model, start + 1 + k)
            ro, mask = exp.rollout, exp.rollout.response_mask
            returns = {}
            for b in (beta, 0.0):
                rewards, _ = token_rewards(ro.scores, ro.old_logprobs, ro.ref_logprobs, mask, b, cfg.kl_estimator)
                returns[b] = trainer.estimator(rewards, mask, values=ro.values, group_size=args.samples,
                                               gamma=cfg.gamma, lam=cfg.lam)[1]
            hidden = []
            with torch.no_grad():
                for i in range(0, len(ro), cfg.micro_batch_size):
                    mb = ro.select(list(range(i, min(i + cfg.micro_batch_size, len(ro)))))
                    with trainer.accelerator.autocast():
                        hidden.append(actor_logprobs(trainer.roles.actor, mb, trainer.roles.temperature,
                                                     hidden=True)[2].float())
            width = max(h.shape[1] for h in hidden)
            feats.append(torch.cat([torch.nn.functional.pad(h, (0, 0, 0, width - h.shape[1])) for h in hidden]))
            rets.append(returns[beta]), rets0.append(returns[0.0]), vals.append(ro.values), masks.append(mask)
            groups.append(torch.arange(len(ro)) // args.samples + k * args.prompts)
            print(f"batch {k + 1}/{args.batches}: {len(ro)} responses", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def flat(parts):
        width = max(x.shape[1] for x in parts)
        return torch.cat([torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, width - x.shape[1])) for x in parts])

    x, y, y0, v, m = flat(feats).double(), flat(rets).double(), flat(rets0).double(), flat(vals).double(), flat(masks)
    group = torch.cat(groups)
    real = m.bool()
    n_groups = int(group.max()) + 1
    test_groups = torch.randperm(n_groups, generator=torch.Generator().manual_seed(0))[: n_groups // 4]
    is_test = torch.isin(group, test_groups)[:, None].expand_as(real)
    pos = m.cumsum(1) - 1  # 0 at the first response token
    last = pos == (m.sum(1, keepdim=True) - 1)

    def ceiling(select) -> float:
        fit, test = real & select & ~is_test, real & select & is_test
        return max(ridge_r2(x[fit], y[fit], x[test], y[test], lam) for lam in (1e-2, 1e-1, 1, 10, 100, 1e3, 1e4))

    first = y[:, 0]  # returns at the first response token, per response
    means = torch.stack([first[group == g].mean() for g in range(n_groups)])
    within = torch.stack([first[group == g].var() for g in range(n_groups)]).mean()
    between = max(float(means.var() - within / args.samples), 0.0)
    result = {
        "responses": int(len(y)), "tokens": int(real.sum()), "beta": beta,
        "critic_ev_all_tokens": float(masked_ev(v.float(), y.float(), m).item()),
        "critic_ev_first_token": explained_variance(v[:, 0], first),
        "linear_ceiling_all_tokens": ceiling(torch.ones_like(real)),
        "linear_ceiling_first_token": ceiling(pos == 0),
        "linear_ceiling_last_token": ceiling(last),
        "between_prompt_share_first_token": between / float(first.var()),
        "return_var_with_kl": float(y[real].var()), "return_var_without_kl": float(y0[real].var()),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
