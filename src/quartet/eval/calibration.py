"""Does a reward model's margin mean what Bradley-Terry says it means? Calibration by margin bin, and a temperature.

A Bradley-Terry reward model claims P(chosen > rejected) = sigmoid(d), with d = r_chosen - r_rejected. Held-out
pairs test the claim bin by bin of |d|: in a bin, the share of pairs ordered right should match the mean of
sigmoid(|d|) (`calibration_table`). Training longer widens the margins faster than it orders pairs better, so a
model can order well and claim too much; one number, a temperature T with P = sigmoid(d / T), fixes the scale
without changing any ordering (Guo et al. 2017, temperature scaling; here on pair margins).

T is fitted by maximum likelihood on held-out pairs, with one pseudo-pair either way (`fit_temperature`). Read on the same pairs it would flatter
itself, so `cross_fitted` scales each fold's margins by the T fitted on the other folds (folds by prompt): a
calibration table of those margins is an out-of-sample check, as the raw table is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

BUCKETS = (0.0, 0.5, 1.0, 2.0, 4.0, math.inf)
"""edges of the |r_c - r_r| bins of the calibration table (Bradley-Terry units: sigmoid 0.5, 0.62, 0.73, 0.88, 0.98)"""

T_RANGE = (0.05, 20.0)
"""the temperatures `fit_temperature` may return"""


def calibration_table(margins: torch.Tensor) -> list[dict]:
    """Per |margin| bin of BUCKETS: the pairs in it, the share ordered right (margin > 0) and the share Bradley-Terry
    predicts (mean sigmoid |margin|). `margins` (N,): r_chosen - r_rejected. Empty bins read None (null in
    calibration.json: JSON has no NaN, and readers other than Python's refuse it)."""
    d = margins.double()
    correct = (d > 0).double()
    table = []
    for lo, hi in zip(BUCKETS[:-1], BUCKETS[1:]):
        inside = (d.abs() >= lo) & (d.abs() < hi)
        n = int(inside.sum())
        table.append({
            "margin": f"[{lo:g}, {hi:g})",
            "count": n,
            "accuracy": float(correct[inside].mean()) if n else None,
            "predicted": float(torch.sigmoid(d.abs()[inside]).mean()) if n else None,
        })
    return table


def bt_nll(margins: torch.Tensor, temperature: float = 1.0) -> float:
    """Mean -log sigmoid(margin / T) over the pairs: Bradley-Terry's negative log-likelihood of the labels."""
    return float(-F.logsigmoid(margins.double() / temperature).mean())


def fit_temperature(margins: torch.Tensor, iters: int = 100) -> float:
    """The T in T_RANGE that minimises Bradley-Terry's log-loss of the pairs plus two pseudo-pairs, one ordered
    right and one wrong, at the pairs' mean |margin|.

    The pseudo-pairs are Laplace's rule of succession: held-out pairs all ordered right would otherwise send T to 0
    (every claim certain); with them, n such pairs at one margin d give sigmoid(d / T) = (n + 1) / (n + 2). With
    a = 1 / T each term -log sigmoid(a d) is convex in a (second derivative d^2 s(1 - s) >= 0), so the slope of the
    sum is increasing and bisection on its sign finds the one minimum."""
    d = margins.double()
    if d.numel() == 0:
        raise ValueError("fit_temperature: needs at least one pair")
    if not bool(torch.isfinite(d).all()):
        raise ValueError("fit_temperature: margins contain NaN or infinite values")
    typical = float(d.abs().mean())
    if typical == 0.0:  # every margin 0: any T reads 0.5
        return 1.0
    d = torch.cat([d, torch.tensor([typical, -typical], dtype=d.dtype)])
    lo, hi = 1.0 / T_RANGE[1], 1.0 / T_RANGE[0]  # bounds on a

    def slope(a: float) -> float:
        return float(-(d * torch.sigmoid(-a * d)).sum())

    if slope(lo) >= 0:  # the loss rises from the smallest a: as flat as allowed
        return T_RANGE[1]
    if slope(hi) <= 0:  # still falling at the largest a: as sharp as allowed
        return T_RANGE[0]
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if slope(mid) < 0:
            lo = mid
        else:
            hi = mid
    return 1.0 / (0.5 * (lo + hi))


def fold_of(groups: Sequence, folds: int = 2) -> list[int]:
    """Each row's fold: groups (prompts) in order of first appearance, dealt round-robin, so a prompt's pairs
    share one fold."""
    order: dict = {}
    for g in groups:
        order.setdefault(g, len(order))
    return [order[g] % folds for g in groups]


def cross_fitted(margins: torch.Tensor, groups: Sequence, folds: int = 2) -> tuple[torch.Tensor, list[float]]:
    """(margins / T_out, the T of each fold): each fold's margins divided by the temperature fitted on the other
    folds' pairs. `groups` (N,): each pair's prompt (any hashable key). Fewer groups than folds: the folds there
    are, none when there is one group (then every margin keeps T = 1)."""
    d = margins.double()
    if len(groups) != d.numel():
        raise ValueError(f"cross_fitted: {d.numel()} margins but {len(groups)} groups")
    folds = min(folds, len(set(groups)))
    if folds < 2:
        return d.clone(), []
    fold = torch.tensor(fold_of(groups, folds))
    out, temps = d.clone(), []
    for k in range(folds):
        t = fit_temperature(d[fold != k])
        out[fold == k] = d[fold == k] / t
        temps.append(t)
    return out, temps
