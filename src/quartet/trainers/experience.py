"""The experience maker: one iteration's Rollout, everything the update needs and nothing it decides.

    1. sample a batch of prompts (seeded per iteration) and `samples_per_prompt` responses to each;
    2. score every response (reward model or callable; the gold judge too when there is one); missing-EOS
       penalty, running normalisation, clipping; ReMax also scores one greedy response per prompt;
    3. old log-probs (and values when there is a critic) from the policy, log-probs from the Reference.

The G samples of a prompt are contiguous rows of the Rollout, as the group estimators expect.

Under N processes each one samples, scores and forwards its own prompts (a group never leaves its
process), then the experience is gathered: every process holds the whole batch (token ids and per-token
floats, a few MB), in rank order, and everything computed from it (score normalisation, advantages,
whitening, metrics, the doctor's decisions) is the same on every process and equal to what one process
with the whole batch computes. Each sample is drawn from its own seed (seed, iteration, global index), so
the batch does not depend on how it is split across processes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from accelerate.utils import gather_object

from quartet.algo.offpolicy import logprob_gap
from quartet.data import left_pad, prompt_text
from quartet.eval.stats import distinct_n, repetition_rate
from quartet.models.trunk import Trunk
from quartet.rollout.record import Rollout, position_ids_from_mask
from quartet.rollout.scoring import shape_scores
from quartet.trainers import sharding
from quartet.trainers.plan import ForwardPlan
from quartet.trainers.ppo_roles import Roles, actor_logprobs

TRUNK_BUDGET_BYTES = 1 << 30
"""the most a rollout's frozen-trunk states (float32, B x T x H) may hold; a larger rollout runs full forwards"""


@dataclass
class Experience:
    rollout: Rollout  # scores, old_logprobs, ref_logprobs, values filled in
    raw_scores: torch.Tensor  # (B,) the judge's scores before penalties and normalisation
    gold: torch.Tensor | None  # (B,) gold judge, logged only
    entropy: torch.Tensor  # (B, R) actor entropy at sampling time (0 on padding)
    greedy_scores: torch.Tensor | None  # (B,) shaped score of the greedy response to each row's prompt (ReMax)
    timing: dict[str, float]
    monitors: dict[str, torch.Tensor]  # name -> (B,) scores of the monitor judges (logged only)

    def sample_records(self, iteration: int) -> list[dict]:
        """One samples.jsonl record per response."""
        ro = self.rollout
        out = []
        for i in range(len(ro)):
            rec = {"step": iteration, "prompt": prompt_text(ro.prompts[i]), "response": ro.responses[i],
                   "score": round(float(self.raw_scores[i]), 5), "length": int(ro.response_mask[i].sum()),
                   "eos": bool(ro.eos[i])}
            if self.gold is not None:
                rec["gold"] = round(float(self.gold[i]), 5)
            for name, values in self.monitors.items():
                rec[name] = round(float(values[i]), 5)
            out.append(rec)
        return out


class ExperienceMaker:
    """`plan`: the run's forward paths (trainers/plan.py): whether the engine's recorded log-probs are the old ones
    and whether the reference runs the shared prompt prefix once; `trunk`: the actor's frozen bottom layers where the
    plan uses them (their states are computed once per rollout here, for every forward above them)."""

    def __init__(self, cfg, roles: Roles, engine, accelerator, prompts: list, prompt_ids: list[list[int]],
                 moments, needs_greedy: bool, plan: ForwardPlan, trunk: Trunk | None = None):
        self.cfg = cfg
        self.roles = roles
        self.engine = engine
        self.accelerator = accelerator
        self.prompts = prompts
        self.prompt_ids = prompt_ids
        self.moments = moments
        self.needs_greedy = needs_greedy
        self.plan = plan
        self.trunk = trunk
        self._perm: tuple[int, list[int]] | None = None

    @torch.no_grad()
    def make(self, model, iteration: int) -> Experience:
        """`model`: the prepared PolicyModel (its unwrapped actor is synced into the engine)."""
        cfg, tok, G = self.cfg, self.roles.tokenizer, self.cfg.samples_per_prompt
        timing = {}
        t = time.perf_counter()
        batch = self.batch_indices(iteration)
        prompt_ids, prompt_mask = left_pad([self.prompt_ids[i] for i in batch], tok.pad_token_id)
        sharding.sync_engine(self.engine, self.accelerator, model)  # sharded: the gathered full weights
        offset = self.accelerator.process_index * len(batch) * G  # this process's first global sample
        ro = self.engine.generate(prompt_ids, prompt_mask, seed=step_seed(cfg.seed, iteration, 1), num_samples=G,
                                  sample_offset=offset)
        ro.prompts = [self.prompts[i] for i in batch for _ in range(G)]
        greedy = self.engine.generate(prompt_ids, prompt_mask, greedy=True) if self.needs_greedy else None
        timing["timing/generate"] = time.perf_counter() - t

        t = time.perf_counter()
        raw = self.roles.scorer(ro.prompts, ro.responses)
        gold = self.roles.gold(ro.prompts, ro.responses) if self.roles.gold is not None else None
        names = sorted(self.roles.monitors)
        monitors = [self.roles.monitors[n](ro.prompts, ro.responses) for n in names]
        greedy_raw = greedy_eos = None
        if greedy is not None:
            greedy_raw = self.roles.scorer([self.prompts[i] for i in batch], greedy.responses).repeat_interleave(G)
            greedy_eos = greedy.eos.repeat_interleave(G)
        timing["timing/score"] = time.perf_counter() - t

        t = time.perf_counter()
        trunk = self.trunk
        ro.trunk = self._trunk_states(trunk, ro) if trunk is not None else None
        if self.plan.reuse_sampling_logprobs and ro.engine_logprobs is not None:
            # the engine sampled the actor's own weights in the training precision: its log-probs are the forward's
            ro.old_logprobs, entropy = ro.engine_logprobs, ro.engine_entropy
            ro.engine_logprobs = ro.engine_entropy = None
            if self.roles.critic is not None:  # a separate critic: its own forward
                ro.values = self._chunked(lambda mb: model(mb, part="critic"), ro)[2]
        else:
            ro.old_logprobs, entropy, ro.values = self._chunked(lambda mb: model(mb), ro)
        timing["timing/forward"] = time.perf_counter() - t
        t = time.perf_counter()
        shared = trunk if self.roles.reference is None else None  # the adapter-disabled actor: the same trunk
        with self.roles.reference_model() as ref:
            ro.ref_logprobs = self._chunked(lambda mb: actor_logprobs(ref, mb, self.roles.temperature, trunk=shared,
                                                                      share_prefix=self.plan.reference_shares_prefix),
                                            ro)[0]
        timing["timing/reference"] = time.perf_counter() - t

        if self.accelerator.num_processes > 1:
            t = time.perf_counter()
            ro, raw, gold, entropy, greedy_raw, greedy_eos, *monitors = gather_experience(
                self.accelerator, ro, tok.pad_token_id, raw, gold, entropy, greedy_raw, greedy_eos, *monitors)
            timing["timing/gather"] = time.perf_counter() - t
        # scores -> what is optimised, over the whole batch: EOS penalty, running normalisation, clipping
        shaping = {"missing_eos_penalty": cfg.missing_eos_penalty, "moments": self.moments, "clip": cfg.reward_clip}
        ro.scores = shape_scores(raw, ro.eos, **shaping)
        greedy_scores = None if greedy_raw is None else shape_scores(greedy_raw, greedy_eos, update=False, **shaping)
        return Experience(ro, raw, gold, entropy, greedy_scores, timing, dict(zip(names, monitors)))

    def _chunked(self, forward, ro: Rollout) -> list[torch.Tensor | None]:
        """Run `forward` over micro-batches under autocast; its (B, R) outputs in row order, 0 on padding.

        The rows go in order of length, each micro-batch cut to its own longest row (`Rollout.by_length`)."""
        B, R = len(ro), ro.response_ids.shape[1]
        outs: list[torch.Tensor | None] = [None, None, None]
        for rows, mb in ro.by_length(self.cfg.micro_batch_size):
            with self.accelerator.autocast():
                part = forward(mb)
            for i, x in enumerate(part):
                if x is not None:
                    if outs[i] is None:
                        outs[i] = torch.zeros(B, R, dtype=x.dtype)
                    outs[i][rows, : x.shape[1]] = x
        mask = ro.response_mask
        return [None if x is None else x * mask for x in outs]

    def _trunk_states(self, trunk, ro: Rollout) -> torch.Tensor | None:
        """(B, T, H) the output of the actor's frozen bottom layers for every token of the rollout, computed in
        the same micro-batches as the forwards; None where it would take more than TRUNK_BUDGET_BYTES."""
        B, T = ro.prompt_ids.shape[0], ro.prompt_ids.shape[1] + ro.response_ids.shape[1]
        H = trunk.backbone.config.hidden_size
        if B * T * H * 4 > TRUNK_BUDGET_BYTES:
            return None
        P = ro.prompt_ids.shape[1]
        out = None
        for rows, mb in ro.by_length(self.cfg.micro_batch_size):
            ids, mask = mb.input_ids, mb.attention_mask
            with self.accelerator.autocast():
                states = trunk.states(ids, mask, position_ids_from_mask(mask))
            if out is None:
                out = torch.zeros(B, T, H, dtype=states.dtype, device=states.device)
            first = P - mb.prompt_ids.shape[1]  # the columns this chunk kept (`Rollout.trimmed`)
            out[rows, first : first + states.shape[1]] = states
        return out

    def batch_indices(self, iteration: int) -> list[int]:
        """This process's prompts for `iteration`: a seeded permutation per pass over the prompts, consumed
        in order by iteration and then by process, so a run's batches do not depend on when it resumed."""
        n, size = len(self.prompt_ids), self.cfg.rollout_batch_size
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        out = []
        for k in range(size):
            epoch, offset = divmod(((iteration - 1) * world + rank) * size + k, n)
            if self._perm is None or self._perm[0] != epoch:
                g = torch.Generator().manual_seed(step_seed(self.cfg.seed, epoch, 3))
                self._perm = (epoch, torch.randperm(n, generator=g).tolist())
            out.append(self._perm[1][offset])
        return out


def gather_experience(accelerator, ro: Rollout, pad_id: int, *per_row):
    """Every process's rows, in rank order, on every process: the Rollout (prompts left-padded and responses
    right-padded to common widths) and each (B, ...) tensor in `per_row` (None stays None)."""

    def cat(x, pad_first=False, value=0):
        if x is None:
            return None
        x = accelerator.pad_across_processes(x.contiguous(), dim=1, pad_index=value, pad_first=pad_first) if x.dim() > 1 else x
        return accelerator.gather(x.contiguous())

    pad = pad_id
    out = Rollout(
        prompt_ids=cat(ro.prompt_ids, True, pad), prompt_mask=cat(ro.prompt_mask, True, 0),
        response_ids=cat(ro.response_ids, False, pad), response_mask=cat(ro.response_mask),
        eos=cat(ro.eos.long()).bool(), prompts=gather_object(list(ro.prompts)),
        responses=gather_object(list(ro.responses)), old_logprobs=cat(ro.old_logprobs),
        ref_logprobs=cat(ro.ref_logprobs), values=cat(ro.values), engine_logprobs=cat(ro.engine_logprobs),
    )
    return (out, *(cat(x) if x is None or x.dtype != torch.bool else cat(x.long()).bool() for x in per_row))


def step_seed(seed: int, iteration: int, stream: int) -> int:
    """The seed of one random stream of one iteration (1 sampling, 2 minibatch order, 3 prompt order)."""
    return (seed * 1_000_003 + iteration * 7919 + stream * 104_729) % (2**31)


def rollout_stats(ro: Rollout) -> dict[str, float]:
    lengths = ro.lengths
    tokens = [ro.response_ids[i, : int(lengths[i])].tolist() for i in range(len(ro))]
    gap = {}
    if ro.engine_logprobs is not None and ro.old_logprobs is not None:  # the engine's own log-probs (vLLM)
        gap = logprob_gap(ro.old_logprobs, ro.engine_logprobs, ro.response_mask)
    return {
        **gap,
        "rollout/length_mean": lengths.mean().item(),
        "rollout/length_max": lengths.max().item(),
        "rollout/eos_rate": ro.eos.float().mean().item(),
        "rollout/distinct_1": distinct_n(tokens, 1),
        "rollout/distinct_2": distinct_n(tokens, 2),
        "rollout/repetition": sum(repetition_rate(t) for t in tokens) / len(tokens),
    }
