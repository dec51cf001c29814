"""Reward callables the PPO tests name as `ppo_rewards:<function>` (importable: pytest puts this folder on sys.path)."""

import string
from collections import Counter


def letter(prompts, responses):
    """1.0 when the response is one lowercase ASCII letter, else 0.0: a reward table over one-token responses."""
    return [1.0 if len(r) == 1 and r in string.ascii_lowercase else 0.0 for r in responses]


def repeated_char(prompts, responses):
    """Pays for the count of the response's most common character: maximised by repeating one token."""
    return [max(Counter(r).values()) / 12.0 if r else 0.0 for r in responses]


def has_digit(prompts, responses):
    """1.0 when the response holds a digit, else 0.0: a right-or-wrong reward, whose groups are often all one or the
    other (dynamic sampling's case)."""
    return [float(any(c.isdigit() for c in r)) for r in responses]
