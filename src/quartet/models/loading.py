"""Turn a model name into a ready-to-train causal LM + tokenizer, and save one back.

The accepted names are resolved by quartet.models.names (`resolve_model`); GGUF files are read by
quartet.models.gguf.

Every model leaves `load_causal_lm` the same way: a pad token that is not EOS, left padding,
pad/eos ids in config and generation config, no quantization tag, and no dropout (dropout makes
the log-probs of the same tokens disagree between rollout and update, which PPO reads as a
policy change).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import logging
import os
import warnings
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from torch import nn

from quartet import handles
from quartet.atomic import atomic_dir
from quartet.errors import ConfigError, ModelError
from quartet.models.attention import fit_attention_to_shape
from quartet.models.gguf import forget_load_kwargs, load_gguf, load_gguf_tokenizer, strip_quantization
from quartet.models.lora import is_peft_model, merged_copy
from quartet.models.names import ModelSource, _first_line, resolve_model
from quartet.models.tiny import build_tiny, build_tiny_tokenizer

log = logging.getLogger(__name__)

# Tokens that may serve as padding when a tokenizer has none (or pads with EOS), in order of preference.
PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>", "<|endoftext|>")
ADDED_PAD = "<pad>"


# --------------------------------------------------------------------------- loading
CONFIG_ERRORS = (OSError, ValueError, KeyError, TypeError, StrictDataclassError)
"""what transformers raises for a config.json it cannot use"""


def cache_kwarg(model: nn.Module) -> str:
    """The name `model`'s forward takes its KV cache under: `cache` (transformers >= 5.2x, where `past_key_values`
    is deprecated, to be removed in 5.40) or `past_key_values` (earlier)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _cache_kwarg_of(type(base))


@functools.cache
def _cache_kwarg_of(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def output_cache(out):
    """The KV cache a forward with `use_cache=True` returned, under either name (see `cache_kwarg`)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def load_causal_lm(
    name: str, dtype: torch.dtype = torch.float32, *, trust_remote_code: bool = False, cache: bool = True
):
    """(model, tokenizer) for any accepted name, prepared as the module docstring says.

    ``cache``: reuse an in-process dequantised copy of a GGUF model (each call gets its own copy).
    """
    source = resolve_model(name)
    if source.kind == "tiny":
        model, tokenizer = build_tiny(name, dtype)
    elif source.kind == "memory":
        model, tokenizer = _load_memory(source, dtype)
    elif source.kind == "gguf":
        model, tokenizer = load_gguf(source, dtype, cache)
    else:
        model, tokenizer = _load_dir(source, dtype, trust_remote_code)
    prepare(model, tokenizer)
    model.quartet_source = source.key  # lets make_reference tell "the actor's own base" from another model
    return model, tokenizer


def load_tokenizer(name: str, *, trust_remote_code: bool = False):
    """The tokenizer `load_causal_lm(name)` would return (pad token, left padding), without the model.

    When the tokenizer has to get a new ``<pad>`` token, the model needs resized embeddings: load
    both with `load_causal_lm` then.
    """
    source = resolve_model(name)
    if source.kind == "tiny":
        tokenizer = build_tiny_tokenizer()
    elif source.kind == "memory":
        tokenizer = copy.deepcopy(handles.lookup(name, "model", ModelError)[1])
    elif source.kind == "gguf":
        tokenizer = load_gguf_tokenizer(source)
    else:
        tokenizer = _auto_tokenizer(source.path, source.name, trust_remote_code)
    ensure_pad_token(tokenizer, None)
    set_tokenizer_sides(tokenizer, padding="left")
    return tokenizer


def _load_memory(source: ModelSource, dtype: torch.dtype):
    """A copy of the (model, tokenizer) given to the Python API: every role gets its own (the trainer casts, wraps,
    precasts and trains what it loads), and the user's objects stay as they were."""
    model, tokenizer = handles.lookup(source.name, "model", ModelError)
    return copy.deepcopy(model).to(dtype), copy.deepcopy(tokenizer)


def _load_dir(source: ModelSource, dtype: torch.dtype, trust_remote_code: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(
            source.path, trust_remote_code=trust_remote_code, local_files_only=True
        )
    except CONFIG_ERRORS as e:  # a field of the wrong type fails transformers' strict config validation
        raise ModelError(f"{source.path / 'config.json'}: not usable ({_brief(e)})") from None
    if not _is_causal_lm_config(config):
        raise ModelError(
            f"model dir '{source.name}': {'/'.join(config.architectures or [config.model_type])} is not a "
            "causal LM with its LM head (encoders and reward models can only be reward-model backbones)"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source.path, dtype=dtype, trust_remote_code=trust_remote_code, local_files_only=True
        )
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:
        raise ModelError(f"model dir '{source.name}': cannot load weights ({_first_line(e)})") from None
    return model, _auto_tokenizer(source.path, source.name, trust_remote_code)


def _auto_tokenizer(path: Path, name: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:  # a file of the wrong shape
        raise ModelError(f"model dir '{name}': no usable tokenizer ({_first_line(e)})") from None
    return forget_load_kwargs(tok)


def _is_causal_lm_config(config) -> bool:
    """A dir saved from a causal LM; not a bare backbone, a classifier or an encoder (their LM head
    would be random)."""
    archs = config.architectures or []
    if archs:
        return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
    return is_causal_model_type(config.model_type)


def is_causal_model_type(model_type: str) -> bool:
    """Decoder-only families: have a causal-LM class and no masked-LM one (BERT and kin have both)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    return (
        model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    )


def _brief(e: BaseException) -> str:
    """The whole message on one line, cut at 300 characters (a validation error says which field on its first
    line and what is wrong with it on the next)."""
    return " ".join(str(e).split())[:300] or type(e).__name__


# --------------------------------------------------------------------------- preparation
def prepare(model, tokenizer) -> None:
    """Pad token, left padding, pad/eos ids in the configs, no quantization tag, no dropout."""
    ensure_pad_token(tokenizer, model)
    set_tokenizer_sides(tokenizer, padding="left")
    context = getattr(model.config, "max_position_embeddings", None)
    if isinstance(context, int) and tokenizer.model_max_length > 10**8:  # "unknown": use the model's own
        tokenizer.model_max_length = tokenizer.init_kwargs["model_max_length"] = context
    model.config.pad_token_id = tokenizer.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        gen = model.generation_config
        gen.pad_token_id = tokenizer.pad_token_id
        old = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
        eos = [tokenizer.eos_token_id] + [i for i in old if i is not None and i != tokenizer.eos_token_id]
        gen.eos_token_id = eos[0] if len(eos) == 1 else eos
    strip_quantization(model)
    disable_dropout(model)
    contiguous_head_input(model)
    fit_attention_to_shape(model)


def contiguous_head_input(model) -> None:
    """Make the LM head read a contiguous copy of its input.

    transformers slices the hidden states before the head (`logits_to_keep`: the last position when
    generating, the response positions in a teacher-forced forward). torch's matmul cannot fold a
    non-contiguous (B, T, H) slice into one matrix product and runs a batched one against the head's
    weight expanded B times, which on CPU is copied: B x V x H elements (16 x 49,152 x 576 for SmolLM2, 0.9 GB
    in bf16) on every such call, 1.7-2.4 s instead of 12-190 ms on one core. Copying the slice costs B x T x H.
    Under autocast the cast already makes that copy, so this matters for bf16/fp32 models run as they are
    (generation engines, fp32 training)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Module) or getattr(head, "_quartet_contiguous_input", False):
        return
    head.register_forward_pre_hook(_contiguous_first_arg)
    head._quartet_contiguous_input = True


def _contiguous_first_arg(module, args):
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return None


def precast_linears(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Store a frozen model's `nn.Linear` weights and biases in `dtype`, the dtype autocast would cast them to
    at every forward: under autocast in `dtype` its outputs are the same, bit for bit, from less memory
    (SmolLM2-135M: 540 -> 325 MB in bf16) and without a cast per forward. Embeddings, norms, and a linear whose
    weight is also an input embedding (a tied LM head) stay as they are: the lookup and the norms read them in
    full precision. Only for models run under autocast (outside it, a linear would meet inputs of another dtype).
    """
    if dtype == torch.float32:
        return model
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    cast = set()
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module.weight) not in embedded:
            for param in (module.weight, module.bias):
                if param is not None:
                    if param.requires_grad:
                        raise ValueError("precast_linears: the model must be frozen")
                    param.data = param.data.to(dtype)
                    cast.add(id(param))
    # The weights kept as they are get memory of their own: a checkpoint loaded from safetensors is a view of the
    # file's memory map, which stays mapped (with every page the cast above read) while any tensor uses it
    # (SmolLM2-135M: 513 MB of resident file pages kept alive by a 113 MB embedding)
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in cast:
            tensor.data = tensor.data.clone()
    return model


def ensure_pad_token(tokenizer, model=None) -> str:
    """Give ``tokenizer`` a pad token that is not EOS; returns how ("kept", "mapped", "added").

    Padding with EOS breaks two things: a reward model reading the last non-pad token would skip
    the real EOS, and masks built from ``ids != pad`` would drop the EOS the actor emitted.
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if pad is None and eos is None:
        raise ModelError(f"tokenizer of '{_name(tokenizer)}': has neither a pad nor an EOS token")
    if pad is not None and pad != eos:
        return "kept"
    vocab = tokenizer.get_vocab()
    avoid = {eos, tokenizer.bos_token_id}
    for candidate in PAD_CANDIDATES:
        if candidate in vocab and vocab[candidate] not in avoid:
            tokenizer.pad_token = candidate
            log.info(
                "tokenizer %s: pad token set to existing %s (id %d)",
                _name(tokenizer),
                candidate,
                vocab[candidate],
            )
            return "mapped"
    tokenizer.add_special_tokens({"pad_token": ADDED_PAD})
    log.info(
        "tokenizer %s: added a new pad token %s (id %d)", _name(tokenizer), ADDED_PAD, tokenizer.pad_token_id
    )
    if model is not None:
        rows = model.get_input_embeddings().weight.shape[0]
        if tokenizer.pad_token_id >= rows:
            model.resize_token_embeddings(len(tokenizer))
    return "added"


def set_tokenizer_sides(tokenizer, padding: str | None = None, truncation: str | None = None) -> None:
    """Set padding/truncation side now and in ``init_kwargs``, so `save_pretrained` writes them too."""
    for attr, side in (("padding_side", padding), ("truncation_side", truncation)):
        if side is not None:
            setattr(tokenizer, attr, side)
            tokenizer.init_kwargs[attr] = side


def _name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every dropout probability to 0: nn.Dropout modules, float ``*dropout*`` attributes that
    modules read at forward time (e.g. Llama's ``attention_dropout``), and the config fields."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for attr, value in list(vars(module).items()):
            if "dropout" in attr and isinstance(value, float):
                setattr(module, attr, 0.0)
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            _zero_config_dropout(config)
    return model


def _zero_config_dropout(config) -> None:
    for key, value in list(vars(config).items()):
        if ("dropout" in key or key.endswith("_pdrop")) and isinstance(value, float):
            setattr(config, key, 0.0)
        elif hasattr(value, "to_dict") and hasattr(value, "model_type"):  # nested sub-config
            _zero_config_dropout(value)


# --------------------------------------------------------------------------- saving
def save_model(model, tokenizer, out_dir: str | os.PathLike, card=None) -> Path:
    """Write a plain transformers model dir (safetensors + tokenizer, and ``card``, a
    quartet.models.card.ModelCard, as README.md), atomically.

    A peft LoRA model is written merged (loadable with `AutoModelForCausalLM.from_pretrained`)
    from a merged copy, so the training model is untouched; its adapter goes to ``out_dir/adapter/``.
    """
    out_dir = Path(out_dir)
    check_finite_weights(model.state_dict().items(), str(out_dir))
    with atomic_dir(out_dir) as tmp:
        plain = merged_copy(model) if is_peft_model(model) else model
        save_pretrained_clean(plain, tmp)
        if is_peft_model(model):
            with warnings.catch_warnings():
                # peft looks for the base's config.json to see if embeddings were resized; a GGUF
                # base has none, and `ensure_pad_token` resizes before the adapter exists anyway
                warnings.filterwarnings("ignore", message="Could not find a config file")
                model.save_pretrained(tmp / "adapter", safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if card is not None:
            (tmp / "README.md").write_text(card.render(), encoding="utf-8")
    return out_dir


def check_finite_weights(tensors, where: str) -> None:
    """Refuse to write weights with a NaN or an infinity: a diverged model must never look like a result."""
    for name, value in tensors:
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise ModelError(f"{where}: not saved, weight {name} is not finite (NaN or inf): training diverged; "
                             f"lower the learning rate (a run's newest checkpoint is unaffected)")


def save_pretrained_clean(model, out_dir: Path) -> None:
    """`save_pretrained(safe_serialization=True)` with no quantization tag in config.json."""
    strip_quantization(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    config_path = Path(out_dir) / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if "quantization_config" in config:
        raise ModelError(f"{config_path}: still carries a quantization_config after dequantisation")


# --------------------------------------------------------------------------- small helpers
def context_length(model) -> int | None:
    """Positions the model can attend over (`max_position_embeddings` / `n_positions`), None if unknown."""
    config = getattr(base_model_of(model), "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_context(model, prompt_ids: list[list[int]], max_new_tokens: int, where: str, fix: str) -> None:
    """One-line ConfigError when the longest prompt plus `max_new_tokens` does not fit the model's context
    (past it, position embeddings index out of range deep inside the model)."""
    limit = context_length(model)
    longest = max(map(len, prompt_ids), default=0)
    if limit is not None and longest + max_new_tokens > limit:
        raise ConfigError(
            f"{where}: the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = "
            f"{longest + max_new_tokens} exceeds the model's context of {limit} tokens; {fix}"
        )


def base_model_of(model):
    """The transformers model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def hidden_size(model) -> int:
    """H of a transformers model, a peft wrapper, a Critic or a RewardModel."""
    config = getattr(model, "config", None)
    if config is None:
        inner = getattr(model, "model", None) or getattr(model, "backbone", None)
        if inner is None:
            raise ModelError(f"{type(model).__name__}: has no config to read the hidden size from")
        return hidden_size(inner)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    raise ModelError(f"{type(model).__name__}: config has no hidden_size / n_embd / d_model")


def no_init():
    """Skip random initialisation of a model whose weights are overwritten right away (SmolLM2-135M: ~1.2 s of
    normal_ and uniform_ per model built). Imported by name: transformers' lazy package does not hold
    `initialization` as an attribute until something imports it, so `getattr(transformers, ...)` finds nothing."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # a transformers without it: initialise, only slower
        return contextlib.nullcontext()
    return no_init_weights()


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if trainable_only and not p.requires_grad:
            continue
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
    return total
