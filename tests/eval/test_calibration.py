"""Calibration of reward-model margins: the table by hand, the temperature against its closed form and a grid, the
cross-fit out of fold."""

from __future__ import annotations

import json
import math

import pytest
import torch

from quartet.eval.calibration import (
    T_RANGE,
    bt_nll,
    calibration_table,
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
