"""Tolerances for equivalence tests: one computation done two ways (lean ops, a shared prompt prefix, activation
checkpointing, split backwards, the sampling pass's log-probs, N processes against one) that agree up to fp32
rounding. The kernels round differently on each CPU kind we support (AVX-512 and AVX2 sum in other orders and lane
widths), so each tolerance is argued here from what the arithmetic promises on any summation order, not from one
machine's result.

Weights after AdamW steps. At its usual eps AdamW divides each gradient element by its own size: lr x sign(g)
where |g| >> eps, but lr x g / eps near 0. An element that cancels to near 0 lands as far from 0 as the summation
order leaves it, and moves its weight by up to lr x rounding / eps = 1e-2 x 1e-9 / 1e-5 = 1e-6: no bound ties
that rounding to the element's own size (a 1e-6 tolerance on weights held on AVX-512 and failed on AVX2 with
1.35e-6). So equivalence tests run AdamW with eps = 1 (LINEAR_ADAM): each step is then lr x m / (sqrt(v) + 1),
whose slope in any gradient element is <= lr, and two runs' weights drift apart by at most lr x the gradients'
rounding per step.

That rounding (GRAD_ROUNDING). Each gradient element of the tiny models here comes out of nested fp32 sums (over
the vocabulary, <= 260, the hidden size, 32, and a minibatch's <= 16 rows x 40 tokens) whose errors add: n <= 2000
terms in all, each at most S ~ 10 after the masked token mean and the clip to max_grad_norm 1 (|advantage| <= 3
after whitening, |normed activations| <= 3). Rounding errors of sums grow as lambda sqrt(n) u S with u = 2^-24 =
6e-8, exceeded with probability <= 2 exp(-lambda^2 / 2) (Higham and Mary, "A new approach to probabilistic
rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019): lambda = 10 gives 10 x 45 x 6e-8 x 10 = 2.7e-4.

Metrics (METRIC_TOL). Losses, KL and the gradient norm are means over the same <= 640 tokens of terms of scale
<= 1 (whitened advantages; the value loss and the norm relative to themselves): lambda sqrt(n) u = 1.5e-5.

Measured, for scale only: the same-update tests agree to 4e-9 (updates) and 3e-8 (metrics) on AVX-512 BF16, and
the same with the kernels held to AVX2.
"""

from __future__ import annotations

LINEAR_ADAM = {"optim.adam_eps": 1.0}
GRAD_ROUNDING = 2.7e-4
METRIC_TOL = 1.5e-5


def update_atol(steps: int, lr: float) -> float:
    """How far two runs' weights may land apart after `steps` AdamW steps at <= `lr` in its linear regime."""
    return steps * lr * GRAD_ROUNDING
