"""Callbacks: user code the training loops call at their events, in the shape of transformers' TrainerCallback.

A callback is any object with some of these methods, each called as transformers calls it,
``(args, state, control, **kwargs)``, where ``args`` is the stage's config, ``state`` a :class:`TrainerState` and
``control`` a :class:`TrainerControl`:

    on_train_begin   before the first step
    on_step          after each optimizer step (SFT, RM, DPO) or iteration (PPO family); transformers' name
                     ``on_step_end`` is called when there is no ``on_step``
    on_log           after each metrics line, with ``logs`` (the metrics just logged)
    on_evaluate      after each held-out pass (SFT, RM, DPO), with ``metrics``
    on_save          after a checkpoint (PPO) or the final model is written, with ``checkpoint`` (its folder)
    on_train_end     after the last step, before the final model is saved

``kwargs`` also hold ``model`` (the model being trained, unwrapped) and ``tokenizer``. Setting
``control.should_training_stop = True`` (or ``control.should_stop``), or returning a control that has it set, in
``on_step`` ends training after that step (set in another event: after the next step): the stage finishes as if
that were its last step (its metrics logged, held-out pass run, model saved, summary written). So a ``transformers.TrainerCallback`` subclass works unchanged when it
reads only ``state.global_step``, ``state.max_steps``, ``state.log_history`` and the ``logs`` / ``metrics`` passed.

Under N processes every process calls the callbacks (the metrics are global, the same on each), and a stop
asked on any process stops all of them at the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quartet.errors import ConfigError

EVENTS = ("on_train_begin", "on_step", "on_step_end", "on_log", "on_evaluate", "on_save", "on_train_end")


@dataclass
class TrainerState:
    """What the loop has done so far (transformers' TrainerState fields of the same names)."""

    stage: str
    max_steps: int
    global_step: int = 0
    log_history: list[dict] = field(default_factory=list)
    """every metrics line logged so far, each with its "step" """
    is_world_process_zero: bool = True


@dataclass
class TrainerControl:
    """Set ``should_training_stop`` (transformers' name) or ``should_stop`` to end training after this step."""

    should_training_stop: bool = False

    @property
    def should_stop(self) -> bool:
        return self.should_training_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self.should_training_stop = bool(value)


class Callback:
    """A base class with every event as a no-op: override the ones you need (a transformers.TrainerCallback, or
    any object with some of these methods, works too)."""

    def on_train_begin(self, args, state: TrainerState, control: TrainerControl, **kwargs): ...

    def on_step(self, args, state: TrainerState, control: TrainerControl, **kwargs): ...

    def on_log(self, args, state: TrainerState, control: TrainerControl, logs: dict | None = None, **kwargs): ...

    def on_evaluate(self, args, state: TrainerState, control: TrainerControl, metrics: dict | None = None,
                    **kwargs): ...

    def on_save(self, args, state: TrainerState, control: TrainerControl, **kwargs): ...

    def on_train_end(self, args, state: TrainerState, control: TrainerControl, **kwargs): ...


def check_callbacks(callbacks) -> list:
    """The callbacks as a list of objects (a class is instantiated, as transformers does), or a ConfigError naming
    one that has none of the events."""
    if callbacks is None:
        return []
    items = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    out = []
    for i, cb in enumerate(items):
        cb = cb() if isinstance(cb, type) else cb
        if not any(callable(getattr(cb, name, None)) for name in EVENTS):
            raise ConfigError(f"callbacks[{i}]: {type(cb).__name__} has none of the callback methods "
                              f"({', '.join(EVENTS)})")
        out.append(cb)
    return out


class CallbackHandler:
    """Calls every callback at each event of one training loop and keeps the shared state and control.

    A loop without callbacks pays nothing: each event returns at once."""

    def __init__(self, callbacks, args, stage: str, max_steps: int, accelerator=None, **objects):
        self.callbacks = check_callbacks(callbacks)
        self.args, self.accelerator, self.objects = args, accelerator, objects
        main = accelerator is None or accelerator.is_main_process
        self.state = TrainerState(stage, max_steps, is_world_process_zero=main)
        self.control = TrainerControl()

    def train_begin(self) -> None:
        self._call("on_train_begin")

    def step(self, step: int) -> bool:
        """After step ``step``; whether training should stop after it (agreed by every process)."""
        self.state.global_step = step
        self._call("on_step")
        if self.callbacks and self.accelerator is not None and self.accelerator.num_processes > 1:
            flag = torch.tensor([float(self.control.should_training_stop)], device=self.accelerator.device)
            self.control.should_training_stop = bool(self.accelerator.reduce(flag, "max").item())
        return self.should_stop

    def log(self, step: int, logs: dict) -> None:
        if not self.callbacks:
            return
        self.state.log_history.append({**logs, "step": step})
        self._call("on_log", logs=dict(logs))

    def evaluate(self, metrics: dict) -> None:
        self._call("on_evaluate", metrics=dict(metrics))

    def save(self, checkpoint) -> None:
        self._call("on_save", checkpoint=checkpoint)

    def train_end(self) -> None:
        self._call("on_train_end")

    @property
    def should_stop(self) -> bool:
        return self.control.should_training_stop

    def _call(self, event: str, **kwargs) -> None:
        for cb in self.callbacks:
            method = getattr(cb, event, None)
            if method is None and event == "on_step":
                method = getattr(cb, "on_step_end", None)
            if method is None:
                continue
            result = method(self.args, self.state, self.control, **self.objects, **kwargs)
            if result is not None and getattr(result, "should_training_stop", False):
                self.control.should_training_stop = True


__all__ = ["Callback", "CallbackHandler", "TrainerControl", "TrainerState", "check_callbacks"]
