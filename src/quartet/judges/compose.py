"""Judges built from judges: a reward spec may combine other reward specs.

    gate(SCORE, BY, lo=L, hi=H, floor=F)   SCORE where BY >= H, F where BY <= L, linear in between:
                                           F + w * (score - F), w = clamp((by - L) / (H - L), 0, 1)
                                           (a step at BY >= H when L == H; F defaults to 0)
    sum(A, 0.3*B, -0.01*C, ...)            weighted sum (weight 1 when none is written)
    min(A, B, ...)                         the lowest score: pays only what every judge grants

Every argument is itself a reward spec (``task:<name>[/<judge>]``, ``judge:<name>``, ``module:function``
or another combination), so ``gate(task:positive-review, judge:relevance, lo=0.25, hi=0.45, floor=-1)``
pays VADER sentiment only for responses about their prompt, and an off-task one gets the floor. With a
floor at or below SCORE's minimum, the gated score never rewards leaving the task: it rises with
relevance for every response.

The functions here (`gate`, `weighted_sum`, `minimum`) also combine judges in Python, as the built-in
tasks do; each returns a ``(prompts, responses) -> (N,) float32 tensor`` judge.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from quartet.errors import ConfigError

Judge = Callable[[list[str], list[str]], object]

_CALL = re.compile(r"^([A-Za-z_]\w*)\s*\((.*)\)$", re.S)
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_WEIGHTED = re.compile(rf"^({_NUMBER})\s*\*\s*(.+)$", re.S)
_KEYWORD = re.compile(r"^([A-Za-z_]\w*)\s*=\s*(.*)$", re.S)


def _tensor(scores) -> torch.Tensor:
    if isinstance(scores, torch.Tensor):
        return scores.detach().to(torch.float32).flatten()
    return torch.tensor([float(s) for s in scores], dtype=torch.float32)


def gate(score: Judge, by: Judge, lo: float, hi: float, floor: float = 0.0) -> Judge:
    """``score`` where ``by`` >= hi, ``floor`` where ``by`` <= lo, linear in between (see module docstring)."""
    if hi < lo:
        raise ValueError(f"gate: lo ({lo}) must not exceed hi ({hi})")

    def gated(prompts: list[str], responses: list[str]) -> torch.Tensor:
        s, b = _tensor(score(prompts, responses)), _tensor(by(prompts, responses))
        w = (b >= hi).float() if hi == lo else ((b - lo) / (hi - lo)).clamp(0.0, 1.0)
        return floor + w * (s - floor)

    return gated


def weighted_sum(terms: list[tuple[float, Judge]]) -> Judge:
    """sum_i w_i * judge_i(prompts, responses)."""

    def total(prompts: list[str], responses: list[str]) -> torch.Tensor:
        out = torch.zeros(len(responses))
        for w, fn in terms:
            out = out + w * _tensor(fn(prompts, responses))
        return out

    return total


def minimum(judges: list[Judge]) -> Judge:
    """The elementwise lowest of the judges' scores."""

    def lowest(prompts: list[str], responses: list[str]) -> torch.Tensor:
        return torch.stack([_tensor(fn(prompts, responses)) for fn in judges]).min(dim=0).values

    return lowest


# --------------------------------------------------------------------------- spec parsing
def is_composite(spec: str) -> bool:
    return "(" in spec or ")" in spec


def parse_composite(spec: str, load: Callable[[str], Judge], where: str | None = None) -> Judge:
    """``gate(...)`` / ``sum(...)`` / ``min(...)`` -> a judge; ``load`` turns each argument into one.

    A malformed spec is a one-line ConfigError naming the whole spec (``where``) and the bad part.
    """
    where = where or spec

    def fail(msg: str):
        raise ConfigError(f"reward '{where}': {msg}")

    text = spec.strip()
    _split_args(text, fail)  # balanced parentheses, before anything else is read
    m = _CALL.match(text)
    if not m:
        fail(f"'{text}' is not a combination (gate(...), sum(...) or min(...))")
    name, inner = m.group(1), m.group(2)
    args = _split_args(inner, fail)
    positional, keywords = [], {}
    for arg in args:
        kw = _KEYWORD.match(arg)
        if kw:
            key, value = kw.group(1), kw.group(2).strip()
            if key in keywords:
                fail(f"{name}(): {key}= given twice")
            try:
                keywords[key] = float(value)
            except ValueError:
                fail(f"{name}(): {key}={value!r} is not a number")
            continue
        if keywords:
            fail(f"{name}(): judge '{arg}' after a keyword argument")
        positional.append(arg)

    def judges(args, weights=False):
        out = []
        for a in args:
            w = _WEIGHTED.match(a) if weights else None
            if w:
                out.append((float(w.group(1)), load(w.group(2).strip())))
            else:
                if not weights and _WEIGHTED.match(a):
                    fail(f"{name}(): weights (w*judge) only go inside sum(), got '{a}'")
                out.append((1.0, load(a)) if weights else load(a))
        return out

    def allowed(*keys, required=()):
        extra = sorted(set(keywords) - set(keys))
        if extra:
            fail(f"{name}(): unknown argument {extra[0]}= (allowed: {', '.join(k + '=' for k in keys) or 'none'})")
        missing = [k for k in required if k not in keywords]
        if missing:
            fail(f"{name}(): needs {', '.join(k + '=' for k in missing)}")

    if name == "gate":
        allowed("lo", "hi", "floor", required=("lo", "hi"))
        if len(positional) != 2:
            fail(f"gate() takes two judges (score, by), got {len(positional)}")
        if keywords["hi"] < keywords["lo"]:
            fail(f"gate(): lo={keywords['lo']:g} must not exceed hi={keywords['hi']:g}")
        score, by = judges(positional)
        return gate(score, by, keywords["lo"], keywords["hi"], keywords.get("floor", 0.0))
    if name == "sum":
        allowed()
        if not positional:
            fail("sum() needs at least one judge")
        return weighted_sum(judges(positional, weights=True))
    if name == "min":
        allowed()
        if len(positional) < 2:
            fail(f"min() needs at least two judges, got {len(positional)}")
        return minimum(judges(positional))
    fail(f"unknown combination '{name}(...)' (known: gate, sum, min)")


def _split_args(inner: str, fail) -> list[str]:
    """Split at the commas outside parentheses; each argument stripped and non-empty."""
    args, depth, start = [], 0, 0
    for i, ch in enumerate(inner):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                fail("unbalanced parentheses")
        elif ch == "," and depth == 0:
            args.append(inner[start:i])
            start = i + 1
    if depth != 0:
        fail("unbalanced parentheses")
    args.append(inner[start:])
    args = [a.strip() for a in args]
    if any(not a for a in args):
        fail("empty argument (two commas in a row, or a trailing comma)")
    return args


__all__ = ["gate", "is_composite", "minimum", "parse_composite", "weighted_sum"]
