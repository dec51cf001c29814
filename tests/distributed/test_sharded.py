"""Sharded weights (quartet.trainers.sharding): a policy sharded over 2 real processes (gloo, CPU) with torch's
FSDP2 `fully_shard` (and FSDP1), and with DeepSpeed ZeRO-3 where DeepSpeed is installed, gives the generation engine and the
saved model the full weights: the gathered state equals the one-process model's, the engine samples what the
unsharded model samples with the same seeds, and the save is a plain HF model with those weights."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_processes import ACCELERATE, _port

from quartet.errors import ConfigError
from quartet.trainers import sharding

HERE = Path(__file__).parent
DRIVER = HERE / "shard_driver.py"
SRC = HERE.parents[1] / "src"


def _drive(out: Path, launcher: list[str], *args: str, env: dict | None = None) -> list[dict]:
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{SRC}{os.pathsep}{HERE.parent / 'trainers'}",
           **(env or {})}
    proc = subprocess.run([*launcher, str(DRIVER), str(out), *args], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(f) for f in sorted(out.glob("rank*.pt"))]


def _saved(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)  # a plain, full HF model dir
    assert type(model).__name__ == "LlamaForCausalLM"
    return model.state_dict()


def _updated(rank: dict) -> None:
    """The update reached the weights that were gathered (every trained tensor moved), so they are not the
    initial ones that every process also holds."""
    trained = [k for k in rank["full"] if "lora_A" in k or "lora_B" in k] or list(rank["full"])
    assert all(not torch.equal(rank["full"][k], rank["initial"][k]) for k in trained)


def _fsdp2(n: int) -> list[str]:
    return [*ACCELERATE, "--num_processes", str(n), "--main_process_port", _port()]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("fsdp", ["fsdp2", "fsdp1"])
def test_fsdp_sharded_policy_gives_full_weights_to_the_engine_and_the_save(tmp_path, lora, fsdp):
    """FSDP2 (`fully_shard`) and FSDP1 (`FullyShardedDataParallel(device_id=cpu)`, per decoder layer)."""
    extra = ["lora"] if lora else []
    (one,) = _drive(tmp_path / "one", [sys.executable], *extra)
    two = _drive(tmp_path / "two", _fsdp2(2), *extra, *(["fsdp1"] if fsdp == "fsdp1" else []))
    assert len(two) == 2
    # the weights really were sharded, and (FSDP2) the trainer's old sync from the unwrapped module's own
    # tensors fails on the shards
    if fsdp == "fsdp2":
        assert set(two[0]["local"].values()) == {"DTensor"}
        assert two[0]["naive"].startswith("RuntimeError"), two[0]["naive"]
    else:  # each process's flat parameters hold about half of the weights
        held = sum(torch.Size(s).numel() for s in two[0]["local"].values())
        assert held < 0.6 * sum(v.numel() for v in one["full"].values())
    for rank in two:
        # (a) every process gathers the full weights, equal to the one-process model's after the same update
        assert set(rank["full"]) == set(one["full"])
        for k, v in one["full"].items():
            assert torch.equal(rank["full"][k], v), k
        _updated(rank)
        # (b) the engine synced from them samples what the unsharded model samples (and the update changed it)
        assert torch.equal(rank["response_ids"], one["response_ids"])
        assert not torch.equal(rank["response_ids"], rank["before_ids"])
    # (c) the sharded run's save is a plain HF model holding the same (LoRA-merged) weights
    a, b = _saved(tmp_path / "one" / "model"), _saved(tmp_path / "two" / "model")
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    if lora:  # merged: the update moved the adapted weights off the base ones
        base = {k.removeprefix("actor.base_model.model.").replace(".base_layer", ""): v
                for k, v in one["full"].items() if "lora_" not in k}
        assert not torch.equal(b["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])


def _deepspeed_python() -> str | None:
    """A python with DeepSpeed: QUARTET_DEEPSPEED_PYTHON (e.g. a throwaway venv), else this one if it has it."""
    given = os.environ.get("QUARTET_DEEPSPEED_PYTHON")
    if given:
        return given
    try:
        import deepspeed  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or present but broken: either way not runnable here
        return None
    return sys.executable


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_zero3_sharded_policy_gives_full_weights_to_the_engine_and_the_save(tmp_path, lora):
    python = _deepspeed_python()
    if python is None:
        pytest.skip("DeepSpeed is not installed (set QUARTET_DEEPSPEED_PYTHON to a python that has it)")
    extra = ["lora"] if lora else []
    (one,) = _drive(tmp_path / "one", [sys.executable], *extra)
    torchrun = [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _port()]
    two = _drive(tmp_path / "two", torchrun, *extra, "zero3", env={"DS_ACCELERATOR": "cpu"})
    assert len(two) == 2
    assert {s for s in two[0]["local"].values()} == {(0,)}  # partitioned: no full tensor held by the module
    own = two[0]["deepspeed_own"]  # DeepSpeed's own consolidation of the same weights
    for rank in two:
        # (a) exactly DeepSpeed's consolidated weights, on every process; against one process within 1e-4:
        # DeepSpeed's optimizer step on its flat partitions differs from torch's AdamW by float noise
        # (measured at most 1.3e-5 after one lr 1e-2 step), not by the gather
        assert set(rank["full"]) == set(own) == set(one["full"])
        for k, v in own.items():
            assert torch.equal(rank["full"][k], v), k
            assert torch.allclose(v, one["full"][k], atol=1e-4), k
        _updated(rank)
        # (b) the engine samples what the unsharded model samples (bf16 copies of weights 1e-5 apart)
        assert torch.equal(rank["response_ids"], one["response_ids"])
        assert not torch.equal(rank["response_ids"], rank["before_ids"])
    a, b = _saved(tmp_path / "one" / "model"), _saved(tmp_path / "two" / "model")
    assert set(a) == set(b)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-4), k


# ----------------------------------------------------------------------------- without processes
def test_unsharded_models_are_left_alone():
    from quartet.models import load_causal_lm

    model, _ = load_causal_lm("tiny:llama?hidden=32&layers=1&heads=4&vocab=260", torch.float32)
    assert sharding.sharded(model) is None
    assert sharding.full_state_dict(model) is None  # no gather, no copy: callers read the module
    assert sharding.sub_state(None, "actor.") is None
    assert sharding.sub_state({"actor.a": 1, "critic.b": 2}, "actor.") == {"a": 1}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # gpt2: Conv1D layers, LoRA with fan_in_fan_out
def test_lora_merge_from_gathered_state_equals_peft_merge(arch):
    """The sharded path merges LoRA from the gathered tensors; it must equal peft's own merge."""
    from quartet.config import LoraConfig
    from quartet.models import apply_lora, load_causal_lm, merged_copy
    from quartet.rollout.weights import merged_state_dict

    base, _ = load_causal_lm(f"tiny:{arch}?hidden=32&layers=1&heads=4&vocab=260", torch.float32)
    actor = apply_lora(base, LoraConfig(enabled=True, r=4, alpha=8))
    with torch.no_grad():  # B starts at zero; give the adapters a delta
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    state = {k: v.clone() for k, v in actor.state_dict().items()}
    from_state = merged_state_dict(actor, state)
    peft_merge = merged_copy(actor).state_dict()
    assert set(from_state) == set(peft_merge)
    for k, v in peft_merge.items():
        assert torch.equal(from_state[k], v), k
    adapted = [k for k in state if k.endswith(".base_layer.weight")]
    assert adapted and all(not torch.equal(from_state[k.removeprefix("base_model.model.").replace(".base_layer", "")],
                                           state[k]) for k in adapted)
    plain = sharding.plain_model(actor, state)  # what a sharded run saves
    for k, v in plain.state_dict().items():
        assert torch.equal(v, peft_merge[k]), k


def _accelerator(kind: str, stage: int | None = None):
    from accelerate.utils import DistributedType

    plugin = SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": stage}}) if stage else None
    return SimpleNamespace(distributed_type=getattr(DistributedType, kind), state=SimpleNamespace(deepspeed_plugin=plugin))


def test_what_is_not_made_right_under_sharding_is_refused_at_start_up():
    assert sharding.accelerator_shards(_accelerator("MULTI_CPU")) is None
    assert sharding.accelerator_shards(_accelerator("DEEPSPEED", 2)) is None  # ZeRO-2: weights are whole
    assert sharding.accelerator_shards(_accelerator("DEEPSPEED", 3)) == "zero3"
    assert sharding.refuse_unsupported(_accelerator("FSDP"), "ppo", {"a critic": False}) == "fsdp"
    assert sharding.refuse_unsupported(_accelerator("NO"), "rm", {"everything": True}) is None
    with pytest.raises(ConfigError, match=r"ppo under FSDP: a critic; --resume: not supported"):
        sharding.refuse_unsupported(_accelerator("FSDP"), "ppo", {"a critic": True, "x": False, "--resume": True})
    with pytest.raises(ConfigError, match="DeepSpeed ZeRO-3"):
        sharding.refuse_unsupported(_accelerator("DEEPSPEED", 3), "rm", {"training the reward model": True})


def test_the_zero3_gather_needs_deepspeed_only_when_sharded():
    """Without DeepSpeed the module never imports it; a ZeRO-3-looking parameter sends it down that path."""
    model = torch.nn.Linear(2, 2)
    assert sharding.sharded(model) is None
    model.weight.ds_id, model.weight.ds_status = 0, "NOT_AVAILABLE"  # what ZeRO-3 puts on a partitioned param
    assert sharding.sharded(model) == "zero3"
    if importlib.util.find_spec("deepspeed") is None:
        with pytest.raises(ImportError):
            sharding.full_state_dict(model)


def test_the_ppo_trainer_on_fsdp2_sharded_weights_equals_one_process(tmp_path):
    """The trainer itself on sharded weights: mp_driver's two GRPO iterations, 2 processes x 8 prompts with the
    policy under FSDP2 (put where accelerate would put DDP), against 1 process x 16 prompts. The second
    iteration samples from the engine synced after the first update: equal samples mean it got full weights."""
    from test_processes import GRPO, PPO_WEIGHTS_ATOL, _assert_weights_close, _close_metrics

    out = []
    for n, launcher, args in ((1, [sys.executable], [str(HERE / "mp_driver.py"), "ppo"]),
                              (2, _fsdp2(2), [str(DRIVER), "ppo"])):
        path = tmp_path / f"p{n}" / "out.pt"
        path.parent.mkdir()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{SRC}{os.pathsep}{HERE.parent / 'trainers'}"}
        # the sharded trainer recomputes the old log-probs (reuse_sampling_logprobs is off under sharding): so does
        # the one process here, or the comparison would be of two computations that round apart
        proc = subprocess.run([*launcher, *args, str(path), *GRPO, "reuse_sampling_logprobs=false"],
                              capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out.append(torch.load(path))
    a, b = out
    for it in range(2):
        assert torch.equal(a["response_ids"][it], b["response_ids"][it])
        assert torch.allclose(a["advantages"][it], b["advantages"][it], atol=1e-5)
        _close_metrics(a["metrics"][it], b["metrics"][it])
    _assert_weights_close(a["weights"], b["weights"], PPO_WEIGHTS_ATOL, a["start"])  # b's: gathered from the shards


def test_a_whole_sharded_ppo_run_saves_the_gathered_model_and_refuses_what_it_cannot_do(tmp_path):
    """`train` with the trainer told it is sharded (as under accelerate's FSDP): the final model dir is a plain HF
    model equal to the gathered weights, one metrics line per iteration, no checkpoint copies of shards; a critic
    is refused at start-up with one error and no output; with LoRA the saved model is the merged one."""
    from transformers import AutoModelForCausalLM

    from quartet.models import load_causal_lm

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{SRC}{os.pathsep}{HERE.parent / 'trainers'}"}
    results = {}
    for name, extra in (("ok", []), ("critic", ["critic=shared", "advantage=gae", "samples_per_prompt=1"]),
                        ("lora", ["lora.enabled=true", "lora.r=4"])):
        out = tmp_path / name / "out.pt"
        out.parent.mkdir()
        proc = subprocess.run([*_fsdp2(2), str(DRIVER), "ppo-run", str(out), *extra], capture_output=True, text=True,
                              timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[name] = torch.load(out)
    run = tmp_path / "ok" / "run"
    saved = AutoModelForCausalLM.from_pretrained(run / "model").state_dict()
    initial = load_causal_lm("tiny:llama?hidden=32&layers=1&heads=4&vocab=260&seed=1", torch.float32)[0].state_dict()
    full = results["ok"]["full"]
    for k, v in saved.items():
        assert torch.equal(v, full[f"actor.{k}"]), k
    assert any(not torch.equal(v, initial[k]) for k, v in saved.items())  # trained
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert not (run / "checkpoints").exists()
    assert results["critic"]["error"].startswith("ConfigError: ppo under FSDP: a critic")
    assert not (tmp_path / "critic" / "run").exists()
    # LoRA: the saved model is merged: the adapted linear layers moved, everything else is the initial base
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "lora" / "run" / "model").state_dict()
    adapted = {k for k in merged if k.endswith("_proj.weight")}
    assert adapted and all(not torch.equal(merged[k], initial[k]) for k in adapted)
    assert all(torch.equal(merged[k], initial[k]) for k in merged if k not in adapted)


def test_sft_on_fsdp2_sharded_weights_saves_the_model_one_process_trains(tmp_path):
    """mp_driver's two SFT steps (2 processes x 4 rows x 2 micro-batches against 1 x 8 x 2) with the model under
    FSDP2: what it records is the saved model dir, written from the gathered weights."""
    from test_processes import SUPERVISED_WEIGHTS_ATOL, _assert_weights_close, _close_metrics

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{SRC}{os.pathsep}{HERE.parent / 'trainers'}"}
    out = []
    for n, launcher, driver in ((1, [sys.executable], HERE / "mp_driver.py"), (2, _fsdp2(2), DRIVER)):
        path = tmp_path / f"p{n}" / "out.pt"
        path.parent.mkdir()
        proc = subprocess.run([*launcher, str(driver), "sft", str(path)], capture_output=True, text=True,
                              timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out.append(torch.load(path))
    a, b = out
    assert a["steps"] == b["steps"] == [1, 2]
    for ma, mb in zip(a["metrics"], b["metrics"]):
        _close_metrics(ma, mb)
    _assert_weights_close(a["weights"], b["weights"], SUPERVISED_WEIGHTS_ATOL)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_vllm_engine_weights_from_gathered_state_equal_its_own(lora):
    """The vLLM engine's weight list built from a gathered state (sharded runs) equals the one it builds from the
    module, the tied output layer included (vLLM itself is not needed to build the list)."""
    from quartet.config import LoraConfig
    from quartet.models import apply_lora, load_causal_lm
    from quartet.rollout.vllm_engine import VLLMEngine

    actor, _ = load_causal_lm("tiny:gpt2?hidden=32&layers=1&heads=4&vocab=260", torch.float32)
    assert actor.config.tie_word_embeddings  # the output layer is the embedding: its own tensor for vLLM
    if lora:
        actor = apply_lora(actor, LoraConfig(enabled=True, r=4, alpha=8))
        with torch.no_grad():
            for name, p in actor.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    engine = SimpleNamespace(dtype=torch.bfloat16)
    own = dict(VLLMEngine._weights(engine, actor))
    gathered = dict(VLLMEngine._weights(engine, actor, {k: v.clone() for k, v in actor.state_dict().items()}))
    assert set(own) == set(gathered) and "lm_head.weight" in own
    for k, v in own.items():
        assert torch.equal(v, gathered[k]), k
