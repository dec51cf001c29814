"""Reward functions: the gold judges of the built-in tasks, and user callables, behind one signature.

A reward function is ``(prompts: list[str], responses: list[str]) -> list[float]``, one finite
score per response. :func:`load_reward_fn` turns a config string into one:

- ``task:<name>``: that task's gold judge (e.g. ``task:positive-review`` = VADER sentiment);
- ``module:function`` (``function`` may be dotted, ``module:Class.method``): imported, the current
  directory is also searched so a ``my_reward.py`` next to the config works with the installed CLI.

Reward-model directories are not reward functions: ``quartet.models.load_reward_model`` loads them
(the PPO trainer picks that path itself). User callables are wrapped so a wrong return (count,
type, NaN) is a one-line error naming the spec instead of a crash deep inside PPO.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import os
import re
import sys
from collections.abc import Callable

from quartet.errors import ConfigError, ModelError
from quartet.judges.vader import vader_score

RewardFn = Callable[[list[str], list[str]], list[float]]

_MODULE_FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def load_reward_fn(spec: str) -> RewardFn:
    """``task:<name>`` or ``module:function`` -> a checked reward function (see module docstring)."""
    spec = str(spec).strip()
    if spec.startswith("task:"):
        from quartet.tasks import get_task

        task = get_task(spec[len("task:") :])
        return _checked(task.judge, spec)
    if _MODULE_FUNCTION.match(spec) and not os.path.exists(spec):
        return _checked(_import_callable(spec), spec)
    raise ModelError(
        f"reward '{spec}': not a reward function spec (task:<name> or module:function); reward-model "
        f"directories are loaded by quartet.models.load_reward_model, which the PPO trainer uses for them"
    )


def _import_callable(spec: str) -> Callable:
    module_name, attr_path = spec.split(":", 1)
    module = _import(module_name, spec)
    obj = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"reward '{spec}': module '{module_name}' has no attribute '{attr_path}'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"reward '{spec}': '{attr_path}' is a {type(obj).__name__}, not a callable")
    try:
        inspect.signature(obj).bind(["prompt"], ["response"])
    except TypeError:
        raise ConfigError(f"reward '{spec}': '{attr_path}' must accept (prompts, responses)") from None
    except ValueError:  # some builtins have no signature; find out when it is called
        pass
    return obj


def _import(module_name: str, spec: str):
    for attempt in range(2):
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            missing = e.name or ""
            if not (missing == module_name or module_name.startswith(missing + ".")):
                raise ConfigError(
                    f"reward '{spec}': importing '{module_name}' failed: No module named '{missing}'"
                ) from e
            if attempt == 0 and os.getcwd() not in sys.path:  # the installed CLI does not search cwd
                sys.path.append(os.getcwd())
                continue
            raise ConfigError(f"reward '{spec}': no module named '{module_name}' (looked on sys.path and in "
                              f"the current directory)") from None
        except Exception as e:  # a user module that fails to import: one line, cause kept for debugging
            raise ConfigError(f"reward '{spec}': importing '{module_name}' failed ({type(e).__name__}: {e})") from e
    raise AssertionError("unreachable")


def _checked(fn: Callable, spec: str) -> RewardFn:
    """Wrap ``fn`` so it returns exactly one finite float per response, or says why not in one line."""

    @functools.wraps(fn)
    def reward_fn(prompts: list[str], responses: list[str]) -> list[float]:
        try:
            scores = fn(list(prompts), list(responses))
        except Exception as e:
            raise ConfigError(f"reward '{spec}' raised {type(e).__name__}: {e}") from e
        if isinstance(scores, (str, bytes)) or not hasattr(scores, "__len__"):
            raise ConfigError(f"reward '{spec}': must return a list of floats, got {type(scores).__name__}")
        if len(scores) != len(responses):
            raise ConfigError(
                f"reward '{spec}': returned {len(scores)} scores for {len(responses)} responses (need one each)"
            )
        out = []
        for i, s in enumerate(scores):
            try:
                if isinstance(s, (str, bytes)) or s is None:
                    raise TypeError
                value = float(s)
            except (TypeError, ValueError):
                raise ConfigError(f"reward '{spec}': score {i} is {s!r}, not a number") from None
            if not math.isfinite(value):
                raise ConfigError(f"reward '{spec}': score {i} is {value}, not finite")
            out.append(value)
        return out

    reward_fn.spec = spec
    return reward_fn


__all__ = ["RewardFn", "load_reward_fn", "vader_score"]
