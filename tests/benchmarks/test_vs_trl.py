"""benchmarks/vs_trl.py: the per-phase floors it prints, against hand-worked numbers (no TRL needed)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vs_trl.py"


@pytest.fixture(scope="module")
def vs_trl():
    spec = importlib.util.spec_from_file_location("vs_trl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# a 1000-parameter LM with a 200-parameter (tied) embedding; 16 prompts of 10 tokens + 16 x 32 new = 672 tokens
META = {"params_lm": 1000, "params_embedding": 200, "prompt_ids": [[5] * 10] * 16}
RATES = {"gflops_fp32": 1.0, "gflops_bf16": 2.0, "gbps": 1.0}


def test_floors_trl_four_models_fp32(vs_trl):
    f = vs_trl.floors(META, "trl", vs_trl.SIDES["trl"], RATES, "fp32")
    # generate: 2 x 1000 x 672 FLOPs at 1e9/s; bandwidth 32 steps x 4000 bytes at 1e9 B/s is smaller
    assert f["generate"] == pytest.approx(2 * 1000 * 672 / 1e9)
    assert f["generate_kind"] == "flops"
    # scoring: reference (1000) + reward and value bodies (800 each), 2 FLOPs per parameter per token
    assert f["scoring"] == pytest.approx(2 * 672 * 2600 / 1e9)
    # update: 4 epochs x 672 tokens x 6 x (policy 1000 + value body 800)
    assert f["update"] == pytest.approx(4 * 672 * 6 * 1800 / 1e9)


def test_floors_shared_lora_bf16(vs_trl):
    f = vs_trl.floors(META, "q-shared-lora", vs_trl.SIDES["q-shared-lora"], RATES, "bf16")
    assert f["scoring"] == pytest.approx(2 * 672 * 1800 / 2e9)  # reference + reward model, no value model
    assert f["update"] == pytest.approx(4 * 672 * 4 * 1000 / 2e9)  # frozen base: 4 FLOPs per parameter


def test_floors_generate_bandwidth_bound(vs_trl):
    slow_memory = {**RATES, "gbps": 1e-3}
    f = vs_trl.floors(META, "q-separate-fp32", vs_trl.SIDES["q-separate-fp32"], slow_memory, "fp32")
    assert f["generate_kind"] == "bandwidth"
    assert f["generate"] == pytest.approx(32 * 1000 * 4 / 1e6)  # weights read once per new token
