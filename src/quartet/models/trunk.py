"""The frozen trunk of a partly adapted causal LM: its bottom decoder layers, computed once per rollout.

With LoRA on the top layers only (`lora.layers_to_transform`), the embedding and every decoder layer below
the lowest adapted one are frozen and carry no adapter. Their output for a rollout's tokens is then the same
for the actor in every PPO epoch, for the old log-probs (and the shared critic's values) and for the reference
(the actor with its adapter disabled): `Trunk.states` computes it once, and each of those forwards runs only
the layers above it (`Trunk.top`), which is also where the backward stops anyway. SmolLM2 with the top 15 of its
30 layers adapted: half of each of those forwards, the demo's PPO iteration 17.4 -> 11.9 s (README, issue 14).
The PPO checkpoint then shares those layers with its SFT start: evaluation computes them once for the KL's two
float32 forwards (`Trunk.shared`).

The top runs through the model's own forward, with its decoder layers cut to the adapted ones and the trunk's
output passed as `inputs_embeds`; that is only right where the backbone feeds `inputs_embeds` to its first layer
as they are (Llama, Mistral, Qwen2, ...; not Gemma, which scales them). `Trunk.attach` checks it: on a probe,
trunk + top must give the full forward's logits bit for bit, else no trunk is used.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from quartet.algo.positions import position_ids_from_mask

log = logging.getLogger(__name__)


def _backbone(model: nn.Module) -> nn.Module | None:
    """The transformers decoder stack (the module holding `layers` and `norm`) under a peft / CausalLM wrapper."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    backbone = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if isinstance(backbone, nn.Module) and isinstance(getattr(backbone, "layers", None), nn.ModuleList) \
            and isinstance(getattr(backbone, "norm", None), nn.Module):
        return backbone
    return None


def frozen_depth(model: nn.Module) -> int:
    """How many bottom decoder layers of `model` are frozen and carry no adapter, the input embedding frozen
    too (0 if it is trained, or the model has no decoder stack we know)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    backbone = _backbone(model)
    if backbone is None:
        return 0
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is None or any(p.requires_grad for p in embed.parameters()):
        return 0
    depth = 0
    for layer in backbone.layers:
        if any(p.requires_grad for p in layer.parameters()) or any(isinstance(m, BaseTunerLayer) for m in layer.modules()):
            break
        depth += 1
    return depth if depth < len(backbone.layers) else 0


def shared_depth(a: nn.Module, b: nn.Module) -> int:
    """How many bottom decoder layers two models hold value for value, their input embeddings equal too (0 if
    not, or if either has no decoder stack we know): a PPO checkpoint and its SFT start, where the adapters sat
    on the top layers only. At least one layer is left above the shared ones."""
    stacks = _backbone(a), _backbone(b)
    if None in stacks or len(stacks[0].layers) != len(stacks[1].layers):
        return 0
    if not _same_tensors(a.get_input_embeddings(), b.get_input_embeddings()):
        return 0
    depth = 0
    for la, lb in zip(*(s.layers[:-1] for s in stacks)):
        if not _same_tensors(la, lb):
            break
        depth += 1
    return depth


def _same_tensors(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        sa[k].shape == sb[k].shape and sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa
    )


class Trunk:
    """The bottom `depth` decoder layers of `model` (frozen, no adapter): their output for a batch, and a context
    in which the model's forward runs the layers above them on it."""

    def __init__(self, model: nn.Module, depth: int):
        self.model, self.depth = model, depth
        self.backbone = _backbone(model)

    @classmethod
    def attach(cls, model: nn.Module, autocast_dtype: torch.dtype | None = None) -> Trunk | None:
        """A Trunk of `model` where one pays and computes what the full forward computes; else None."""
        depth = frozen_depth(model)
        if depth == 0:
            return None
        trunk = cls(model, depth)
        if not trunk._probe(autocast_dtype):
            log.info("frozen trunk: %s does not compute its top layers from inputs_embeds as given; not used",
                     type(model).__name__)
            return None
        return trunk

    @classmethod
    def shared(cls, a: nn.Module, b: nn.Module) -> tuple[Trunk, Trunk] | None:
        """Trunks of two models over the bottom layers they share (`shared_depth`): the states one computes
        serve both tops. None where they share none or either's top does not give its full forward."""
        depth = shared_depth(a, b)
        if depth == 0:
            return None
        trunks = cls(a, depth), cls(b, depth)
        # b's top is probed on a's states: equal weights do not make equal layers (a norm's epsilon, the rotary
        # frequencies are not in the weights)
        return trunks if trunks[0]._probe(None) and trunks[1]._probe(None, states_from=trunks[0]) else None

    @torch.no_grad()
    def states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """(b, T, H): the hidden states entering the lowest adapted layer."""
        with self._layers(slice(0, self.depth), final_norm=False):
            out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=False)
        return out.last_hidden_state

    def top(self):
        """Context: the model's forward runs only the layers above the trunk; call it with
        `inputs_embeds=states(...)` in place of `input_ids`."""
        return self._layers(slice(self.depth, None), final_norm=True)

    @contextlib.contextmanager
    def _layers(self, part: slice, final_norm: bool):
        backbone = self.backbone
        layers, norm = backbone.layers, backbone.norm
        backbone.layers = nn.ModuleList(list(layers)[part])  # the same modules: no copy, no new parameters
        if not final_norm:
            backbone.norm = nn.Identity()
        try:
            yield
        finally:
            backbone.layers, backbone.norm = layers, norm

    def _probe(self, autocast_dtype: torch.dtype | None, states_from: Trunk | None = None) -> bool:
        """Whether the top, on the trunk's states (or those of `states_from`, another model's trunk), gives the
        full forward's logits bit for bit, on a small left-padded batch."""
        model = self.model
        weight = next(model.parameters())
        g = torch.Generator().manual_seed(0)
        vocab = model.get_input_embeddings().num_embeddings
        ids = torch.randint(0, vocab, (2, 7), generator=g).to(weight.device)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0  # left padding, as rollouts have
        pos = position_ids_from_mask(mask)
        training = model.training
        model.eval()
        autocast = torch.autocast(weight.device.type, dtype=autocast_dtype) if autocast_dtype is not None \
            else contextlib.nullcontext()
        try:
            with torch.no_grad(), autocast:
                full = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
                states = (states_from or self).states(ids, mask, pos)
                with self.top():
                    top = model(inputs_embeds=states, attention_mask=mask, position_ids=pos, use_cache=False).logits
        except (TypeError, ValueError, RuntimeError) as e:  # a forward that takes no inputs_embeds
            log.info("frozen trunk: probe failed (%s)", e)
            return False
        finally:
            model.train(training)
        real = mask.bool()
        return bool(torch.equal(full[real], top[real]))
