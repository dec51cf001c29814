"""Scoring rollouts: a reward model or any reward callable, then penalties and normalisation.

`Scorer` hides which kind of reward is in use. A reward model may have its own tokenizer: the
responses are always scored as text (prompt and response rendered with the *reward model's* chat
template and re-encoded), so an actor and a reward model from different families work together.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from quartet.data import prompt_text, render_conversation
from quartet.errors import ConfigError
from quartet.judges.bounded import JUDGE_TIMEOUT
from quartet.models import load_reward_model, precast_linears
from quartet.models.precision import compute_device
from quartet.models.reward import check_trained_reward_model
from quartet.rollout.rewards import load_reward_fn


def is_reward_model_spec(spec: str) -> bool:
    """A reward-model directory or the `minilm` alias, as opposed to `task:<name>` / `module:function`."""
    if spec == "minilm" or Path(spec).is_dir():
        return True
    return False


def _missing_dir(spec: str) -> bool:
    """A path (it has a slash, and no `task:` / `module:function` colon) that does not exist."""
    return ("/" in spec or os.sep in spec) and ":" not in spec and not Path(spec).exists()


def check_reward_spec(spec: str) -> None:
    """Fail now, in one line, if ``spec`` cannot be a reward, without loading a model: a reward-model dir
    must exist, hold a trained head (see `check_trained_reward_model`), a readable config.json and whole
    weight files; a `task:<name>` must exist; a `module:function` must import and be callable (this
    imports the user's module)."""
    if _missing_dir(spec):
        raise ConfigError(f"reward '{spec}': no such reward-model directory")
    if is_reward_model_spec(spec):
        check_trained_reward_model(spec)
    else:
        load_reward_fn(spec)


class Scorer:
    """`scorer(prompts, responses) -> (B,) float32 scores` from a reward model or a reward function.

    prompts: the user's prompts (text, or chat messages); responses: decoded response text.
    """

    def __init__(self, spec: str, dtype: torch.dtype = torch.float32, batch_size: int = 32,
                 autocast: torch.dtype | None = None, timeout: float | None = JUDGE_TIMEOUT):
        """`autocast`: run a reward model's matmuls in this dtype (bf16 where the trainer autocasts to it),
        its linear layers stored in it (`models.precast_linears`); the other weights and the normalisation of
        its scores stay in `dtype`. `timeout`: seconds a user's `module:function` may take per call (the
        stage's `judge_timeout`; see quartet.judges.bounded)."""
        self.spec = spec
        self.batch_size = batch_size
        self.autocast = autocast
        self.reward_model = None
        self.fn = None
        if is_reward_model_spec(spec):
            self.reward_model = load_reward_model(spec, dtype=dtype, trained=True)
            self.reward_model.eval().requires_grad_(False).to(compute_device())
            if autocast is not None:  # it only runs under that autocast
                precast_linears(self.reward_model.model, autocast)
        else:
            if _missing_dir(spec):
                raise ConfigError(f"reward '{spec}': no such reward-model directory")
            self.fn = load_reward_fn(spec, timeout)

    def __call__(self, prompts: list, responses: list[str]) -> torch.Tensor:
        if self.reward_model is not None:
            tok = self.reward_model.tokenizer
            texts = [render_conversation(tok, p, r) for p, r in zip(prompts, responses)]
            device = next(self.reward_model.parameters()).device.type
            with torch.autocast(device, dtype=self.autocast, enabled=self.autocast not in (None, torch.float32)):
                scores = self.reward_model.score_texts(texts, batch_size=self.batch_size)
        else:
            scores = self.fn([prompt_text(p) for p in prompts], responses)
        out = torch.tensor([float(s) for s in scores], dtype=torch.float32)
        if out.shape[0] != len(responses):
            raise ConfigError(f"reward '{self.spec}' returned {out.shape[0]} scores for {len(responses)} responses")
        if not torch.isfinite(out).all():
            bad = int((~torch.isfinite(out)).nonzero()[0])
            raise ConfigError(f"reward '{self.spec}' returned a non-finite score ({out[bad].item()}) for response {bad}")
        return out

    def terms(self, prompts: list, responses: list[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the scores, {}): one reward has no terms to log apart (`RewardSum.terms` has)"""
        return self(prompts, responses), {}


ENSEMBLE_VAR = "reward_ensemble_var"
"""the name `RewardSum.terms` logs the reward models' disagreement under (rollout/reward_ensemble_var)"""


class RewardSum:
    """The weighted sum of several rewards (TRL's reward_funcs / reward_weights): `scorer(prompts, responses) -> (B,)
    float32` as a `Scorer`'s, and `terms(...)` for the sum together with each term's own scores, each term scored
    once. `terms`: (name, weight, spec) in order; `scorer_kw` go to each term's `Scorer`.

    `uncertainty_coef` > 0: the terms that are reward models form an ensemble (two or more), and the sum loses
    uncertainty_coef x the variance of their scores per response (Coste et al. 2023's uncertainty-weighted
    optimisation: a response the members disagree on is worth less, whatever their mean)."""

    def __init__(self, terms: list[tuple[str, float, str]], uncertainty_coef: float = 0.0, **scorer_kw):
        self.weights = [(name, float(weight)) for name, weight, _ in terms]
        self.scorers = {}
        for name, _, spec in terms:
            self.scorers[name] = Scorer(spec, **scorer_kw)
        self.spec = " + ".join(f"{w:g} x {spec}" for (_, w), (_, _, spec) in zip(self.weights, terms))
        self.uncertainty_coef = float(uncertainty_coef)
        self.members = [name for name, scorer in self.scorers.items() if scorer.reward_model is not None]
        if self.uncertainty_coef:
            if len(self.members) < 2:
                raise ConfigError(f"reward_uncertainty_coef: penalises the disagreement of two or more reward "
                                  f"models, and reward_funcs has {len(self.members)} ({self.spec})")
            if ENSEMBLE_VAR in self.scorers:
                raise ConfigError(f"reward_uncertainty_coef: a reward term is already named {ENSEMBLE_VAR}, the "
                                  f"name its variance is logged under; rename that term's spec")
            self.spec += f" - {self.uncertainty_coef:g} x var({', '.join(self.members)})"

    def terms(self, prompts: list, responses: list[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the weighted sum (B,) less any uncertainty penalty, {name: that term's scores (B,)}, with
        reward_ensemble_var (B,) when there is a penalty)"""
        parts = {name: self.scorers[name](prompts, responses) for name, _ in self.weights}
        total = torch.zeros(len(responses), dtype=torch.float32)
        for name, weight in self.weights:
            total = total + weight * parts[name]
        if self.uncertainty_coef:  # the population variance over the members, per response
            var = torch.stack([parts[name] for name in self.members]).var(dim=0, correction=0)
            total = total - self.uncertainty_coef * var
            parts[ENSEMBLE_VAR] = var
        return total, parts

    def __call__(self, prompts: list, responses: list[str]) -> torch.Tensor:
        return self.terms(prompts, responses)[0]


class RunningMoments:
    """Running mean / std of scores over all rollouts so far (Chan et al. parallel update)."""

    def __init__(self):
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 1 else 1.0

    def update(self, x: torch.Tensor) -> None:
        n = x.numel()
        if n == 0:
            return
        batch_mean = x.double().mean().item()
        batch_m2 = ((x.double() - batch_mean) ** 2).sum().item()
        delta = batch_mean - self.mean
        total = self.count + n
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta**2 * self.count * n / total
        self.count = total

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def shape_scores(
    scores: torch.Tensor,
    eos: torch.Tensor,
    *,
    missing_eos_penalty: float | None,
    moments: RunningMoments | None,
    clip: float | None,
    update: bool = True,
    overlong: torch.Tensor | None = None,
) -> torch.Tensor:
    """Raw scores -> the scores PPO optimises: EOS penalty and overlong penalty, then running normalisation, then
    clipping.

    scores: (B,), eos: (B,) bool. Responses cut at max_new_tokens lose `missing_eos_penalty`; `overlong`: (B,)
    penalties <= 0 added to them (DAPO's soft overlong punishment, quartet.algo.overlong_penalty). With
    `update=False` the running moments normalise without counting these scores (a baseline's scores).
    """
    out = scores.clone()
    if missing_eos_penalty is not None:
        out[~eos] -= missing_eos_penalty
    if overlong is not None:
        out = out + overlong.to(out.dtype)
    if moments is not None:
        if update:
            moments.update(out)
        out = (out - moments.mean) / max(moments.std, 1e-6)
    if clip is not None:
        out = out.clamp(-clip, clip)
    return out
