"""GGUF files (``smollm2-135m-instruct``, ``path/to/file.gguf``): a dense model dequantised by transformers, and its
tokenizer, with the file parsed once per load and the last model kept for the copies a run asks for.

Converting is slow where it is pure Python: for SmolLM2-135M on an AVX2 EPYC, ~5 s to parse the header and build the
49k-token tokenizer and ~6 s more for the weights, in every process that loads it. So the first load also writes what it
made, with ``save_pretrained``, to a disk cache (`cache_root`: ``$QUARTET_CACHE``, else ``$XDG_CACHE_HOME/quartet``,
else ``~/.cache/quartet``; ``QUARTET_CACHE=off`` turns it off), and later loads of the same file read that folder
(~1.4 s). An entry is named by the file's resolved path, size and modification time, the dtype and the transformers
version that converted it, so a changed file or another transformers converts again; an entry that cannot be read
is converted again, and a cache that cannot be written is skipped: the cache never makes a load fail.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
from pathlib import Path

import gguf  # gguf-py, the reader transformers parses GGUF files with (this module is quartet.models.gguf)
import torch
import transformers
from torch import nn

from quartet.atomic import ordinary_modes
from quartet.errors import ModelError
from quartet.models.names import ModelSource, _first_line

log = logging.getLogger(__name__)

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
        model, tokenizer = _load_converted(source, dtype)
        if not cache:
            return model, tokenizer
        _GGUF_CACHE.clear()  # keep one: the cache is for repeated loads of the run's model
        _GGUF_CACHE[key] = (model, tokenizer)
    model, tokenizer = _GGUF_CACHE[key]
    return copy.deepcopy(model), copy.deepcopy(tokenizer)


def _load_converted(source: ModelSource, dtype: torch.dtype):
    """(model, tokenizer) from the disk cache, else dequantised from the file (and then written to the cache)."""
    entry = cache_entry(source, dtype)
    damaged = False
    if entry is not None and (entry / CACHE_MARK).is_file():
        try:
            return _read_entry(entry, source, dtype)
        # whatever a damaged entry raises (safetensors', tokenizers' and json's errors among others): the file itself
        # is still there, so convert it again and replace the entry; a real problem shows in the conversion
        except Exception as e:  # noqa: BLE001
            log.warning("GGUF cache %s: not readable (%s); converting %s again", entry, _first_line(e), source.name)
            damaged = True
    with _gguf_parsed_once():
        model, tokenizer = _load_gguf_uncached(source, dtype)
    if entry is not None:
        _write_entry(entry, source, model, tokenizer, replace=damaged)
    return model, tokenizer


CACHE_ENV = "QUARTET_CACHE"
CACHE_MARK = "quartet_gguf_cache.json"
"""written into an entry last: an entry without it is not read (and it says what the entry was made from)"""


def cache_root() -> Path | None:
    """Where converted GGUF models are kept; None when ``QUARTET_CACHE`` turns the cache off."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return None if value.strip().lower() in ("", "0", "off", "none", "false") else Path(value).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "quartet"


def cache_entry(source: ModelSource, dtype: torch.dtype) -> Path | None:
    """The cache folder of this file as converted to `dtype` by this transformers; None without a cache."""
    root = cache_root()
    if root is None:
        return None
    try:
        stat = (source.path / source.gguf_file).stat()
    except OSError:
        return None  # the load itself names a missing file
    what = json.dumps([source.key, stat.st_size, stat.st_mtime_ns, str(dtype), transformers.__version__])
    digest = hashlib.sha256(what.encode()).hexdigest()[:20]
    return root / "gguf" / f"{Path(source.gguf_file).stem}-{str(dtype).removeprefix('torch.')}-{digest}"


def _read_entry(entry: Path, source: ModelSource, dtype: torch.dtype):
    tokenizer = load_gguf_tokenizer(source)  # once per process, from a cache entry where there is one
    model = transformers.AutoModelForCausalLM.from_pretrained(entry, dtype=dtype, local_files_only=True)
    model.name_or_path = model.config._name_or_path = str(source.path)  # the file's, as a conversion gives it
    return model, tokenizer


def _read_entry_tokenizer(entry: Path, source: ModelSource):
    tokenizer = forget_load_kwargs(transformers.AutoTokenizer.from_pretrained(entry, local_files_only=True))
    tokenizer.name_or_path = str(source.path)
    return tokenizer


def _write_entry(entry: Path, source: ModelSource, model, tokenizer, replace: bool) -> None:
    """Save the conversion as a cache entry, whole or not at all; a cache that cannot be written is skipped.

    ``replace``: the entry there did not load; otherwise an entry there is another process's, written while this one
    converted (two runs starting together), and kept.
    """
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", suffix=".tmp", dir=entry.parent))
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / CACHE_MARK).write_text(json.dumps({
            "gguf": str(source.path / source.gguf_file), "transformers": transformers.__version__,
        }) + "\n", encoding="utf-8")
        ordinary_modes(tmp)  # as the folders the user makes: a cache shared by a team reads for all of it
        if replace or (entry.exists() and not (entry / CACHE_MARK).is_file()):  # damaged, or left half-made
            shutil.rmtree(entry, ignore_errors=True)
        if (entry / CACHE_MARK).is_file():
            return  # another process's, as good as this one
        os.rename(tmp, entry)
        tmp = None
    except OSError as e:
        if (entry / CACHE_MARK).is_file():
            return  # another process renamed its copy in first
        log.warning("GGUF cache %s: not written (%s); the next load converts %s again", entry, _first_line(e),
                    source.name)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _load_gguf_uncached(source: ModelSource, dtype: torch.dtype):
    tokenizer = load_gguf_tokenizer(source)
    try:
        # dequantize=True: transformers 5 otherwise keeps the weights packed in GGUF blocks when
        # the `kernels` package is installed, and packed weights cannot be trained.
        model = transformers.AutoModelForCausalLM.from_pretrained(
            source.path,
            gguf_file=source.gguf_file,
            dtype=dtype,
            quantization_config=transformers.GgufConfig(dequantize=True),
            local_files_only=True,
        )
    except (OSError, ValueError, KeyError, RuntimeError, IndexError, struct.error) as e:  # a cut GGUF: struct.error
        raise ModelError(f"model '{source.name}': cannot load GGUF ({_first_line(e)})") from None
    strip_quantization(model)
    # what save_pretrained records (and so a cached copy carries), set here too: one config whichever way it loaded
    model.config.architectures = model.config.architectures or [type(model).__name__]
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
    """A copy of the GGUF file's tokenizer, read once per file and process (from a cache entry where there is one)."""
    if source.key not in _GGUF_TOKENIZERS:
        cached = _cached_tokenizer(source)
        if cached is not None:
            _GGUF_TOKENIZERS[source.key] = cached
            return copy.deepcopy(cached)
        try:
            tok = transformers.AutoTokenizer.from_pretrained(
                source.path, gguf_file=source.gguf_file, local_files_only=True
            )
        except (OSError, ValueError, KeyError, RuntimeError, IndexError, struct.error) as e:  # a cut GGUF: struct.error
            raise ModelError(
                f"model '{source.name}': cannot read the GGUF tokenizer ({_first_line(e)})"
            ) from None
        _GGUF_TOKENIZERS[source.key] = forget_load_kwargs(tok)
    return copy.deepcopy(_GGUF_TOKENIZERS[source.key])


def _cached_tokenizer(source: ModelSource):
    """The tokenizer of any dtype's cache entry of this file (the tokenizer does not depend on the dtype), or None."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        entry = cache_entry(source, dtype)
        if entry is not None and (entry / CACHE_MARK).is_file():
            try:
                return _read_entry_tokenizer(entry, source)
            except Exception:  # noqa: BLE001 (as in _load_converted: the model's load reports and replaces it)
                continue
    return None


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
