"""One update of a policy sharded with torch's FSDP2 (`fully_shard`, CPU mesh, gloo), then what the trainer does
with full weights: the gather, the engine sync, the final save. For tests/distributed/test_sharded.py.

    accelerate launch --multi_gpu --num_processes 2 tests/distributed/shard_driver.py OUT_DIR [lora]
    python tests/distributed/shard_driver.py OUT_DIR [lora]        (one process: the same update, unsharded)
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/distributed/shard_driver.py OUT_DIR [lora] zero3
                                                  (DeepSpeed ZeRO-3 instead of FSDP2; needs deepspeed)
    accelerate launch ... shard_driver.py ppo OUT.pt [key=value ...]      (mp_driver's PPO steps, policy sharded)
    accelerate launch ... shard_driver.py ppo-run OUT.pt [key=value ...]  (a whole sharded PPO run)
    accelerate launch ... shard_driver.py sft OUT.pt [key=value ...]      (mp_driver's SFT steps, model sharded)

accelerate does not apply FSDP on CPU (its FSDP plugin is for GPU-class devices), so the sharding is applied here
by hand, as accelerate's FSDP2 `prepare` would: each decoder layer, then the root module. Every process feeds
the same batch, so the averaged gradient is the one-process gradient. Each process writes OUT_DIR/rank<r>.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

TINY = "tiny:llama?hidden=64&layers=2&heads=4&seed=3"


def main(out: Path, lora: bool, zero3: bool, fsdp1: bool = False) -> None:
    from quartet.config import GenerationConfig, LoraConfig
    from quartet.data import left_pad
    from quartet.models import apply_lora, load_causal_lm, save_model
    from quartet.rollout.engine import HFEngine
    from quartet.trainers import loop, sharding
    from quartet.trainers.ppo_roles import PolicyModel

    torch.set_num_threads(1)
    accelerator = loop.make_accelerator("fp32", grad_accum=1)  # gloo process group under accelerate launch
    rank, world = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(0)
    actor, tok = load_causal_lm(TINY, torch.float32)
    if lora:
        actor = apply_lora(actor, LoraConfig(enabled=True, r=4, alpha=8))
    policy = PolicyModel(actor, None, shared_critic=False, temperature=1.0)
    initial = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    gen = GenerationConfig(max_new_tokens=8, temperature=1.0, batch_size=8)
    engine = HFEngine(actor, tok, gen, dtype=torch.bfloat16)  # as the trainer: made before the weights shard

    def adamw():  # made after the wrapping, which replaces the parameters (as accelerate's prepare does)
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    model = policy  # what the trainer holds after `prepare`
    if zero3:
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "gradient_clipping": 0.0}
        model, optimizer, _, _ = deepspeed.initialize(model=policy, optimizer=adamw(), config=config)
        local = {n: tuple(p.shape) for n, p in policy.named_parameters()}  # partitioned: empty here
    elif fsdp1 and world > 1:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        model = FullyShardedDataParallel(policy, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                                         use_orig_params=True, device_id=torch.device("cpu"))
        local = {n: tuple(p.shape) for n, p in model.named_parameters()}  # this process's part of each
    elif world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        base = actor.get_base_model() if lora else actor
        for layer in base.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(policy, mesh=mesh)
        local = {n: type(p).__name__ for n, p in policy.named_parameters()}
    else:
        local = {}
    assert sharding.sharded(model) == (("zero3" if zero3 else "fsdp") if world > 1 else None)

    # one update from rollouts of the pre-update engine (the same prompts and seeds on every process)
    prompts = [tok.encode(f"q{i} {'ab' * i}")[:12] for i in range(6)]
    ids, mask = left_pad(prompts, tok.pad_token_id)
    ro = engine.generate(ids, mask, seed=11, num_samples=2)
    optimizer = optimizer if zero3 else adamw()
    logprobs, _, _ = model(ro)
    weights = torch.linspace(-1.0, 1.0, logprobs.shape[0]).unsqueeze(1)  # pushes some samples up, some down
    loss = -(weights * logprobs * ro.response_mask).sum() / ro.response_mask.sum()
    if zero3:
        model.backward(loss)
        model.step()
    else:
        loss.backward()
        optimizer.step()

    # (a) the gathered full weights, on every process
    full = sharding.full_state_dict(model)
    if full is None:  # one process: the module's own
        full = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    # DeepSpeed's own consolidation (what accelerate's get_state_dict returns under ZeRO-3), main process only
    own = model._zero3_consolidated_16bit_state_dict() if zero3 else None
    # (b) the engine after the trainer's sync, sampling the same prompts with the same seeds
    sharding.sync_engine(engine, accelerator, model)
    after = engine.generate(ids, mask, seed=11, num_samples=2)
    # what the sync did before this module: the unwrapped actor's own tensors (shards under FSDP)
    naive = "ok"
    if world > 1 and not fsdp1:  # (FSDP1's state-dict hooks on the inner units run collectives of their own)
        try:
            engine.sync(accelerator.unwrap_model(model).actor)
        except Exception as e:  # noqa: BLE001 - recorded for the test
            naive = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    # (c) the final save: every process enters, the main process writes a plain HF model
    with sharding.saveable(accelerator, model, "actor") as plain:
        if accelerator.is_main_process:
            save_model(plain, tok, out / "model")
    torch.save({"full": full, "initial": initial, "response_ids": after.response_ids, "before_ids": ro.response_ids,
                "local": local, "naive": naive, "deepspeed_own": own, "loss": float(loss.detach())}, out / f"rank{rank}.pt")
    accelerator.wait_for_everyone()


def shard_on_prepare() -> None:
    """From now on the trainers' accelerator shards the policy with FSDP2 where accelerate would wrap it in DDP
    (accelerate applies FSDP only on GPU-class devices)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from quartet.trainers import loop

    make_accelerator = loop.make_accelerator

    def sharding_accelerator(*args, **kwargs):
        accelerator = make_accelerator(*args, **kwargs)

        def shard(model, optimizer, *rest):  # (policy, optimizer, scheduler) or (model, optimizer, loader, scheduler)
            before = dict(model.named_parameters())
            mesh = init_device_mesh("cpu", (accelerator.num_processes,))
            net = model.actor if hasattr(model, "actor") else model
            for layer in (net.get_base_model() if hasattr(net, "get_base_model") else net).model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            after = {id(before[n]): p for n, p in model.named_parameters()}  # new (DTensor) parameters
            for group in optimizer.param_groups:
                group["params"] = [after[id(p)] for p in group["params"]]
            optimizer = accelerator.prepare_optimizer(optimizer)  # accelerate's wrappers, as prepare gives them
            rest = [accelerator.prepare_data_loader(x) if isinstance(x, torch.utils.data.DataLoader)
                    else accelerator.prepare_scheduler(x) for x in rest]
            return model, optimizer, *rest

        accelerator.prepare = shard
        return accelerator

    loop.make_accelerator = sharding_accelerator


def ppo_fsdp2(out: Path, overrides: list[str]) -> None:
    """mp_driver's two PPO iterations on sharded weights: engine sync, update, gathered weights. The trainer is told
    it is sharded before `prepare`, as accelerate's FSDP tells it (the one verdict, trainers/plan.py)."""
    import mp_driver

    from quartet.trainers import sharding

    shard_on_prepare()
    sharding.accelerator_shards = lambda accelerator: "fsdp"
    mp_driver.ppo(out, overrides)


def sft_fsdp2(out: Path, overrides: list[str]) -> None:
    """mp_driver's two SFT steps on sharded weights; what it records is the saved model (gathered)."""
    import mp_driver

    shard_on_prepare()
    mp_driver.sft(out, overrides)


def ppo_run(out: Path, overrides: list[str]) -> None:
    """A whole `train` on sharded weights, the trainer told it is sharded (as under accelerate's FSDP): its
    start-up refusals, no best/checkpoint copies, the final save from the gathered weights."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for builders
    from builders import tiny_ppo
    from quartet.config import validate
    from quartet.trainers import sharding
    from quartet.trainers.ppo import PPOTrainer

    shard_on_prepare()
    sharding.accelerator_shards = lambda accelerator: "fsdp"
    cfg = tiny_ppo(out.parent, f"output_dir={out.parent / 'run'}", "iterations=2", "rollout_batch_size=4",
                   "minibatch_size=4", "generation.max_new_tokens=6", "advantage=grpo", "critic=none",
                   "samples_per_prompt=2",
                   # the defaults of PPOConfig, GenerationConfig and PPO's optim this run was written with
                   "ppo_epochs=4", "generation.batch_size=32", "optim.adam_eps=1e-5", *overrides)
    validate(cfg)  # as load_config, and so the CLI, does before the trainer
    try:
        trainer = PPOTrainer(cfg, progress=False)
    except Exception as e:  # noqa: BLE001 - the refusal is what the test reads
        torch.save({"error": f"{type(e).__name__}: {e}"}, out)
        return
    trainer.train()
    full = sharding.full_state_dict(trainer.model)
    if trainer.accelerator.is_main_process:
        torch.save({"full": full}, out)


if __name__ == "__main__":
    if sys.argv[1] in ("ppo", "ppo-run", "sft"):
        torch.set_num_threads(1)
        sys.path.insert(0, str(Path(__file__).parent))
        {"ppo": ppo_fsdp2, "ppo-run": ppo_run, "sft": sft_fsdp2}[sys.argv[1]](Path(sys.argv[2]), sys.argv[3:])
    else:
        main(Path(sys.argv[1]), lora="lora" in sys.argv[2:], zero3="zero3" in sys.argv[2:],
             fsdp1="fsdp1" in sys.argv[2:])
    if torch.distributed.is_initialized():
        # the work is done and written; now and then (2 of ~20 runs here) a process that ran FSDP2 over gloo aborts in
        # C++ teardown ("terminate called without an active exception", SIGABRT), so leave without it
        torch.distributed.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
