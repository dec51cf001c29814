"""GGUF files (``smollm2-135m-instruct``, ``path/to/file.gguf``): a dense model dequantised by transformers, and its
tokenizer, with the file parsed once per load and the last model kept for the copies a run asks for.
"""

from __future__ import annotations

import contextlib
import copy
import os
import struct

import gguf  # gguf-py, the reader transformers parses GGUF files with (this module is quartet.models.gguf)
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from quartet.errors import ModelError
from quartet.models.names import ModelSource, _first_line

_GGUF_CACHE: dict[tuple[str, torch.dtype], tuple[nn.Module, object]] = {}
"""(gguf path, dtype) -> pristine (model, tokenizer). Dequantising SmolLM2 takes ~10 s; a PPO run
loads it up to three times (actor, reference, critic), so copies are handed out instead."""


def clear_model_cache() -> None:
    """Drop the in-process cache of dequantised GGUF models (frees one model's memory)."""
    _GGUF_CACHE.clear()


def load_gguf(source: ModelSource, dtype: torch.dtype, cache: bool):
    """(model, tokenizer) of a GGUF source, dequantised; with ``cache``, a copy of the one kept in process."""
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
    tokenizer = load_gguf_tokenizer(source)
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


def load_gguf_tokenizer(source: ModelSource):
    """A copy of the GGUF file's tokenizer, read once per file and process."""
    if source.key not in _GGUF_TOKENIZERS:
        try:
            tok = AutoTokenizer.from_pretrained(
                source.path, gguf_file=source.gguf_file, local_files_only=True
            )
        except (OSError, ValueError, KeyError, RuntimeError, IndexError, struct.error) as e:  # a cut GGUF: struct.error
            raise ModelError(
                f"model '{source.name}': cannot read the GGUF tokenizer ({_first_line(e)})"
            ) from None
        _GGUF_TOKENIZERS[source.key] = forget_load_kwargs(tok)
    return copy.deepcopy(_GGUF_TOKENIZERS[source.key])


def forget_load_kwargs(tokenizer):
    """Loading options are not properties of the tokenizer: keep them out of a saved tokenizer_config."""
    for key in ("local_files_only", "is_local", "gguf_file"):
        tokenizer.init_kwargs.pop(key, None)
    return tokenizer


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
