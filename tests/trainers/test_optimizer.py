"""loop.adamw: torch's fused AdamW where it applies, the same update as the per-tensor loop."""

from __future__ import annotations

import torch

from quartet.trainers import loop


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in [(7, 5), (5,), (3, 4, 2)]]


def _run(optimizer, params, steps: int = 5) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        optimizer.step()


def test_fused_matches_the_per_tensor_loop_with_two_groups():
    fused_params, plain_params = _params(0), _params(0)
    kw = dict(weight_decay=0.1, eps=1e-6)
    fused = loop.adamw([{"params": fused_params[:2], "lr": 1e-2}, {"params": fused_params[2:], "lr": 3e-2}], **kw)
    plain = torch.optim.AdamW([{"params": plain_params[:2], "lr": 1e-2}, {"params": plain_params[2:], "lr": 3e-2}],
                              **kw)  # fmt: skip
    assert fused.defaults["fused"] is True and not plain.defaults["fused"]
    _run(fused, fused_params)
    _run(plain, plain_params)
    for a, b, start in zip(fused_params, plain_params, _params(0)):
        assert not torch.equal(a, start)  # the step moved the weights
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_parameter_the_fused_kernel_cannot_take_falls_back():
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, dtype=torch.complex64))]
    optimizer = loop.adamw(params, lr=1e-2)
    assert not optimizer.defaults["fused"]
    _run(optimizer, params, steps=1)
    assert all(torch.isfinite(torch.view_as_real(p) if p.is_complex() else p).all() for p in params)
