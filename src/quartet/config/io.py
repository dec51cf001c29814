"""YAML in, dataclasses out, and back: the one YAML parser of user input (`load_yaml`, aliases bounded), overrides,
the type check of every value (`from_dict`, `validate`), and the config a run writes (`save_config`)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from quartet.atomic import atomic_write_text
from quartet.config.validators import seed
from quartet.errors import ConfigError


def from_dict(cls: type, data: Any, where: str = ""):
    """Build dataclass ``cls`` from a plain mapping, checking keys and types; errors name the key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (known keys: {', '.join(names)})"
            raise ConfigError(f"{path}: unknown key{hint}")
        kwargs[key] = _coerce(hints[key], _over_field_default(cls, key, value), path, _allows_non_finite(cls, key))
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a required field without default
        raise ConfigError(f"{where or cls.__name__}: {e}") from None
    return obj


def _over_field_default(cls: type, name: str, value):
    """A section given in part (a mapping) keeps its field's own defaults for the rest: `optim: {lr: 0.01}` in an
    SFT config keeps SFT's warmup and cosine schedule, not OptimConfig's class defaults."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if isinstance(value, dict) and f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
        if dataclasses.is_dataclass(default):
            return merge(to_dict(default), value)
    return value


_YAML11_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _allows_non_finite(cls: type, name: str) -> bool:
    """A float field accepts nan/inf only when it says so: ``field(metadata={"non_finite": True})``."""
    return any(f.name == name and f.metadata.get("non_finite", False) for f in dataclasses.fields(cls))


def _coerce(tp, value, where: str, non_finite: bool = False):
    """``value`` as type ``tp`` (YAML's loose forms accepted, e.g. `3e-4`), or a ConfigError naming ``where``.

    The one type check of every config value: `from_dict` runs it on what YAML gave, `validate` on what
    Python code set. Floats must be finite unless the field allows otherwise (``non_finite``).
    """
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{where}: must not be null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where, non_finite)
            except ConfigError as e:
                errors.append(str(e))
        head, tail = f"{where}: must be ", f", got {value!r}"
        if len(errors) > 1 and all(e.startswith(head) and e.endswith(tail) for e in errors):  # every alternative
            raise ConfigError(head + ", or ".join(e[len(head): -len(tail)] for e in errors) + tail)
        raise ConfigError(errors[0])
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return from_dict(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{where}: must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
            value = float(value)  # PyYAML reads `3e-4` (no dot) as a string: YAML 1.1 wants `3.0e-4`
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: must be a number, got {value!r}")
        try:
            value = float(value)
        except OverflowError:  # an integer too large for a float
            raise ConfigError(f"{where}: must be a finite number, got {value!r}") from None
        if not non_finite and not math.isfinite(value):
            raise ConfigError(f"{where}: must be a finite number, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: must be a string, got {value!r}")
        return value
    if tp is list or origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: must be a list, got {value!r}")
        return list(value)
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: must be a mapping, got {value!r}")
        return dict(value)
    return value


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


MAX_ALIAS_NODES = 10_000
"""how many nodes YAML aliases may add to a document when expanded: an anchor reused a few times adds tens to
hundreds; a "billion laughs" document, aliases of aliases of aliases, adds billions from a few lines"""


class AliasBombError(yaml.composer.ComposerError):
    """A YAML document whose aliases expand past MAX_ALIAS_NODES, or refer to themselves."""


class BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that counts the nodes each alias stands for and stops past MAX_ALIAS_NODES.

    PyYAML shares one object per anchor, so a bomb loads fast, but the first thing that copies or prints the
    value (a config check, `asdict`, an error message showing it) expands it: minutes, or a 254 MB error line.
    An alias to a node still being read (a recursive structure) is refused too: no config needs one.
    """

    def __init__(self, stream):
        super().__init__(stream)
        self._alias_nodes = 0
        self._sizes: dict[int, int] = {}
        self._open: set[str] = set()

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open:
                raise AliasBombError(None, None, f"alias *{event.anchor} refers to the node it is in",
                                     event.start_mark)
            if event.anchor in self.anchors:
                self._alias_nodes += self._size(self.anchors[event.anchor])
                if self._alias_nodes > MAX_ALIAS_NODES:
                    raise AliasBombError(None, None, f"aliases expand to more than {MAX_ALIAS_NODES} nodes "
                                         f"(a \"billion laughs\" document?)", event.start_mark)
            return super().compose_node(parent, index)
        anchor = getattr(event, "anchor", None)
        if anchor is not None and isinstance(event, yaml.CollectionStartEvent):
            self._open.add(anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            self._open.discard(anchor)

    def _size(self, node) -> int:
        """Nodes in ``node`` with every alias under it expanded (memoised: an alias is a node seen before)."""
        sizes, stack = self._sizes, [(node, False)]
        while stack:
            n, children_done = stack.pop()
            if id(n) in sizes:
                continue
            children = [c for pair in n.value for c in pair] if isinstance(n, yaml.MappingNode) else \
                n.value if isinstance(n, yaml.SequenceNode) else []
            if children_done:
                sizes[id(n)] = 1 + sum(sizes[id(c)] for c in children)
            else:
                stack.append((n, True))
                stack.extend((c, False) for c in children if id(c) not in sizes)
        return sizes[id(node)]


def load_yaml(text: str):
    """The one YAML parser of user input (config files, overrides, pipeline.yaml, a run's config.yaml): safe
    tags only, aliases bounded (`BoundedLoader`)."""
    loader = BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` strings (value parsed as YAML) onto a nested mapping."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected key=value")
        key, raw = item.split("=", 1)
        try:
            value = load_yaml(raw) if raw != "" else ""
        except AliasBombError as e:  # not a string either: refused, as the same text in a file is
            raise ConfigError(f"override '{key}': {e.problem}") from None
        except (yaml.YAMLError, ValueError, RecursionError):  # ValueError: e.g. a date with month 13
            value = raw
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override '{item}': '{part}' is not a section")
            node = nxt
        node[parts[-1]] = value
    return data


def merge(base: dict, top: dict) -> dict:
    """`top` over `base`, section by section (a new dict; neither input is changed)."""
    out = dict(base)
    for key, value in top.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():  # a FIFO or a device is refused too: reading it could wait or go on forever
        raise ConfigError(f"{path}: {'not a regular file' if path.exists() else 'config file not found'}")
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        loc = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{loc}: not valid YAML ({getattr(e, 'problem', e)})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    except (ValueError, RecursionError) as e:  # e.g. `date: 2024-13-01`, an integer of 5000 digits
        raise ConfigError(f"{path}: not valid YAML ({_one_line(e)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of keys to values")
    return data


def load_config(cls: type, path: str | Path | None = None, overrides: list[str] | None = None,
                defaults: dict | None = None):
    """Read YAML (optional) over `defaults` (a preset), apply CLI overrides, build and validate ``cls``."""
    data = merge(defaults or {}, read_yaml(path) if path else {})
    data = apply_overrides(data, overrides or [])
    cfg = from_dict(cls, data)
    validate(cfg)
    return cfg


def validate(cfg, where: str | None = None) -> None:
    """Check the tree of dataclasses: every field's type and finiteness (as `from_dict` does for YAML),
    every `seed` in numpy's range, then every ``validate(where)``, outermost last. A stage's `validate` first fills
    in the defaults that follow other fields (`resolve_lr`, `PPOConfig.resolve_auto`), so the config it leaves, and
    the config.yaml a run writes of it, holds the values used."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        path = f"{where}.{f.name}" if where else f.name
        if dataclasses.is_dataclass(value):
            validate(value, path)
            continue
        setattr(cfg, f.name, _coerce(hints[f.name], value, path, f.metadata.get("non_finite", False)))
        if f.name == "seed" and value is not None:
            seed(value, path)
    check = getattr(cfg, "validate", None)
    if check is not None:
        check(where) if where else check()


def save_config(cfg, path: str | Path, notes: list[str] | tuple[str, ...] = ()) -> Path:
    """Write `cfg` as YAML, `notes` above it as comments (a resumed run's record of what it changed)."""
    return atomic_write_text(path, "".join(f"# {n}\n" for n in notes) + config_text(cfg))


def config_text(cfg) -> str:
    """The YAML `save_config` writes (for a stage that writes its config together with other files)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
