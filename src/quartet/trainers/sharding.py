"""Full weights out of a sharded model, for the generation engine and for the saved model.

Under FSDP (version 1 or 2) or DeepSpeed ZeRO-3 each process holds only its shard of every weight, so
`accelerator.unwrap_model(model)` is not the model: sampling from it or saving it would use a fragment.
This module is the one place that asks the sharding engine for the full tensors:

- FSDP 1 and 2: torch's `get_model_state_dict(..., StateDictOptions(full_state_dict=True))`;
- DeepSpeed ZeRO-3: `deepspeed.zero.GatheredParameters` around the module's own `state_dict()` (accelerate's
  `get_state_dict` gives the 16-bit copy on the main process only; the engine needs it on every process).

The gather is a collective: every process calls it, in the same order. Without sharding (one process, DDP,
ZeRO-1/2) `full_state_dict` returns None and callers use the module as they always did: no copy, no
communication. LoRA under sharding: the gathered base weights and adapter matrices are merged here
(`quartet.rollout.weights.merged_state_dict` with the gathered state), and the saved model is the merged one;
the separate `adapter/` folder is not written.
"""

from __future__ import annotations

import contextlib

import torch

from quartet.errors import ConfigError
from quartet.models.loading import no_init
from quartet.rollout.weights import base_config, merged_state_dict


def sharded(model: torch.nn.Module) -> str | None:
    """"fsdp" (FSDP 1 or 2), "zero3" (DeepSpeed ZeRO-3) or None when every process holds full weights."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    except ImportError:  # torch without distributed support
        return None
    for module in model.modules():
        if isinstance(module, (FSDPModule, FSDP1)):
            return "fsdp"
    first = next(iter(model.parameters()), None)
    if first is not None and hasattr(first, "ds_id") and hasattr(first, "ds_status"):  # a ZeRO-3 partitioned param
        return "zero3"
    return None


def accelerator_shards(accelerator) -> str | None:
    """What accelerate is set up to do with the weights: "fsdp", "zero3" or None (DDP, ZeRO-1/2, one process).
    Known before `prepare`, so the recipes can refuse at start-up what is not made right under sharding."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        return "fsdp"
    if kind == DistributedType.DEEPSPEED:
        plugin = accelerator.state.deepspeed_plugin
        stage = plugin.deepspeed_config.get("zero_optimization", {}).get("stage") if plugin is not None else None
        return "zero3" if stage == 3 else None
    return None


NAMES = {"fsdp": "FSDP", "zero3": "DeepSpeed ZeRO-3"}


def refuse_unsupported(accelerator, stage: str, unsupported: dict[str, bool]) -> str | None:
    """At start-up, before anything is trained: under sharded weights, one ConfigError naming what this run asks
    for that is not made right yet (`unsupported`: description -> asked for). Returns the sharding kind or None."""
    kind = accelerator_shards(accelerator)
    refuse(kind, stage, unsupported)
    return kind


def refuse(kind: str | None, stage: str, unsupported: dict[str, bool]) -> None:
    """`refuse_unsupported` for a sharding `kind` already known ("fsdp", "zero3" or None: nothing is refused)."""
    if kind is None:
        return
    asked = [what for what, used in unsupported.items() if used]
    if asked:
        raise ConfigError(f"{stage} under {NAMES[kind]}: {'; '.join(asked)}: not supported with sharded weights "
                          f"yet (only the generation engine and the final model get the gathered full weights)")


def full_state_dict(model: torch.nn.Module, everywhere: bool = True) -> dict[str, torch.Tensor] | None:
    """The full weights of a sharded `model` (the prepared one), keyed as the unwrapped module's state_dict.

    Collective: every process must call it. `everywhere`: every process gets the tensors (the engine samples on
    every process); otherwise (a save) only the main process needs them, and the others may get {} (FSDP on
    GPUs, ZeRO-3). None when `model` is not sharded: the caller then reads the module itself."""
    kind = sharded(model)
    if kind is None:
        return None
    if kind == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # cpu_offload also means "main process only"; with CPU weights there is nothing to offload (and FSDP1's
        # main-only gather of CPU weights crashes the main process with SIGSEGV in torch 2.13), so all get them
        on_gpu = next(model.parameters()).device.type != "cpu"
        options = StateDictOptions(full_state_dict=True, cpu_offload=on_gpu and not everywhere)
        state = get_model_state_dict(model, options=options)
        return {k: v.detach() for k, v in state.items()}
    return _zero3_state_dict(model, everywhere)


def _zero3_state_dict(model: torch.nn.Module, everywhere: bool) -> dict[str, torch.Tensor]:
    import deepspeed  # only here: DeepSpeed is an optional extra, present when the run was launched with it
    import torch.distributed as dist

    module = getattr(model, "module", model)  # a DeepSpeedEngine wraps the module
    keep = everywhere or dist.get_rank() == 0
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        # inside the block every partitioned parameter holds its full tensor; copied out before it is released
        return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()} if keep else {}


def sub_state(state: dict[str, torch.Tensor] | None, prefix: str) -> dict[str, torch.Tensor] | None:
    """The entries of `state` under `prefix` ("actor."), with the prefix removed; None stays None."""
    if state is None:
        return None
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def sync_engine(engine, accelerator, model: torch.nn.Module) -> None:
    """Copy the prepared policy's actor into the generation engine; sharded, from its gathered full weights
    (every process takes part and every process gets them: each samples its share of the batch)."""
    engine.sync(accelerator.unwrap_model(model).actor, sub_state(full_state_dict(model), "actor."))


def plain_model(actor: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain (unsharded, LoRA-merged) transformers model holding the gathered `state` of `actor`, for
    `save_model`: built from the actor's config in fp32, every weight loaded (strict but for a tied output)."""
    import transformers

    merged = merged_state_dict(actor, state)
    with no_init():
        model = transformers.AutoModelForCausalLM.from_config(base_config(actor), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(merged, strict=False)
    missing = [k for k in missing if not (k.endswith("lm_head.weight") and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"gathered weights do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


@contextlib.contextmanager
def saveable(accelerator, model: torch.nn.Module, part: str | None = None, keep_fp32_wrapper: bool = True):
    """The module to save: the unwrapped `model` (or its `part`, e.g. "actor"), or under sharding a plain copy
    with the gathered full weights. Every process enters (the gather is collective); the copy exists on the
    main process only, the others get None."""
    unwrapped = accelerator.unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper)
    target = getattr(unwrapped, part) if part else unwrapped
    state = full_state_dict(model, everywhere=False)
    if state is None:
        yield target
        return
    if part:
        state = sub_state(state, part + ".")
    yield plain_model(target, state) if accelerator.is_main_process else None
