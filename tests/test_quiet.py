"""Quiet by default: the libraries' warnings, log records and progress bars show only with `-v`."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import warnings

from quartet.quiet import quiet_third_party

NOISE = {
    "peft's fan_in_fan_out warning": "fan_in_fan_out",  # LoRA on GPT-2's Conv1D: peft fixes it and warns
    "transformers' logger": "loss_type=None",
    "transformers' save bar": "Writing model shards",
}


def test_cli_is_quiet_without_v_and_shows_it_all_with_v(tmp_path):
    data = tmp_path / "demo.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"key {i}", "completion": "abcdefgh"}) + "\n" for i in range(8)))

    def sft(*flags, out):
        return subprocess.run(
            [sys.executable, "-m", "quartet.cli", *flags, "sft", "model=tiny:gpt2?hidden=32&layers=1&heads=4&vocab=260",
             f"data.path={data}", "data.chat_template=false", f"output_dir={tmp_path / out}", "max_steps=1",
             "batch_size=4", "eval_fraction=0", "precision=fp32", "lora.enabled=true", "lora.r=4"],
            capture_output=True, text=True, timeout=300)

    quiet, verbose = sft(out="quiet"), sft("-v", out="verbose")
    assert quiet.returncode == 0 and verbose.returncode == 0, quiet.stderr + verbose.stderr
    for what, text in NOISE.items():
        assert text not in quiet.stderr, what
        assert text in verbose.stderr, what  # the noise is real: -v shows it
    assert "Warning" not in quiet.stderr
    assert "sft 1/1" in quiet.stderr  # the stage's own bar stays


def test_the_switch_covers_the_gguf_bar_warnings_and_loggers_and_is_undone():
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    quiet_third_party(verbose=True)  # undo what an earlier test's `quartet.X` (quiet by default) switched off
    torch_level = logging.getLogger("torch").level
    try:
        quiet_third_party(verbose=False)
        assert not hf_logging.is_progress_bar_enabled() and hf_logging.get_verbosity() == logging.ERROR
        # the GGUF loader's de-quantising bar is drawn through transformers' switch, which is off
        assert gguf_utils.tqdm is hf_logging.tqdm
        assert type(gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors...")).__name__ == \
            "EmptyTqdm"
        assert logging.getLogger("peft").level == logging.ERROR
        with warnings.catch_warnings(record=True) as caught:
            warnings.warn_explicit("inside peft", UserWarning, "layer.py", 1, module="peft.tuners.lora.layer")
            warnings.warn_explicit("inside transformers", FutureWarning, "m.py", 1, module="transformers.modeling")
            warnings.warn_explicit("a user's own", UserWarning, "mine.py", 1, module="mine")
        assert [str(w.message) for w in caught] == ["a user's own"]

        quiet_third_party(verbose=True)
        assert hf_logging.is_progress_bar_enabled() and hf_logging.get_verbosity() == logging.WARNING
        assert type(gguf_utils.tqdm(range(3), disable=True)).__name__ != "EmptyTqdm"
        assert logging.getLogger("torch").level == torch_level  # its own level back, not NOTSET
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warnings.warn_explicit("inside peft", UserWarning, "layer.py", 1, module="peft.tuners.lora.layer")
        assert len(caught) == 1
    finally:
        quiet_third_party(verbose=True)
