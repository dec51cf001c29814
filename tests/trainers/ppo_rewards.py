"""Reward callables the PPO tests name as `ppo_rewards:<function>` (importable: pytest puts this folder on sys.path)."""

import string


def letter(prompts, responses):
    """1.0 when the response is one lowercase ASCII letter, else 0.0: a reward table over one-token responses."""
    return [1.0 if len(r) == 1 and r in string.ascii_lowercase else 0.0 for r in responses]


def repeated_z(prompts, responses):
    """Pays for every 'z': a hackable reward that a policy maximises by repeating one token."""
    return [r.count("z") / 8.0 for r in responses]
