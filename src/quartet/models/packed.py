"""Frozen linear layers whose weights are held in the CPU matmul library's own blocked layout.

torch's CPU matmul (oneDNN) re-lays a plain weight out into its blocked format on every call. For the few rows a
decoding step multiplies (one token per answer) that reorder is most of the call: measured on a 2-core AMD EPYC
with AVX-512 BF16, SmolLM2's 210 decoder linears at 16 rows took 26 ms a step with plain bf16 weights and 17 ms
with the weights laid out once ahead (`torch.ops.mkldnn._reorder_linear_weight`, the op torch.compile's CPU
backend uses for frozen weights), 53 -> 41 ms at 64 rows; the products are the same, bit for bit.

`pack_linears` does this for a model that only samples (the HF engine's private copy, eval's sampling copy):
no gradients, weights that change only through `load_state_dict`, which re-lays them out. It is a no-op where
torch has no oneDNN or the CPU cannot run the dtype natively, and on GPUs. A tied output head (SmolLM2's) gets a
laid-out copy of the embedding it shares, which stays plain for the lookup; `tie_output` lays it out again after
new weights (where transformers' `tie_weights` would tie a plain head): at 16 rows SmolLM2's head took 9.5 ms a
decoding step with the plain weight and 3.0 ms laid out (2 threads, AVX-512 BF16).
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` are packed here: bf16, where torch has oneDNN and this CPU computes bf16.

    Not float32: oneDNN's fp32 product sums in another order than the plain one (MKL), so a packed fp32 copy
    would not sample exactly what the fp32 model samples."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    mkldnn = torch.ops.mkldnn
    try:
        return hasattr(mkldnn, "_linear_pointwise") and bool(mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without these ops
        return False


class PackedLinear(nn.Module):
    """`nn.Linear` for inference with its weight in oneDNN's layout: the same outputs from a layout made once.

    The weight is not a parameter: `load_state_dict` lays a new one out, `state_dict` gives it back plain.
    `tied`: an output head whose weight is the input embedding's (`tie_output` lays it out again from it)."""

    def __init__(self, linear: nn.Linear, rows: int, tied: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.rows = linear.in_features, linear.out_features, rows
        self.tied = tied
        self.dtype = linear.weight.dtype
        self.bias = linear.bias
        self._pack(linear.weight.detach())

    def _pack(self, weight: torch.Tensor) -> None:
        if weight.shape != (self.out_features, self.in_features):
            raise RuntimeError(f"packed linear: weight of shape {tuple(weight.shape)} for a "
                               f"{self.in_features} -> {self.out_features} layer")
        # `rows`: the batch the layout is tuned for; any batch computes the same products
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(self.dtype).contiguous(), self.rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        if key in state_dict:
            self._pack(state_dict[key])
        else:
            missing_keys.append(key)
        rest = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.packed.to_dense()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}, packed"


def pack_linears(model: nn.Module, rows: int = 16) -> int:
    """Replace the frozen `nn.Linear` layers of a CPU model that only runs inference by `PackedLinear`s laid out
    for `rows` rows per product; returns how many were replaced (0 where `can_pack` says no)."""
    head = _output(model)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            weight = child.weight
            if weight.device.type != "cpu" or weight.requires_grad or not can_pack(weight.dtype):
                continue
            # its own laid-out tensor: a tied embedding stays as it is
            setattr(parent, name, PackedLinear(child, rows, tied=child is head and _tied(model)))
            replaced += 1
    return replaced


def tie_output(model: nn.Module) -> None:
    """After new weights in a model with tied embeddings: a packed head is laid out again from the input
    embedding, a plain one tied to it (transformers' `tie_weights`)."""
    head = _output(model)
    if isinstance(head, PackedLinear) and head.tied:
        head._pack(model.get_input_embeddings().weight.detach())
    else:
        model.tie_weights()


def _output(model: nn.Module) -> nn.Module | None:
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


def _tied(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
