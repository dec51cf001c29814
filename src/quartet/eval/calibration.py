"""Does a reward model's margin mean what Bradley-Terry says it means? Calibration by margin bin, and a temperature.

A Bradley-Terry reward model claims P(chosen > rejected) = sigmoid(d), with d = r_chosen - r_rejected. Held-out
pairs test the claim bin by bin of |d|: in a bin, the share of pairs ordered right should match the mean of
sigmoid(|d|) (`calibration_table`). Training longer widens the margins faster than it orders pairs better, so a
model can order well and claim too much; one number, a temperature T with P = sigmoid(d / T), fixes the scale
without changing any ordering (Guo et al. 2017, temperature scaling; here on pair margins).

A bin's interval counts prompts, not pairs, as the draws (`calibration_table` with `groups`): a prompt's K answers
make up to K(K-1)/2 pairs, each answer in K - 1 of them, so its pairs are not independent, and Wilson's interval
over the pairs is too narrow. It is Wilson's interval over the bin's effective number of pairs, n / deff, where the
design effect deff >= 1 is the variance of the bin's accuracy with prompts as clusters (the ratio estimator's
sandwich variance) over the binomial variance p(1 - p) / n (Kish 1965; Korn and Graubard 1998): independent pairs
give plain Wilson, a bin where each prompt's pairs all agree counts each prompt about once. (A prompt bootstrap
does the same for most bins but reads [1, 1] for a bin whose pairs are all ordered right, which 13 of 13 are
with probability 0.84 when Bradley-Terry predicts 0.987.) The held-out split is by prompt for the same reason.

T is fitted by maximum likelihood on held-out pairs, with one pseudo-pair either way (`fit_temperature`). Read on the same pairs it would flatter
itself, so `cross_fitted` scales each fold's margins by the T fitted on the other folds (folds by prompt): a
calibration table of those margins is an out-of-sample check, as the raw table is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from quartet.algo.stats import wilson_interval

BUCKETS = (0.0, 0.5, 1.0, 2.0, 4.0, math.inf)
"""edges of the |r_c - r_r| bins of the calibration table (Bradley-Terry units: sigmoid 0.5, 0.62, 0.73, 0.88, 0.98)"""

T_RANGE = (0.05, 20.0)
"""the temperatures `fit_temperature` may return"""


def calibration_table(margins: torch.Tensor, groups: Sequence | None = None) -> list[dict]:
    """Per |margin| bin of BUCKETS: the pairs in it, the share ordered right (margin > 0) and the share Bradley-Terry
    predicts (mean sigmoid |margin|). `margins` (N,): r_chosen - r_rejected. With `groups` (N,), each pair's prompt,
    each bin also gets `lo` and `hi`, the 95% interval of its accuracy with prompts as the draws (`clustered_wilson`),
    and `effective_pairs`. Empty bins read None (null in calibration.json: JSON has no NaN, and readers other than
    Python's refuse it)."""
    d = margins.double()
    correct = (d > 0).double()
    finite = torch.isfinite(d)  # a diverged model's NaN / inf margins fall in no bin
    which = torch.bucketize(d.abs(), torch.tensor(BUCKETS[1:-1], dtype=d.dtype), right=True)  # (N,) bin index
    which[~finite] = -1
    # non-finite margins are in bin -1: in none; clustered_wilson checks that `groups` has one per margin
    intervals = clustered_wilson(correct, which, groups) if groups is not None else None
    table = []
    for b, (lo, hi) in enumerate(zip(BUCKETS[:-1], BUCKETS[1:])):
        inside = which == b
        n = int(inside.sum())
        row = {
            "margin": f"[{lo:g}, {hi:g})",
            "count": n,
            "accuracy": float(correct[inside].mean()) if n else None,
            "predicted": float(torch.sigmoid(d.abs()[inside]).mean()) if n else None,
        }
        if intervals is not None:
            row["lo"], row["hi"], row["effective_pairs"] = intervals[b]
        table.append(row)
    return table


def clustered_wilson(correct: torch.Tensor, which: torch.Tensor, groups: Sequence
                     ) -> list[tuple[float | None, float | None, float | None]]:
    """Each bin's (lo, hi, n_eff): Wilson's 95% interval of its accuracy over n_eff = n / deff pairs, with prompts as
    clusters. `correct` (N,) 1.0 where ordered right, `which` (N,) each pair's bin, `groups` (N,) its prompt.

    In a bin with n pairs, k right, from G prompts holding n_g and k_g of them: p = k / n; the sandwich variance of
    p is G / (G - 1) * sum_g (k_g - p n_g)^2 / n^2 and the binomial one p (1 - p) / n; deff is their ratio, at least
    1 (fewer effective pairs than pairs, never more), and 1 where either is 0 (p at 0 or 1, or one prompt: nothing
    to estimate the clustering from). (None, None, None) for a bin without pairs."""
    if len(groups) != correct.numel():
        raise ValueError(f"clustered_wilson: {correct.numel()} pairs but {len(groups)} groups")
    index: dict = {}
    g = torch.tensor([index.setdefault(k, len(index)) for k in groups], dtype=torch.long)
    out = []
    for b in range(len(BUCKETS) - 1):
        inside = which == b
        n = int(inside.sum())
        if not n:
            out.append((None, None, None))
            continue
        n_g = torch.zeros(len(index), dtype=torch.float64).index_add_(0, g[inside], torch.ones(n, dtype=torch.float64))
        k_g = torch.zeros(len(index), dtype=torch.float64).index_add_(0, g[inside], correct[inside].double())
        n_g, k_g = n_g[n_g > 0], k_g[n_g > 0]
        clusters, p = n_g.numel(), float(k_g.sum()) / n
        binomial = p * (1 - p) / n
        deff = 1.0
        if clusters > 1 and binomial > 0:
            sandwich = clusters / (clusters - 1) * float(((k_g - p * n_g) ** 2).sum()) / n**2
            deff = max(1.0, sandwich / binomial)
        n_eff = n / deff
        lo, hi = wilson_interval(p * n_eff, n_eff)
        out.append((lo, hi, n_eff))
    return out


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
