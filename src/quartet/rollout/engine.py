"""Generation engines behind one small interface, so a faster one can be plugged in.

`HFEngine` samples with a KV cache, as transformers' `generate` does but dropping each answer from the
batch once it has ended, from its own low-precision copy of the actor, refreshed from the training weights
before each rollout (`sync`), the way vLLM-backed trainers do it. On CPU a bf16 copy makes sampling several
times faster than fp32 and avoids re-casting the fp32 master weights at every decoding step. A plain actor
can instead be sampled as it is (`share_weights`: autocast casts its weights once per `generate`), which holds
no copy between rollouts.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

import torch
import transformers

from quartet.algo.kl import full_kl
from quartet.algo.logprobs import logprobs_and_entropy
from quartet.algo.sampling import inverse_cdf, nucleus
from quartet.errors import ConfigError
from quartet.models.attention import fit_attention_to_shape
from quartet.models.loading import cache_kwarg, contiguous_head_input, no_init, output_cache
from quartet.models.packed import pack_linears, tie_output
from quartet.models.sample_prefix import share_prompts, shares_prompts
from quartet.rollout.record import Rollout, position_ids_from_mask
from quartet.rollout.sampling import make_rollout, row_seeds
from quartet.rollout.weights import base_config, merged_state_dict

log = logging.getLogger("quartet")


class GenerationEngine(Protocol):
    def sync(self, actor: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> None:
        """Copy the actor's current weights (LoRA merged) into the engine. `state`: the actor's full weights
        gathered from a sharded model (quartet.trainers.sharding), used instead of the module's own tensors."""

    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seed: int | None = None, num_samples: int = 1,
        greedy: bool = False, sample_offset: int = 0, seeds: list[int] | None = None,
    ) -> Rollout:
        """Sample `num_samples` responses per left-padded prompt row; row i's samples are rows
        i * num_samples ... (i + 1) * num_samples - 1 of the Rollout. Output row j is drawn from its own
        random stream, `sample_seed(seed, sample_offset + j)`, so a sample does not depend on which other
        prompts share its batch or its process; `seeds`: each output row's seed given explicitly instead.
        `greedy`: the most likely response instead (ReMax's baseline)."""


LEAVE_FRACTION = 0.125
"""finished rows leave a decoding batch together, once they are this share of it (`HFEngine._decode`)"""


class HFEngine:
    """Sampling with transformers from a private copy of the actor in `dtype`, or from the actor itself.

    `share_weights` (a plain, unsharded actor: PPO's full fine-tune) samples the actor's own weights under
    autocast to `dtype`: no copy to hold or to sync. autocast casts each weight once per `generate` and keeps
    the casts until it returns (the actor's weights are leaves that require grad), so the bf16 weights exist
    while sampling only, not at the update's peak (SmolLM2: 270 MB in bf16, 540 MB in fp32 less at the peak).
    The norms and the residual stream then run in the actor's fp32, where the copy ran them in bf16. Handed
    gathered full weights by `sync` (the actor was sharded after the engine was made), it falls back to a copy.
    With `dtype` the model's own, nothing is cast: the engine samples the model as it is (`quartet eval`'s
    sampling copy; DPO's policy, LoRA adapters unmerged, for its KL probe).

    `record_logprobs`: sampled rows also carry each token's log-prob and the entropy of softmax(logits / T) at its
    step (`Rollout.engine_logprobs`, `.engine_entropy`; 0 on padding), taken from the logits the token was drawn
    from, before top-k / top-p (PPO's old log-probs where its plan says so, trainers/plan.py).

    `float64_top_p`: the nucleus is cut from the float64 probabilities by the sampler itself (`algo.nucleus`), as
    `quartet eval` and DPO's KL probe have always drawn it, instead of by transformers' float32 TopPLogitsWarper;
    the two differ only for a token at the edge of the nucleus.
    """

    def __init__(self, actor: torch.nn.Module, tokenizer, gen_cfg, dtype: torch.dtype = torch.bfloat16,
                 share_weights: bool = False, record_logprobs: bool = False, float64_top_p: bool = False):
        self.tokenizer = tokenizer
        self.cfg = gen_cfg
        self.dtype = dtype
        self.shares_weights = share_weights
        self.record_logprobs = record_logprobs
        self.float64_top_p = float64_top_p
        self._prompt_sharing: bool | None = None  # decided at the first K-sample call (`_shares_prompts`)
        if share_weights:
            self.model = actor
            contiguous_head_input(actor)
            fit_attention_to_shape(actor)
        else:
            self.model = self._private_copy(actor)
        # decoding (`_decode`) always takes the argmax: sampling is the argmax of the processed logits, where the
        # last processor (`_sampler`) leaves only the token it drew from softmax(logits / T, cut by top-k / top-p)
        # with one uniform from each row's own generator; the temperature, top-k (0 = off) and top-p of gen_cfg
        # are applied there, not by transformers' defaults
        self.generation_config = transformers.GenerationConfig(
            do_sample=False,
            max_new_tokens=gen_cfg.max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            use_cache=True,
        )
        self.sync(actor)

    def _private_copy(self, actor: torch.nn.Module) -> torch.nn.Module:
        with no_init():
            model = transformers.AutoModelForCausalLM.from_config(base_config(actor), dtype=self.dtype)
        model.to(next(actor.parameters()).device)  # it samples where the actor computes
        contiguous_head_input(model)
        fit_attention_to_shape(model)  # eager for the short sequences RLHF samples: see models/attention.py
        model.eval().requires_grad_(False)
        pack_linears(model, rows=self.cfg.batch_size)  # laid out once for the CPU matmul: see models/packed.py
        return model

    def _sampler(self, seeds: list[int]) -> transformers.LogitsProcessorList:
        from transformers.generation.logits_process import (
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        warpers = [TemperatureLogitsWarper(self.cfg.temperature)] if self.cfg.temperature != 1.0 else []
        if self.cfg.top_k:
            warpers.append(TopKLogitsWarper(self.cfg.top_k))
        if self.cfg.top_p < 1.0 and not self.float64_top_p:
            warpers.append(TopPLogitsWarper(self.cfg.top_p))
        top_p = self.cfg.top_p if self.float64_top_p else 1.0
        return transformers.LogitsProcessorList([*warpers, PerRowInverseCDF(seeds, top_p)])

    def sync(self, actor: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> None:
        if self.shares_weights:
            if state is None:  # the engine samples these very weights
                if actor is not self.model:
                    raise RuntimeError("engine weight sync: this engine samples another model's weights")
                return
            # gathered full weights: the actor was sharded after this engine was made (FSDP / ZeRO-3 in
            # `prepare`), and shards cannot be sampled; from now on the engine holds a copy
            self.shares_weights = False
            self.model = self._private_copy(actor)
        state = merged_state_dict(actor, state)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to the embeddings
        if missing or unexpected:
            raise RuntimeError(f"engine weight sync mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
        if getattr(self.model.config, "tie_word_embeddings", False):
            tie_output(self.model)  # a packed head is laid out again from the new embedding

    @torch.no_grad()
    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seed: int | None = None, num_samples: int = 1,
        greedy: bool = False, sample_offset: int = 0, seeds: list[int] | None = None,
    ) -> Rollout:
        if not self.shares_weights:
            return self._generate(prompt_ids, prompt_mask, seed, num_samples, greedy, sample_offset, seeds)
        # the actor itself: in eval mode (no dropout; transformers' activation checkpointing is off), and under
        # one autocast for the whole call, so each weight is cast once
        training = self.model.training
        weight = next(self.model.parameters())
        self.model.eval()
        try:
            with torch.autocast(weight.device.type, dtype=self.dtype, enabled=self.dtype != weight.dtype):
                return self._generate(prompt_ids, prompt_mask, seed, num_samples, greedy, sample_offset, seeds)
        finally:
            self.model.train(training)

    def _generate(self, prompt_ids, prompt_mask, seed, num_samples, greedy, sample_offset, seeds) -> Rollout:
        seeds = row_seeds(seed, sample_offset, prompt_ids.shape[0] * num_samples, seeds)
        home = prompt_ids.device  # the rollout goes back to the caller's device; the model's computes it
        device = next(self.model.parameters()).device
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        chunks = []
        per_call = max(1, self.cfg.batch_size // num_samples)  # prompts per generate call
        for start in range(0, prompt_ids.shape[0], per_call):
            ids = prompt_ids[start : start + per_call]
            mask = prompt_mask[start : start + per_call]
            cache = None
            if num_samples > 1 and ids.shape[1] > 1:
                cache = self._shared_prefill(ids, mask, num_samples)
            ids, mask = ids.repeat_interleave(num_samples, 0), mask.repeat_interleave(num_samples, 0)
            first = start * num_samples
            processors = None if greedy else self._sampler(seeds[first : first + ids.shape[0]])
            chunks.append(self._decode(ids, mask, cache, processors))
        width = max(c[0].shape[1] for c in chunks)

        def joined(i: int, value) -> torch.Tensor:
            return torch.cat([torch.nn.functional.pad(c[i], (0, width - c[i].shape[1]), value=value) for c in chunks])

        ro = make_rollout(prompt_ids, prompt_mask, joined(0, self.tokenizer.pad_token_id), self.tokenizer, num_samples)
        if chunks[0][1] is not None:
            ro.engine_logprobs, ro.engine_entropy = joined(1, 0.0) * ro.response_mask, joined(2, 0.0) * ro.response_mask
        return ro.to(home)

    def _decode(self, ids: torch.Tensor, mask: torch.Tensor, cache, processors):
        """(b, R) new tokens for left-padded prompts `ids` (b, P), pad after each row's EOS; and, when sampling
        with `record_logprobs`, each token's log-prob and its step's entropy (b, R) (else None, None).

        What transformers' `generate` does with a KV cache, but rows that have emitted EOS leave the batch
        (their rows of the cache are dropped), so the rows still going do not carry the finished ones: the
        tokens sampled are the same, and a batch costs its answers' lengths, not max_new_tokens for every row
        (AI-feedback labelling at 64 rows of ~25-token answers, half the decoding steps' rows). Finished rows
        leave together, once they are `LEAVE_FRACTION` of the batch: each leaving copies the whole cache, which at
        every step where a row finished cost more than the finished rows' forwards while they wait (they decode
        on, their tokens unused). `cache`: the
        KV cache of all prompt tokens but the last (`_shared_prefill`), or None to prefill here. Logits are
        processed in float32, as `generate` does; `processors` None takes the argmax (greedy)."""
        b, R = ids.shape[0], self.cfg.max_new_tokens
        eos = self.generation_config.eos_token_id  # None: answers run to max_new_tokens (benchmarks)
        device = ids.device
        eos = torch.tensor([] if eos is None else [eos] if isinstance(eos, int) else list(eos), dtype=torch.long,
                           device=device)
        out = torch.full((b, R), self.tokenizer.pad_token_id, dtype=torch.long, device=device)
        rows = torch.arange(b, device=device)  # the output row of each row still in the batch
        pos = position_ids_from_mask(mask)
        feed, pos = (ids, pos) if cache is None else (ids[:, -1:], pos[:, -1:])
        sampler = processors[-1] if processors is not None else None
        record = self.record_logprobs and processors is not None
        logprobs = torch.zeros(b, R, device=device) if record else None
        entropy = torch.zeros(b, R, device=device) if record else None
        steps = 0
        done = torch.zeros(b, dtype=torch.bool, device=device)  # rows of the batch that emitted EOS, not yet left
        finished = 0
        for t in range(R):
            step = self.model(input_ids=feed, attention_mask=mask, position_ids=pos, **{cache_kwarg(self.model): cache},
                              use_cache=True, logits_to_keep=1)
            cache = output_cache(step)
            scores = step.logits[:, -1].float()
            token = (scores if processors is None else processors(feed, scores)).argmax(-1)
            live = slice(None) if finished == 0 else ~done  # a finished row's new tokens are not its answer's
            out[rows[live], t] = token[live]
            if record:  # the processors return new scores: these are still the untruncated logits
                lp, ent = logprobs_and_entropy(scores[:, None], token[:, None], self.cfg.temperature)
                logprobs[rows[live], t], entropy[rows[live], t] = lp[live, 0], ent[live, 0]
            steps = t + 1
            done |= torch.isin(token, eos)
            finished = int(done.sum())
            if finished == done.numel():
                break
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            pos = pos[:, -1:] + 1
            if finished >= max(1, LEAVE_FRACTION * done.numel()):
                keep = (~done).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                mask, pos, rows, token, done, finished = mask[keep], pos[keep], rows[keep], token[keep], done[keep], 0
                if sampler is not None:
                    sampler.keep(keep.tolist())
            feed = token[:, None]
        if not record:
            return out[:, :steps], None, None
        return out[:, :steps], logprobs[:, :steps], entropy[:, :steps]

    def _shared_prefill(self, ids: torch.Tensor, mask: torch.Tensor, k: int):
        """KV cache of each prompt but its last token, computed once for its k samples.

        `generate` then runs only the last prompt token and the new ones, so K answers per prompt
        (AI-feedback labelling) cost one prefill instead of K; the samples are the same as with the
        prompts repeated K times and the same seed. Where the model allows it (`_shares_prompts`) the k samples
        also decode on one copy of the prompt's keys and values (models/sample_prefix.py); else the cache is
        repeated k times.
        """
        cache = self._prefill(ids, mask)
        if self._shares_prompts(ids, mask):
            shared = share_prompts(cache, k)
            if shared is not None:
                return shared
        cache.batch_repeat_interleave(k)
        return cache

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor):
        pos = position_ids_from_mask(mask)
        out = self.model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=pos[:, :-1], use_cache=True,
                         logits_to_keep=1)  # only the cache is used: no (B, T, V) logits
        return output_cache(out)

    def _shares_prompts(self, ids: torch.Tensor, mask: torch.Tensor) -> bool:
        """Whether K samples decode on one copy of their prompt's keys (`models.sample_prefix.shares_prompts` and
        the probe below agree), decided once per engine."""
        if self._prompt_sharing is None:
            self._prompt_sharing = shares_prompts(self.model) and self._probe_prompt_sharing(ids, mask)
        return self._prompt_sharing

    def _probe_prompt_sharing(self, ids: torch.Tensor, mask: torch.Tensor) -> bool:
        """Three decoding steps of two samples of (up to) two of these prompts, on a cache from
        `sample_prefix.share_prompts` and on the repeated cache, the second and third after rows left (the third
        with the first prompt's rows all gone): the next-token distributions agree within rounding, the mean
        KL(repeated || shared) over the rows <= 1e-6 nats in float32 and <= 0.05 in a 16-bit dtype. Measured on
        SmolLM2 (these prompts' first two, padded to batches of 2-96): 1e-11 in float32; in bf16 2-4e-3 (1.6e-2
        at most), where the largest logit moved by up to 2.7% of the largest, so a bound on the logits would have
        to sit at the noise; an attention that forgets the prompt: 4.3 (0.8 at least)."""
        ids, mask = ids[:2], mask[:2]
        n = ids.shape[0]
        steps = [torch.arange(2 * n), torch.arange(1, 2 * n), torch.arange(2, 2 * n)]
        try:
            want, got = (self._forced_steps(ids, mask, 2, share, steps) for share in (False, True))
        except (TypeError, ValueError, RuntimeError, AttributeError, IndexError) as e:
            log.info("k samples on one copy of their prompt: probe failed (%s: %s); not used", type(e).__name__, e)
            return False
        if got is None:
            return False
        tol = 1e-6 if self.dtype == torch.float32 else 0.05  # the dtype it samples in (autocast's, sharing weights)
        ok = want.shape == got.shape
        if ok:
            want, got = want.double().log_softmax(-1), got.double().log_softmax(-1)
            ok = float(full_kl(want, got).mean()) <= tol
        if not ok:
            log.info("k samples on one copy of their prompt: the probe's next-token distributions differ; not used")
        return ok

    @torch.no_grad()
    def _forced_steps(self, ids: torch.Tensor, mask: torch.Tensor, k: int, share: bool,
                      steps: list[torch.Tensor]) -> torch.Tensor | None:
        """Float32 logits (rows of every step, V) of k samples of each prompt decoding fixed tokens (the same on
        every call), on the cache with each prompt's keys held once (`share`) or repeated k times; step t runs the
        rows `steps[t]` (indices of the P x k rows, each a subset of the one before: the others have left). None
        where the prefill's cache cannot be shared."""
        cache = self._prefill(ids, mask)
        if share:
            cache = share_prompts(cache, k)
            if cache is None:
                return None
        else:
            cache.batch_repeat_interleave(k)
        m = mask.repeat_interleave(k, 0)
        pos = position_ids_from_mask(m)[:, -1:]
        feed = ids[:, -1:].repeat_interleave(k, 0)
        rows, out = torch.arange(m.shape[0], device=ids.device), []
        for t, live in enumerate(steps):
            if live.numel() == 0:
                break
            if t:
                keep = torch.searchsorted(rows, live.to(rows.device))
                cache.batch_select_indices(keep)
                m, pos, feed, rows = m[keep], pos[keep], feed[keep], rows[keep]
            step = self.model(input_ids=feed, attention_mask=m, position_ids=pos, **{cache_kwarg(self.model): cache},
                              use_cache=True, logits_to_keep=1)
            cache = output_cache(step)
            out.append(step.logits[:, -1].float())
            feed = (rows[:, None] * 7 + 3 + t) % step.logits.shape[-1]  # fixed tokens, the same on every call
            m = torch.cat([m, m.new_ones(m.shape[0], 1)], dim=1)
            pos = pos + 1
        return torch.cat(out)


class PerRowInverseCDF:
    """Logits processor that draws each row's token from softmax(scores) by the inverse of its CDF, with one
    uniform from that row's own generator (`algo.inverse_cdf`), and leaves only the drawn token: its score 0,
    every other -inf, so the argmax that follows (`_decode`, or transformers' greedy `generate`) takes it.

    One random number per row and step, where Gumbel-max noise needs one per vocabulary entry: at 16 rows of
    SmolLM2 (49k tokens) a decoding step took 65 ms with float64 Gumbel noise and 58 ms with this (2-core AMD
    EPYC with AVX-512 BF16). The output is one buffer, overwritten by the next step (only the argmax reads it).

    `top_p` < 1: the draw is from the nucleus of softmax(scores), cut here in float64 (`algo.nucleus`)."""

    def __init__(self, seeds: list[int], top_p: float = 1.0):
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.top_p = top_p
        self.buffer: torch.Tensor | None = None

    def keep(self, rows: list[int]) -> None:
        """Only these rows stay in the batch (the others have finished): their generators go on as they were."""
        self.generators = [self.generators[i] for i in rows]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in self.generators])
        probs = torch.softmax(scores.float(), dim=-1)  # tokens cut by top-k / top-p (-inf) have probability 0
        if self.top_p < 1.0:
            probs = nucleus(probs, self.top_p)
        token = inverse_cdf(probs, u.to(probs.device))
        if self.buffer is None or self.buffer.shape != scores.shape or self.buffer.device != scores.device:
            self.buffer = torch.empty(scores.shape, dtype=torch.float32, device=scores.device)
        out = self.buffer.fill_(float("-inf"))
        out[torch.arange(out.shape[0], device=out.device), token] = 0.0
        return out


@torch.no_grad()
def sample_as_is(model: torch.nn.Module, tokenizer, gen_cfg, dtype: torch.dtype, prompt_ids: torch.Tensor,
                 prompt_mask: torch.Tensor, seeds: list[int], greedy: bool = False,
                 num_samples: int = 1) -> torch.Tensor:
    """Response ids (B x num_samples, max_new_tokens) of `model` sampled as it is (`dtype` its own: nothing cast,
    LoRA unmerged), row b drawn with seeds[b] from the full softmax (top-k off) with the nucleus cut in float64,
    padded after EOS to max_new_tokens: how `quartet eval` and DPO's KL probe have always sampled, and the width
    their KL is summed over (a float sum's order follows it). `num_samples`: each prompt's rows follow one another
    (as `repeat_interleave` lays them out), its prompt prefilled once for all of them (`HFEngine._shared_prefill`)."""
    engine = HFEngine(model, tokenizer, dataclasses.replace(gen_cfg, top_k=0), dtype, share_weights=True,
                      float64_top_p=True)
    ids = engine.generate(prompt_ids, prompt_mask, greedy=greedy, seeds=seeds, num_samples=num_samples).response_ids
    return torch.nn.functional.pad(ids, (0, gen_cfg.max_new_tokens - ids.shape[1]), value=tokenizer.pad_token_id)


def make_engine(actor: torch.nn.Module, tokenizer, gen_cfg, dtype: torch.dtype,
                share_weights: bool = False, record_logprobs: bool = False) -> GenerationEngine:
    """The engine `gen_cfg.engine` names, sampling `actor` in `dtype`; `share_weights`: the HF engine samples
    the actor's own weights instead of a copy (vLLM always holds its own); `record_logprobs`: the HF engine
    records each sampled token's log-prob (vLLM always returns its own)."""
    if gen_cfg.engine == "vllm":  # an optional extra, imported only when asked for
        from quartet.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(actor, tokenizer, gen_cfg, dtype)
    if gen_cfg.engine != "hf":
        raise ConfigError(
            f"generation.engine: '{gen_cfg.engine}' has no engine in this version yet (the interface is "
            f"GenerationEngine in quartet.rollout.engine); use 'hf'"
        )
    return HFEngine(actor, tokenizer, gen_cfg, dtype, share_weights=share_weights, record_logprobs=record_logprobs)
