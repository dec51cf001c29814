"""The Reference: the frozen policy whose log-probs the KL penalty is measured against.

Two ways to have one:
    shared: the actor is a LoRA model and the reference is its base -> run the actor itself with
            the adapter disabled. No second copy of the weights.
    copy:   a separate frozen model (a deep copy of the starting actor, or another named model).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from quartet.errors import ModelError
from quartet.models.loading import base_model_of, disable_dropout, load_causal_lm
from quartet.models.lora import adapter_disabled, is_peft_model
from quartet.models.names import resolve_model


class Reference:
    """Frozen policy. Not an nn.Module on purpose: in the shared case it must not own the actor's
    parameters (an optimizer or state_dict walking it would see them twice)."""

    def __init__(self, model: nn.Module, shared: bool):
        self.model = model
        self.shared = shared

    @torch.no_grad()
    def logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, T, V) logits of the reference policy; never builds a graph."""
        was_training = self.model.training
        self.model.eval()
        try:
            with adapter_disabled(self.model) if self.shared else contextlib.nullcontext():
                out = self.model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    use_cache=False,
                )
        finally:
            self.model.train(was_training)
        return out.logits

    def __repr__(self) -> str:
        kind = "shared (adapter disabled)" if self.shared else "frozen copy"
        return f"Reference({kind}, {type(base_model_of(self.model)).__name__})"


def make_reference(
    actor: nn.Module, name: str | None = None, dtype: torch.dtype = torch.float32
) -> Reference:
    """The reference for ``actor``.

    ``name`` None means "the actor's starting weights": for a LoRA actor that is its base (shared,
    free); otherwise a frozen deep copy of the actor, so call this before training starts. A
    ``name`` loads that model frozen, unless it names the LoRA actor's own base (then shared).
    """
    base = base_model_of(actor)
    if is_peft_model(actor) and (name is None or _same_model(name, base)):
        return Reference(actor, shared=True)
    if name is None:
        model = copy.deepcopy(base).to(dtype)
    else:
        model, _ = load_causal_lm(name, dtype)
        _check_vocab(name, model, base)
    model.requires_grad_(False).eval()
    disable_dropout(model)
    return Reference(model, shared=False)


def _same_model(name: str, base: nn.Module) -> bool:
    key = getattr(base, "quartet_source", None)
    return key is not None and resolve_model(name).key == key


def _check_vocab(name: str, ref: nn.Module, actor: nn.Module) -> None:
    ref_v = ref.get_output_embeddings().weight.shape[0]
    actor_v = actor.get_output_embeddings().weight.shape[0]
    if ref_v != actor_v:
        raise ModelError(
            f"reference '{name}': vocabulary of {ref_v} tokens, the actor has {actor_v}; they must match"
        )
