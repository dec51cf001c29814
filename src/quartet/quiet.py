"""What the libraries under Quartet print: quiet by default, everything with `-v` (`quiet_third_party`).

transformers, peft, accelerate and torch print warnings about their own internals (a deprecated property that peft
reads, the LoRA layout peft fixes itself, an unrecognised `loss_type`) and draw progress bars for every load and
save (the GGUF de-quantising bar, "Loading weights", "Writing model shards"). None is something a Quartet user can
act on: Quartet makes those calls. Each stage draws one bar of its own (quartet.monitor.metrics.Progress, the PPO
iteration bar), and Quartet's own warnings go through the `quartet` logger, which this module does not touch.
"""

from __future__ import annotations

import logging
import re
import warnings

THIRD_PARTY = ("transformers", "peft", "accelerate", "huggingface_hub", "tokenizers", "gguf", "torch")
"""packages whose warnings and log records are hidden unless verbose"""

_MODULES = re.compile(rf"({'|'.join(THIRD_PARTY)})(\..*)?$")
_FILTER = ("ignore", None, Warning, _MODULES, 0)
"""the one `warnings` filter this module installs: any warning raised inside those packages"""

_configured = False
_levels: dict[str, int] = {}
"""each quieted logger's level before: restored by quiet_third_party(verbose=True)"""


def quiet_third_party(verbose: bool = False) -> None:
    """Hide (``verbose=False``) or show (``verbose=True``) the warnings, log records and progress bars of the
    libraries under Quartet. The CLI calls it with `-v`; the Python API (`quartet.<name>`) calls
    `quiet_by_default`, so a user who called this first keeps their choice. Idempotent and reversible."""
    global _configured
    _configured = True
    for name in THIRD_PARTY:
        if name == "transformers":  # set through its own switch (below)
            continue
        logger = logging.getLogger(name)
        if verbose:  # the level it had (torch sets its own): NOTSET would pass the root's DEBUG to it
            logger.setLevel(_levels.pop(name, logger.level))
        else:
            _levels.setdefault(name, logger.level)
            logger.setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    if verbose:
        hf_logging.set_verbosity_warning()  # transformers' own default
        hf_logging.enable_progress_bar()
    else:
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    _gguf_bar_follows_switch(hf_logging)
    _set_warnings(verbose)  # last: importing torch above puts its own filters first


def quiet_by_default() -> None:
    """`quiet_third_party()` unless it was already called in this process (by the CLI or the user)."""
    if not _configured:
        quiet_third_party()


def _set_warnings(verbose: bool) -> None:
    while _FILTER in warnings.filters:
        warnings.filters.remove(_FILTER)
    if not verbose:
        warnings.filters.insert(0, _FILTER)
    warnings._filters_mutated()  # the per-module "already shown" registries follow the new filters


def _gguf_bar_follows_switch(hf_logging) -> None:
    """transformers' GGUF loader draws its de-quantising bar (one step per tensor, 272 for SmolLM2) with plain
    tqdm, past the switch `disable_progress_bar` sets: point its name at transformers' own tqdm, which obeys the
    switch."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # a transformers without GGUF support draws no GGUF bar
        return
    if hasattr(gguf_utils, "tqdm"):
        gguf_utils.tqdm = hf_logging.tqdm
