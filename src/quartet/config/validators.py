"""The checks every config's `validate` is built from, each a one-line ConfigError naming the field (`where`).

Each first requires a finite real number (not a bool), so a config built in Python with a wrong type or a NaN gets
the same one-line error as one read from YAML. Other settings classes (quartet.eval's, the pipeline's eval stage)
use them too.
"""

from __future__ import annotations

import math
import numbers

from quartet.errors import ConfigError


def number(value, where: str) -> None:
    """A finite real number, not a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{where}: must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{where}: must be a finite number, got {value!r}")


def positive(value, where: str) -> None:
    """A number > 0."""
    number(value, where)
    if not value > 0:
        raise ConfigError(f"{where}: must be > 0, got {value!r}")


def non_negative(value, where: str) -> None:
    """A number >= 0."""
    number(value, where)
    if not value >= 0:
        raise ConfigError(f"{where}: must be >= 0, got {value!r}")


def in_range(value, lo: float, hi: float, where: str) -> None:
    """A number in [lo, hi]."""
    number(value, where)
    if not lo <= value <= hi:
        raise ConfigError(f"{where}: must be in [{lo}, {hi}], got {value!r}")


SEED_MAX = 2**32 - 1
"""numpy's seed range, which transformers' set_seed passes every seed through"""


def seed(value, where: str) -> None:
    """A seed numpy takes: an integer-valued number in [0, SEED_MAX]."""
    in_range(value, 0, SEED_MAX, where)
