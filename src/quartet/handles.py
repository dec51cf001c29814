"""Python objects handed to the API (a loaded model, rows in memory, a reward function), named by a string.

A stage's config is a tree of strings and numbers: it is validated, saved as config.yaml and compared on resume.
So an object given in Python is registered here under a name ``memory:<label>.<n>`` and the config holds that
name; the loaders the CLI uses look it up (`models.names.resolve_model`, `data.readers.read_table`,
`rollout.rewards.load_reward_fn`). The API and the CLI then share one path from the config on, and a saved config.yaml
says which object stood where (a name that only means something inside the process that ran it).

The registry holds a reference to each object until `release` (the API releases what it registered when its
trainer is garbage-collected); the loaders never change the objects: a model is deep-copied on every load.
"""

from __future__ import annotations

import itertools
import re
import threading

PREFIX = "memory:"

_OBJECTS: dict[str, tuple[str, object, dict]] = {}  # name -> (kind, object, the loaders' state for it)
_COUNTER = itertools.count(1)
_LOCK = threading.Lock()
KINDS = ("model", "data", "reward")


def register(kind: str, obj, label: str) -> str:
    """Hold ``obj`` (of ``kind``: model, data or reward) and return the name a config refers to it by."""
    if kind not in KINDS:
        raise ValueError(f"handles.register: kind must be one of {KINDS}, got {kind!r}")
    safe = re.sub(r"[^\w.-]+", "_", str(label)).strip("_.") or kind
    with _LOCK:
        name = f"{PREFIX}{safe}.{next(_COUNTER)}"
        _OBJECTS[name] = (kind, obj, {})
    return name


def is_handle(name) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def lookup(name: str, kind: str, error: type[Exception]):
    """The object registered as ``name``, or ``error`` (the loader's own one-line error class) when there is no
    object of ``kind`` under that name."""
    entry = _OBJECTS.get(name)
    if entry is None or entry[0] != kind:
        raise error(f"{name}: no {kind} by that name in this process (a memory: name stands for an object given "
                    f"to quartet's Python API, and only while its trainer lives)")
    return entry[1]


def state(name: str) -> dict:
    """A dict a loader may keep per object, shared by every load of ``name`` and dropped with it (the reward
    loader keeps the last call's scores there: see quartet.rollout.rewards)."""
    return _OBJECTS[name][2]


def release(names) -> None:
    """Drop the registry's references to ``names`` (names already released are ignored)."""
    with _LOCK:
        for name in names:
            _OBJECTS.pop(name, None)


__all__ = ["PREFIX", "is_handle", "lookup", "register", "release", "state"]
