"""Reward specs: a config string -> a checked reward function (the Reward role's loader; `scoring.Scorer` uses it).

A reward function is ``(prompts: list[str], responses: list[str]) -> list[float]``, one finite
score per response. :func:`load_reward_fn` turns a config string into one:

- ``task:<name>``: that task's gold judge (e.g. ``task:positive-review`` = VADER sentiment);
- ``task:<name>/<judge>``: another judge the task offers (``task:positive-review/on-task`` pays VADER
  only for responses about their prompt, ``task:positive-review/relevance`` is that on-task signal);
- ``judge:<name>``: a built-in judge, :data:`quartet.judges.JUDGES` (``judge:relevance``: MiniLM similarity of
  response and prompt, see :mod:`quartet.judges.relevance`; ``judge:vader``: VADER of the response);
- ``module:function`` (``function`` may be dotted, ``module:Class.method``): imported, the current
  directory is also searched so a ``my_reward.py`` next to the config works with the installed CLI;
- ``memory:<name>``: a callable given to the Python API (quartet.handles);
- ``gate(...)``, ``sum(...)``, ``min(...)`` over any of these: see :mod:`quartet.judges.compose`.

A user's callable may also have TRL's signature, ``(prompts, completions, **kwargs)`` (its ``reward_funcs``): it is
then called with those two keywords (no dataset columns are passed).

Reward-model directories are not reward functions: ``quartet.models.load_reward_model`` loads them
(the PPO trainer picks that path itself). User callables are wrapped so a wrong return (count,
type, NaN) is a one-line error naming the spec instead of a crash deep inside PPO, and each call of a
``module:function`` is bounded by a timeout (:mod:`quartet.judges.bounded`), so one that never returns is
an error naming it instead of a hung run.

The loader lives here, above the judges (scorer functions) and the tasks (which use judges), because it
resolves names from both.
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

from quartet import handles
from quartet.errors import ConfigError, ModelError
from quartet.judges import JUDGES, RewardFn
from quartet.judges.bounded import JUDGE_TIMEOUT, call_bounded
from quartet.judges.compose import is_composite, parse_composite
from quartet.tasks import get_task

_MODULE_FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def load_reward_fn(spec: str, timeout: float | None = JUDGE_TIMEOUT) -> RewardFn:
    """A reward spec (see module docstring) -> a checked reward function; each call of a user's
    ``module:function`` in it may take at most ``timeout`` seconds (None: no bound, on the caller's thread)."""
    spec = str(spec).strip()
    return _checked(_load(spec, spec, timeout), spec)


def _load(spec: str, where: str, timeout: float | None) -> Callable:
    """One spec -> its unchecked callable; errors name ``where``, the whole spec the user wrote."""
    if is_composite(spec):
        return parse_composite(spec, lambda part: _checked(_load(part, where, timeout), part), where)
    if spec.startswith("task:"):
        name, _, judge = spec[len("task:") :].partition("/")
        task = get_task(name)
        if not judge:
            return task.judge
        if judge not in task.judges:
            known = ", ".join(sorted(task.judges)) or "none"
            raise ConfigError(f"reward '{where}': task {name} has no judge '{judge}' (its judges: {known})")
        return task.judges[judge]
    if spec.startswith("judge:"):
        name = spec[len("judge:") :]
        if name not in JUDGES:
            raise ConfigError(f"reward '{where}': unknown judge '{spec}' (built-in: "
                              f"{', '.join('judge:' + k for k in JUDGES)})")
        return JUDGES[name]
    if handles.is_handle(spec):
        fn = as_reward_fn(handles.lookup(spec, "reward", ConfigError), spec, where)
        return _last_call_kept(_bounded(fn, spec, where, timeout), handles.state(spec))
    if _MODULE_FUNCTION.match(spec) and not os.path.exists(spec):
        return _bounded(_import_callable(spec, where), spec, where, timeout)
    if where != spec:
        raise ConfigError(f"reward '{where}': '{spec}' is not a judge (task:<name>, judge:<name>, "
                          f"module:function or a combination); reward-model directories cannot be combined")
    raise ModelError(
        f"reward '{spec}': not a reward function spec (task:<name>, judge:<name>, module:function or "
        f"gate/sum/min of them); reward-model directories are loaded by quartet.models.load_reward_model, "
        f"which the PPO trainer uses for them"
    )


def _import_callable(target: str, spec: str) -> Callable:
    """``module:attr.path`` -> the callable; errors name ``spec``, the whole spec it appears in."""
    module_name, attr_path = target.split(":", 1)
    module = _import(module_name, spec)
    obj = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"reward '{spec}': module '{module_name}' has no attribute '{attr_path}'")
        obj = getattr(obj, part)
    return as_reward_fn(obj, attr_path, spec)


def as_reward_fn(obj, name: str, spec: str) -> Callable:
    """``obj`` as a ``(prompts, responses)`` function: as it is, or, with TRL's signature (a ``completions``
    parameter), called with the keywords prompts= (when it takes them) and completions=. Errors name ``spec``."""
    if not callable(obj):
        raise ConfigError(f"reward '{spec}': '{name}' is a {type(obj).__name__}, not a callable")
    try:
        params = inspect.signature(obj).parameters
    except ValueError:  # some builtins have no signature; find out when it is called
        return obj
    if "completions" in params:
        takes_prompts = "prompts" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())

        @functools.wraps(obj)
        def trl_style(prompts: list[str], responses: list[str]):
            return obj(completions=responses, **({"prompts": prompts} if takes_prompts else {}))

        return trl_style
    try:
        inspect.signature(obj).bind(["prompt"], ["response"])
    except TypeError:
        raise ConfigError(f"reward '{spec}': '{name}' must accept (prompts, responses), or TRL's "
                          f"(prompts, completions, **kwargs)") from None
    return obj


def _last_call_kept(fn: Callable, state: dict) -> Callable:
    """``fn``, returning its last scores again when called again on the same prompts and responses: a reward of
    a weighted list is called for the sum and for its own rollout/reward_<name> line on one rollout, and is
    computed once (so the line logs exactly the scores that were summed)."""

    @functools.wraps(fn)
    def kept(prompts: list[str], responses: list[str]):
        last = state.get("last")
        if last is not None and last[0] == prompts and last[1] == responses:
            return last[2]
        scores = fn(prompts, responses)
        state["last"] = (list(prompts), list(responses), scores)
        return scores

    return kept


def _bounded(fn: Callable, target: str, where: str, timeout: float | None) -> Callable:
    """``fn``, each call bounded by ``timeout``; a timeout names ``target`` (the user's module:function) and the
    whole spec it is part of. Only user code is bounded: the built-in judges are Quartet's own."""
    name = f"'{target}'" if target == where else f"'{target}' (in '{where}')"

    @functools.wraps(fn)
    def bounded(prompts: list[str], responses: list[str]):
        return call_bounded(fn, (prompts, responses), timeout, name)

    return bounded


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
        except ConfigError:  # a part of a combined judge that failed its own check: its message names it
            raise
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


__all__ = ["as_reward_fn", "load_reward_fn"]
