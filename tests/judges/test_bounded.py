"""A user's reward or judge callable is bounded in time (quartet.judges.bounded): a call that does not return is
one error naming it; what it returns or raises goes through the same checks as before. In-process cases here
block on an event that the test releases at its end, so no thread outlives its test; the real hangs (sleep
forever, a busy loop) run as CLI processes in tests/cli/test_judge_timeout.py."""

from __future__ import annotations

import math
import sys
import threading
import time

import pytest
import torch

from quartet.config import EvalConfig, LabelConfig, PPOConfig
from quartet.errors import ConfigError
from quartet.judges.bounded import JUDGE_TIMEOUT, JudgeTimeout, call_bounded
from quartet.rollout.rewards import load_reward_fn
from quartet.rollout.scoring import Scorer

USER_MODULE = """
import math, signal, threading
release = threading.Event()
def blocks(prompts, responses):
    release.wait(30)  # unbounded, the test fails after 30 s instead of hanging
    return [0.0] * len(responses)
def too_few(prompts, responses):
    return [1.0]
def nan(prompts, responses):
    return [math.nan] * len(responses)
def raises(prompts, responses):
    raise KeyError('label')
def nothing(prompts, responses):
    return None
def grad_mode(prompts, responses):
    import torch
    return [float(torch.is_grad_enabled())] * len(responses)
def on_main_thread(prompts, responses):
    return [float(threading.current_thread() is threading.main_thread())] * len(responses)
def sets_an_alarm(prompts, responses):
    signal.signal(signal.SIGALRM, lambda *a: None)  # as math_verify's own timeouts do
    return [0.0] * len(responses)
"""


@pytest.fixture
def slow_rewards(tmp_path, monkeypatch):
    (tmp_path / "slow_rewards.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import slow_rewards

    yield slow_rewards
    slow_rewards.release.set()  # the timed-out calls' threads return and end
    sys.modules.pop("slow_rewards", None)


def test_a_call_that_does_not_return_is_one_error_naming_the_callable(slow_rewards):
    fn = load_reward_fn("slow_rewards:blocks", timeout=0.3)
    start = time.monotonic()
    with pytest.raises(JudgeTimeout) as info:
        fn(["p"], ["r"])
    assert 0.3 <= time.monotonic() - start < 5
    assert str(info.value) == ("reward 'slow_rewards:blocks' did not return within 0.3 s (judge_timeout); it may be "
                               "stuck, or raise judge_timeout if it is only slow")
    assert isinstance(info.value, ConfigError)  # the CLI's one-line error, exit 2


def test_a_timeout_inside_a_combination_names_the_part_and_the_whole(slow_rewards):
    spec = "sum(task:tiny-target, 0.5*slow_rewards:blocks)"
    with pytest.raises(JudgeTimeout, match=r"^reward 'slow_rewards:blocks' \(in 'sum\(task:tiny-target, "
                                           r"0.5\*slow_rewards:blocks\)'\) did not return within 0.2 s"):
        load_reward_fn(spec, timeout=0.2)(["p"], ["aab"])


@pytest.mark.parametrize("timeout", [JUDGE_TIMEOUT, None])
@pytest.mark.parametrize("name,message", [
    ("too_few", "reward 'slow_rewards:too_few': returned 1 scores for 2 responses (need one each)"),
    ("nan", "reward 'slow_rewards:nan': score 0 is nan, not finite"),
    ("raises", "reward 'slow_rewards:raises' raised KeyError: 'label'"),
    ("nothing", "reward 'slow_rewards:nothing': must return a list of floats, got NoneType"),
])
def test_wrong_returns_and_exceptions_still_get_their_own_error(slow_rewards, name, message, timeout):
    fn = load_reward_fn(f"slow_rewards:{name}", timeout=timeout)
    with pytest.raises(ConfigError) as info:
        fn(["p", "q"], ["r", "s"])
    assert str(info.value) == message and not isinstance(info.value, JudgeTimeout)


def test_the_exception_the_callable_raised_is_raised_to_the_caller():
    err = OSError("disk")

    def fails():
        raise err

    with pytest.raises(OSError) as info:
        call_bounded(fails, (), 5.0, "'m:f'")
    assert info.value is err


def test_grad_mode_is_the_callers(slow_rewards):
    """torch's grad mode is per thread: the worker runs in the caller's (PPO scores under no_grad)."""
    fn = load_reward_fn("slow_rewards:grad_mode")
    with torch.no_grad():
        assert fn(["p"], ["r"]) == [0.0]
    assert fn(["p"], ["r"]) == [1.0]


def test_no_timeout_calls_on_the_callers_thread(slow_rewards):
    assert load_reward_fn("slow_rewards:on_main_thread", timeout=None)(["p"], ["r"]) == [1.0]
    assert load_reward_fn("slow_rewards:on_main_thread", timeout=30)(["p"], ["r"]) == [0.0]
    assert load_reward_fn("slow_rewards:sets_an_alarm", timeout=None)(["p"], ["r"]) == [0.0]


def test_code_that_needs_the_main_thread_is_told_how_to_run(slow_rewards):
    with pytest.raises(ConfigError, match=r"^reward 'slow_rewards:sets_an_alarm' raised ValueError: signal only "
                                          r"works in main thread.*set judge_timeout: null"):
        load_reward_fn("slow_rewards:sets_an_alarm")(["p"], ["r"])


def test_a_timeout_beyond_what_a_wait_accepts_is_no_bound():
    assert call_bounded(lambda: 7, (), 1e300, "'m:f'") == 7
    assert call_bounded(lambda: 7, (), math.inf, "'m:f'") == 7


def test_the_scorer_passes_its_timeout_on(slow_rewards):
    with pytest.raises(JudgeTimeout, match="'slow_rewards:blocks' did not return within 0.2 s"):
        Scorer("slow_rewards:blocks", timeout=0.2)(["p"], ["r"])


def test_built_in_judges_are_not_bounded(monkeypatch):
    """Only user code: a built-in judge is Quartet's own and runs on the caller's thread, whatever the timeout."""
    from quartet.judges import JUDGES

    seen = []
    monkeypatch.setitem(JUDGES, "spy", lambda p, r: seen.append(threading.current_thread()) or [0.0] * len(r))
    assert load_reward_fn("judge:spy", timeout=1e-6)(["p"], ["r"]) == [0.0]
    assert seen == [threading.current_thread()]


@pytest.mark.parametrize("value,message", [
    (0, "must be > 0, got 0"), (-1.0, "must be > 0, got -1.0"), (math.nan, "must be a finite number"),
    ("soon", "must be a number, got 'soon'"), (True, "must be a number"),
])
def test_the_timeout_setting_is_validated(value, message):
    for cfg, where in ((PPOConfig(judge_timeout=value), "ppo.judge_timeout"),
                       (LabelConfig(judge_timeout=value), "label.judge_timeout")):
        with pytest.raises(ConfigError, match=f"^{where}: {message}"):
            cfg.validate()
    with pytest.raises(ConfigError, match=f"^judge_timeout: {message}"):
        EvalConfig(judge_timeout=value).validate()


def test_the_default_is_generous_and_none_is_allowed():
    assert JUDGE_TIMEOUT == 600.0
    assert PPOConfig().judge_timeout == LabelConfig().judge_timeout == EvalConfig().judge_timeout == JUDGE_TIMEOUT
    for cfg in (PPOConfig(judge_timeout=None), LabelConfig(judge_timeout=None), EvalConfig(judge_timeout=None)):
        cfg.validate()
