"""precision: auto picks bf16 autocast only on a CPU that multiplies bf16 natively; QUARTET_CPU_BF16 overrides
the detection (a VM hiding the flags, or a recipe run as an AVX2-only CPU runs it)."""

from __future__ import annotations

import pytest
import torch

from quartet.errors import ConfigError
from quartet.trainers import loop

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA


@pytest.fixture(autouse=True)
def fresh_detection():
    loop.cpu_has_bf16.cache_clear()
    loop.compute_device.cache_clear()
    yield
    loop.cpu_has_bf16.cache_clear()
    loop.compute_device.cache_clear()
    # accelerate's process-wide state keeps the device of its first Accelerator (make_accelerator resets only the
    # mixed-precision part): one made here under QUARTET_DEVICE=cpu would put the next tests' trainers in this
    # process on the CPU while their other models go to the GPU (found on an H200: a later PPO run mixed devices)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto on a GPU follows the GPU")
@pytest.mark.parametrize("flag, expected", [("0", "no"), ("1", "bf16")])
def test_the_override_decides_auto(monkeypatch, flag, expected):
    monkeypatch.setenv("QUARTET_CPU_BF16", flag)
    assert loop.mixed_precision("auto") == expected
    assert loop.generation_dtype("auto") == (torch.bfloat16 if flag == "1" else torch.float32)
    assert loop.mixed_precision("fp32") == "no"  # an explicit precision is not overridden


def test_without_the_override_auto_follows_the_cpu_flags(monkeypatch):
    monkeypatch.delenv("QUARTET_CPU_BF16", raising=False)
    flags = open("/proc/cpuinfo", encoding="utf-8").read()
    assert loop.cpu_has_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)


def test_a_bad_override_is_one_config_error(monkeypatch):
    monkeypatch.setenv("QUARTET_CPU_BF16", "yes")
    with pytest.raises(ConfigError, match="QUARTET_CPU_BF16: must be 0 or 1, got 'yes'"):
        loop.cpu_has_bf16()


def test_the_device_is_the_gpu_when_torch_sees_one_and_quartet_device_keeps_a_run_on_the_cpu(monkeypatch):
    monkeypatch.delenv("QUARTET_DEVICE", raising=False)
    assert loop.compute_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    loop.compute_device.cache_clear()
    monkeypatch.setenv("QUARTET_DEVICE", "cpu")
    monkeypatch.setenv("QUARTET_CPU_BF16", "0")
    assert loop.compute_device() == torch.device("cpu") and not loop.on_gpu()
    assert loop.mixed_precision("auto") == "no"  # auto follows the device the run is kept on, not the GPU
    assert loop.make_accelerator("fp32", 1).device == torch.device("cpu")


@pytest.mark.parametrize("value, message", [
    ("gpu", "QUARTET_DEVICE: must be auto, cpu or cuda, got 'gpu'"),
    pytest.param("cuda", "QUARTET_DEVICE=cuda, but torch sees no GPU", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="a GPU is there")),
])
def test_a_bad_or_impossible_device_is_one_config_error(monkeypatch, value, message):
    monkeypatch.setenv("QUARTET_DEVICE", value)
    with pytest.raises(ConfigError, match=message):
        loop.compute_device()
