"""Calibration of reward-model margins: the table by hand, the temperature against its closed form and a grid, the
cross-fit out of fold."""

from __future__ import annotations

import json
import math

import pytest
import torch

from quartet.algo.stats import wilson_interval
from quartet.eval.calibration import (
    T_RANGE,
    bt_nll,
    calibration_table,
    clustered_wilson,
    cross_fitted,
    fit_temperature,
    fold_of,
)


def test_calibration_table_by_hand():
    # |d| 0.2 and 0.3 (bin [0, 0.5)), one right one wrong; 3.0 (bin [2, 4)) right; -5 (bin [4, inf)) wrong
    table = calibration_table(torch.tensor([0.2, -0.3, 3.0, -5.0]))
    by_bin = {b["margin"]: b for b in table}
    assert [b["count"] for b in table] == [2, 0, 0, 1, 1]
    assert by_bin["[0, 0.5)"]["accuracy"] == 0.5
    assert by_bin["[0, 0.5)"]["predicted"] == pytest.approx((1 / (1 + math.exp(-0.2)) + 1 / (1 + math.exp(-0.3))) / 2)
    assert by_bin["[2, 4)"]["accuracy"] == 1.0 and by_bin["[4, inf)"]["accuracy"] == 0.0
    assert by_bin["[0.5, 1)"]["accuracy"] is None and by_bin["[0.5, 1)"]["predicted"] is None
    json.loads(json.dumps(table, allow_nan=False))  # strict JSON: an empty bin is null, not NaN


def test_temperature_closed_form():
    # 30 pairs right at +3 and 10 wrong at -3, plus the pseudo-pairs at the mean |margin| 3 (one right, one wrong):
    # the likelihood peaks where sigmoid(3 / T) = 31 / 42, so T = 3 / ln(31 / 11)
    d = torch.tensor([3.0] * 30 + [-3.0] * 10)
    t = fit_temperature(d)
    assert t == pytest.approx(3 / math.log(31 / 11), rel=1e-6)
    (row,) = [b for b in calibration_table(d / t) if b["count"]]
    assert row["accuracy"] == 0.75 and row["predicted"] == pytest.approx(31 / 42, abs=1e-6)
    # all 40 right: not T -> 0 (every claim certain) but Laplace's (n + 1) / (n + 2) = 41 / 42
    assert fit_temperature(torch.full((40,), 3.0)) == pytest.approx(3 / math.log(41), rel=1e-6)


def _objective(d: torch.Tensor, t: float) -> float:
    """What fit_temperature minimises, spelled out: the pairs' log-loss sum plus the two pseudo-pairs'."""
    m = float(d.abs().mean())
    return bt_nll(torch.cat([d, torch.tensor([m, -m])]), t) * (len(d) + 2)


def test_temperature_against_a_grid_of_the_likelihood():
    g = torch.Generator().manual_seed(0)
    d = 4 * torch.randn(200, generator=g) + 1.5  # overconfident margins: ~65% right, |d| ~ 3
    t = fit_temperature(d)
    grid = torch.linspace(0.1, 20, 20_000)
    best = grid[torch.argmin(torch.tensor([_objective(d, float(x)) for x in grid], dtype=torch.float64))]
    assert t == pytest.approx(float(best), abs=2e-3)  # the grid's step is 1e-3
    assert _objective(d, t) <= _objective(d, 1.0)  # never worse than leaving the margins as they are
    assert bt_nll(d, t) < bt_nll(d, 1.0)
    # dividing the margins by c divides T by c: the fit has no scale of its own
    assert fit_temperature(d / 7) == pytest.approx(t / 7, rel=1e-6)


def test_temperature_at_its_bounds_and_bad_input():
    assert fit_temperature(torch.tensor([-1.0, -2.0])) == pytest.approx(T_RANGE[1])  # worse than chance: flattest
    assert fit_temperature(torch.zeros(3)) == 1.0  # no margin at all: nothing to scale
    with pytest.raises(ValueError, match="at least one"):
        fit_temperature(torch.tensor([]))
    with pytest.raises(ValueError, match="NaN"):
        fit_temperature(torch.tensor([1.0, float("nan")]))


def test_folds_keep_a_prompt_together():
    assert fold_of(["a", "b", "a", "c", "b", "d"]) == [0, 1, 0, 0, 1, 1]


def test_cross_fit_scales_each_fold_by_the_other_folds_temperature():
    d = torch.tensor([3.0, 3.0, -3.0, 3.0, 2.0, -1.0, 2.0, 2.0])
    groups = ["p", "q", "p", "q", "p", "q", "p", "q"]  # fold 0 = p's rows, fold 1 = q's
    scaled, temps = cross_fitted(d, groups)
    t_from_q, t_from_p = fit_temperature(d[1::2]), fit_temperature(d[0::2])
    assert temps == [pytest.approx(t_from_q), pytest.approx(t_from_p)]
    assert torch.allclose(scaled[0::2], d[0::2].double() / t_from_q)
    assert torch.allclose(scaled[1::2], d[1::2].double() / t_from_p)
    # one prompt: nothing to cross-fit, margins as they were
    same, none = cross_fitted(d, ["p"] * 8)
    assert none == [] and torch.equal(same, d.double())
    with pytest.raises(ValueError, match="groups"):
        cross_fitted(d, ["p"])


def test_independent_pairs_get_wilsons_interval():
    # 200 pairs, each its own prompt, 140 right: the sandwich variance is G / (G - 1) times the binomial one, so
    # deff = 200 / 199 and n_eff = 199: the half-width grows by sqrt(200 / 199) - 1 = 0.25% of ~0.064, 2e-4
    correct = torch.tensor([1.0] * 140 + [0.0] * 60)
    (lo, hi, n_eff), *rest = clustered_wilson(correct, torch.zeros(200, dtype=torch.long), list(range(200)))
    assert n_eff == pytest.approx(199.0)
    assert (lo, hi) == pytest.approx(wilson_interval(140, 200), abs=1e-3)
    assert rest == [(None, None, None)] * 4  # bins without pairs


def test_a_prompts_pairs_that_agree_count_about_once():
    # 10 prompts of 20 pairs, every pair of 5 prompts right and of the other 5 wrong: p = 0.5; sandwich variance
    # 10/9 * 10 * (20 * 0.5)^2 / 200^2 = 0.02778 against the binomial 0.25 / 200 = 0.00125: deff 22.2, n_eff 9.0.
    # Wilson over 9 at 0.5, by hand: centre 0.5, half 1.96 / (1 + 1.96^2/9) * sqrt(0.25/9 + 1.96^2/324) = 0.2735;
    # Wilson over the 200 pairs, [0.431, 0.569], would reject a prediction of 0.7 on evidence it does not have
    groups = [p for p in range(10) for _ in range(20)]
    correct = torch.tensor([1.0 if p < 5 else 0.0 for p in groups])
    (lo, hi, n_eff), *_ = clustered_wilson(correct, torch.zeros(200, dtype=torch.long), groups)
    assert n_eff == pytest.approx(9.0)
    assert (lo, hi) == pytest.approx((0.5 - 0.2735, 0.5 + 0.2735), abs=1e-3)
    # all 13 pairs right: no variance to estimate a clustering from, so Wilson's over 13 ([0.772, 1]), which holds
    # Bradley-Terry's 0.987 (13 of 13 right has probability 0.84 then); a prompt bootstrap would read [1, 1]
    (lo, hi, n_eff), *_ = clustered_wilson(torch.ones(13), torch.zeros(13, dtype=torch.long), ["a"] * 6 + ["b"] * 7)
    assert (lo, hi, n_eff) == (*wilson_interval(13, 13), 13.0) and lo < 0.987
    with pytest.raises(ValueError, match="6 pairs but 2 groups"):
        clustered_wilson(torch.ones(6), torch.zeros(6, dtype=torch.long), ["a", "b"])


def test_calibration_table_with_groups_gives_each_bin_its_interval():
    d = torch.tensor([0.2, -0.3, 0.4, 3.0, 2.5, float("nan")])
    table = calibration_table(d, groups=["a", "a", "b", "b", "c", "c"])
    assert [b["count"] for b in table] == [3, 0, 0, 2, 0]  # the NaN margin falls in no bin
    first, _, _, fourth, _ = table
    assert first["lo"] <= first["accuracy"] <= first["hi"]
    assert (fourth["lo"], fourth["hi"], fourth["effective_pairs"]) == (*wilson_interval(2, 2), 2.0)
    assert table[1]["lo"] is None and table[1]["hi"] is None
    json.loads(json.dumps(table, allow_nan=False))
    assert "lo" not in calibration_table(d)[0]  # without groups: no interval
