"""One update of a policy sharded with torch's FSDP2 (`fully_shard`, CPU mesh, gloo), then what the trainer does
with full weights: the gather, the engine sync, the final save. For tests/distributed/test_sharded.py.

    accelerate launch --multi_gpu --num_processes 2 tests/distributed/shard_driver.py OUT_DIR [lora]
    python tests/distributed/shard_driver.py OUT_DIR [lora]        (one process: the same update, unsharded)
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/distributed/shard_driver.py OUT_DIR [lora] zero3
                                                  (DeepSpeed ZeRO-3 instead of FSDP2; needs deepspeed)

accelerate does not apply FSDP on CPU (its FSDP plugin is for GPU-class devices), so the sharding is applied here
by hand, as accelerate's FSDP2 `prepare` would: each decoder layer, then the root module. Every process feeds
the same batch, so the averaged gradient is the one-process gradient. Each process writes OUT_DIR/rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

TINY = "tiny:llama?hidden=64&layers=2&heads=4&seed=3"


def main(out: Path, lora: bool, zero3: bool) -> None:
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

    def adamw():  # made after `fully_shard`, which replaces the parameters (as accelerate's prepare does)
        return torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)

    model = policy  # what the trainer holds after `prepare`
    if zero3:
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "gradient_clipping": 0.0}
        model, optimizer, _, _ = deepspeed.initialize(model=policy, optimizer=adamw(), config=config)
        local = {n: tuple(p.shape) for n, p in policy.named_parameters()}  # partitioned: empty here
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
    if world > 1:
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


if __name__ == "__main__":
    main(Path(sys.argv[1]), lora="lora" in sys.argv[2:], zero3="zero3" in sys.argv[2:])
