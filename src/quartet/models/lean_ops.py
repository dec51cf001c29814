"""A decoder layer's RMSNorms and SwiGLU product as single autograd functions that save less for the backward.

Per decoder layer, transformers' eager code keeps for the backward: each RMSNorm's input *and* its normalised
fp32 copy; under autocast, one bf16 cast of the norm's output per projection that reads it (q, k, v: three
casts of one tensor; gate, up: two); and for the SwiGLU product the gate, SiLU(gate) and up. The functions here
keep each norm's input and its (B, T, 1) inverse RMS, the norm's output once, already in the autocast dtype,
and the gate and up; the rest is recomputed in the backward (element-wise, cheap). Measured on SmolLM2-135M,
16 x 96 tokens under bf16 autocast: ~17 MB less per layer, ~0.5 GB per trained role; the PPO peak falls with it
(benchmarks/vs_trl.py).

The forward values are those of the modules they replace, bit for bit: the same operations in the same order,
and under autocast the norm output is cast to the dtype every projection reading it would cast it to. So are the
SwiGLU product's gradients (the same kernels on the same values). The norm's agree up to rounding: its backward
is the closed form in float32, and the three bf16 input gradients of q, k and v are summed in bf16 before they
reach it (autograd summed their fp32 casts).

Applied per module, and only where a probe shows the replacement computes what the module computes (an RMSNorm
of the Llama form `w * x / rms(x)`, an MLP `down(silu(gate(x)) * up(x))`); anything else is left as it is.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, out_dtype):
        xf = x.to(torch.float32)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        y = weight * (xf * rstd).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        return y if out_dtype is None else y.to(out_dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        h = x.to(torch.float32) * rstd
        g = grad.to(torch.float32)
        grad_weight = (g * h).reshape(-1, h.shape[-1]).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        gh = g * weight.to(torch.float32)
        grad_x = rstd * (gh - h * (gh * h).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None, None


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):  # what autograd computes from the saved SiLU(gate), with SiLU(gate) computed again
        gate, up = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)


def _norm_forward(self, hidden_states):
    device = hidden_states.device.type
    out = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    return _RMSNorm.apply(hidden_states, self.weight, self.variance_epsilon, out)


def _mlp_forward(self, x):
    return self.down_proj(_SiluMul.apply(self.gate_proj(x), self.up_proj(x)))


def _same(module: nn.Module, forward, probe: torch.Tensor) -> bool:
    """Whether `forward` gives what `module` gives on `probe`, in eval mode (no dropout), under bf16 autocast
    when the module holds weights of another dtype than the probe's (a LoRA base held in bf16)."""
    mixed = any(p.dtype != probe.dtype for p in module.parameters())
    training = module.training
    module.eval()
    try:
        with torch.no_grad(), torch.autocast(probe.device.type, dtype=torch.bfloat16, enabled=mixed):
            return torch.equal(module(probe), forward(module, probe))
    except RuntimeError:  # the probe does not fit the module: leave it
        return False
    finally:
        module.train(training)


def _replace(module: nn.Module, forward, probe: torch.Tensor) -> bool:
    """Give `module` the lean `forward` if it has not got it and the probe shows the two compute the same."""
    if getattr(module, "_quartet_lean", False) or not _same(module, forward, probe):
        return False
    module.forward = types.MethodType(forward, module)
    module._quartet_lean = True
    return True


def apply_lean_ops(model: nn.Module) -> int:
    """Replace the forwards of the RMSNorms and the MLP of every decoder layer in `model` (a transformers model, a
    PeftModel, a `quartet.models.Critic`) where a probe shows they compute the same; returns how many were
    replaced. Idempotent."""
    done = 0
    for layer in list(model.modules()):
        if not all(hasattr(layer, a) for a in ("input_layernorm", "post_attention_layernorm", "mlp")):
            continue
        for name in ("input_layernorm", "post_attention_layernorm"):
            norm = getattr(layer, name)
            weight = getattr(norm, "weight", None)
            if (isinstance(weight, torch.Tensor) and weight.dim() == 1 and not weight.is_meta
                    and hasattr(norm, "variance_epsilon")):
                probe = torch.randn(2, 3, weight.shape[0], device=weight.device, dtype=weight.dtype)
                done += _replace(norm, _norm_forward, probe)
        mlp = layer.mlp
        if not all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj")):
            continue
        width = getattr(mlp, "hidden_size", None) or getattr(mlp.gate_proj, "in_features", None)
        if width is not None:
            probe = torch.randn(2, 3, width, device=next(mlp.parameters()).device)
            done += _replace(mlp, _mlp_forward, probe)
    return done
