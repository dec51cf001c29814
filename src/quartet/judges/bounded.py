"""User code with a time limit: a reward or judge callable that does not answer in time is one error, not a hung run.

How: the call runs in a fresh *daemon* thread and the caller waits for it at most ``timeout`` seconds.
Why this and not the alternatives:

- ``signal.setitimer`` / SIGALRM works only on the main thread and shares the one ITIMER_REAL with the user's
  code: a reward that bounds its own steps with ``signal.alarm`` (math_verify does by default) would replace or
  cancel our timer, and a ``TimeoutError`` raised inside the user's ``try/except Exception`` would be swallowed.
- a subprocess would need the callable and its arguments pickled and pays a process start per call.
- a thread cannot be killed, but it need not be: the caller raises :class:`JudgeTimeout`, the CLI prints one
  ``error:`` line and the process exits, and interpreter shutdown joins non-daemon threads only, so a hung daemon
  thread (asleep, blocked on a socket, or looping in Python, which hands the GIL back every switch interval) does
  not hold the exit. (``concurrent.futures`` workers are joined at exit, so a hung one would hang the exit.)
  In a process that lives on (a notebook) the abandoned thread runs until its call returns.

What a thread changes for the callable: torch keeps grad mode and the current CUDA device per thread, so both are
carried over from the caller. Code that must run on the main thread (``signal.signal``, e.g. math_verify's own
timeouts) fails there: pass its own timeouts off (math_verify: ``timeout_seconds=None``), or set the timeout to
None to call it on the caller's thread, unbounded. A C extension that holds the GIL and never returns cannot be
interrupted by any in-process means; only the thread approach at least survives C code that releases the GIL.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from quartet.config import JUDGE_TIMEOUT  # the configs' `judge_timeout` default, the callers' too
from quartet.errors import ConfigError


class JudgeTimeout(ConfigError):
    """A user's reward or judge callable did not return within its timeout."""


def call_bounded(fn: Callable, args: tuple, timeout: float | None, name: str):
    """``fn(*args)``, or :class:`JudgeTimeout` naming ``name`` once ``timeout`` seconds pass without an answer.

    What ``fn`` raises is raised here; ``timeout=None`` calls ``fn`` on this thread with no bound. ``name`` is how
    errors name the callable, quoted: ``"'my_rewards:score'"``.
    """
    if timeout is None:
        return fn(*args)
    result: dict = {}
    done = threading.Event()
    grad = torch.is_grad_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def run() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            with torch.set_grad_enabled(grad):
                result["value"] = fn(*args)
        except BaseException as e:  # SystemExit too: handed to the caller, which raises it as its own
            result["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name=f"quartet judge {name}", daemon=True).start()
    # a timeout past what a lock wait accepts (OverflowError) is no bound at all
    if not done.wait(min(timeout, threading.TIMEOUT_MAX)):
        raise JudgeTimeout(
            f"reward {name} did not return within {timeout:g} s (judge_timeout); it may be stuck, or raise "
            f"judge_timeout if it is only slow"
        )
    if "error" in result:
        error = result.pop("error")
        if isinstance(error, ValueError) and "main thread" in str(error):
            raise ConfigError(
                f"reward {name} raised ValueError: {error}; it runs in a worker thread so that judge_timeout can "
                f"bound it: turn off its own signal-based timeouts, or set judge_timeout: null to run it on the "
                f"main thread without a bound"
            ) from error
        raise error
    return result["value"]


__all__ = ["JUDGE_TIMEOUT", "JudgeTimeout", "call_bounded"]
