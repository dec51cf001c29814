"""The experience maker: one iteration's Rollout, everything the update needs and nothing it decides.

    1. sample a batch of prompts (seeded per iteration) and `samples_per_prompt` responses to each;
    2. score every response (reward model or callable, or the weighted sum of reward_funcs, each term kept for
       its own log line; the gold judge too when there is one); with dynamic sampling, drop the groups whose
       scores are all equal and sample more prompts to fill the batch (`_fill`); missing-EOS and overlong
       penalties, running normalisation, clipping; ReMax also scores one greedy response per prompt;
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
from dataclasses import dataclass, field

import torch
from accelerate.utils import gather_object

from quartet.algo.advantages import fill_groups, flat_groups
from quartet.algo.offpolicy import logprob_gap
from quartet.algo.shaping import overlong_penalty
from quartet.data import left_pad, prompt_text
from quartet.eval.stats import distinct_n, repetition_rate
from quartet.models.trunk import Trunk
from quartet.rollout.forward import noted_prefix
from quartet.rollout.record import Rollout, concat, position_ids_from_mask
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
    monitors: dict[str, torch.Tensor]  # name -> (B,) scores of the monitor judges and reward_funcs terms (logged only)
    stats: dict[str, float] = field(default_factory=dict)  # rollout/zero_std_groups, dynamic sampling's, ...

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


@dataclass
class Sampled:
    """One round of sampling before any forward: the responses and what each judge said of them (B rows)."""

    rollout: Rollout  # token ids, masks, eos, texts; the engine's log-probs where it records them
    raw: torch.Tensor  # (B,) the reward's scores
    gold: torch.Tensor | None  # (B,) the gold judge's
    logged: dict[str, torch.Tensor]  # name -> (B,): the monitor judges' scores, then each reward_funcs term's

    def select(self, rows: torch.Tensor) -> Sampled:
        return Sampled(self.rollout.select(rows), self.raw[rows], None if self.gold is None else self.gold[rows],
                       {k: v[rows] for k, v in self.logged.items()})

    @staticmethod
    def concat(parts: list[Sampled], pad_id: int) -> Sampled:
        """The rows of several rounds as one (`record.concat`)."""
        cat = torch.cat
        return Sampled(concat([p.rollout for p in parts], pad_id), cat([p.raw for p in parts]),
                       None if parts[0].gold is None else cat([p.gold for p in parts]),
                       {k: cat([p.logged[k] for p in parts]) for k in parts[0].logged})


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
        t = time.perf_counter()
        batch = self.batch_indices(iteration)
        sharding.sync_engine(self.engine, self.accelerator, model)  # sharded: the gathered full weights
        timing = {"timing/generate": time.perf_counter() - t, "timing/score": 0.0}
        sampled, greedy = self._sample(batch, step_seed(cfg.seed, iteration, 1), timing, greedy=self.needs_greedy)
        stats = {}
        if cfg.dynamic_sampling:
            sampled, stats = self._fill(iteration, sampled, timing)
        ro, raw, gold = sampled.rollout, sampled.raw, sampled.gold
        names, logged = list(sampled.logged), list(sampled.logged.values())
        greedy_raw, greedy_eos, greedy_len = greedy if greedy is not None else (None, None, None)

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
            ro, raw, gold, entropy, greedy_raw, greedy_eos, greedy_len, *logged = gather_experience(
                self.accelerator, ro, tok.pad_token_id, raw, gold, entropy, greedy_raw, greedy_eos, greedy_len, *logged)
            timing["timing/gather"] = timing.get("timing/gather", 0.0) + time.perf_counter() - t
        # scores -> what is optimised, over the whole batch: EOS and overlong penalties, running normalisation, clipping
        shaping = {"missing_eos_penalty": cfg.missing_eos_penalty, "moments": self.moments, "clip": cfg.reward_clip}
        overlong = self._overlong(ro.lengths)
        ro.scores = shape_scores(raw, ro.eos, overlong=overlong, **shaping)
        greedy_scores = None if greedy_raw is None else shape_scores(greedy_raw, greedy_eos, update=False,
                                                                     overlong=self._overlong(greedy_len), **shaping)
        if G >= 2:  # the groups that teach nothing (the doctor's no_group_signal reads this)
            stats["rollout/zero_std_groups"] = flat_groups(ro.scores, G).float().mean().item()
        if overlong is not None:
            stats["objective/overlong_penalty"] = overlong.mean().item()
        return Experience(ro, raw, gold, entropy, greedy_scores, timing, dict(zip(names, logged)), stats)

    def _sample(self, batch: list[int], seed: int, timing: dict, greedy: bool = False):
        """G responses to each of this process's prompts `batch`, drawn from `seed`, and what the judges say of them
        -> (Sampled, None or ReMax's greedy (scores, eos, lengths), each repeated for the G rows of its prompt)."""
        tok, G = self.roles.tokenizer, self.cfg.samples_per_prompt
        t = time.perf_counter()
        prompt_ids, prompt_mask = left_pad([self.prompt_ids[i] for i in batch], tok.pad_token_id)
        offset = self.accelerator.process_index * len(batch) * G  # this process's first global sample
        ro = self.engine.generate(prompt_ids, prompt_mask, seed=seed, num_samples=G, sample_offset=offset)
        ro.prompts = [self.prompts[i] for i in batch for _ in range(G)]
        greedy_ro = self.engine.generate(prompt_ids, prompt_mask, greedy=True) if greedy else None
        timing["timing/generate"] += time.perf_counter() - t

        t = time.perf_counter()
        raw, terms = self.roles.scorer.terms(ro.prompts, ro.responses)
        gold = self.roles.gold(ro.prompts, ro.responses) if self.roles.gold is not None else None
        logged = {n: self.roles.monitors[n](ro.prompts, ro.responses) for n in sorted(self.roles.monitors)}
        logged.update(terms)  # reward_funcs: each term's own scores, logged as rollout/reward_<name>
        baseline = None
        if greedy_ro is not None:
            greedy_raw = self.roles.scorer([self.prompts[i] for i in batch], greedy_ro.responses)
            baseline = tuple(x.repeat_interleave(G) for x in (greedy_raw, greedy_ro.eos, greedy_ro.lengths))
        timing["timing/score"] += time.perf_counter() - t
        return Sampled(ro, raw, gold, logged), baseline

    def _fill(self, iteration: int, first: Sampled, timing: dict) -> tuple[Sampled, dict[str, float]]:
        """DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2): a group whose G scores are all equal has advantage 0
        and teaches nothing, so such groups are dropped and rounds of rollout_batch_size more prompts per process are
        sampled until the whole batch's groups with signal fill it, for at most dynamic_sampling_rounds rounds; a
        batch still short then takes the first groups dropped, so every iteration trains on as many groups. Each
        round is gathered onto every process before the choice, which is then the same on all and the same as one
        process with the whole batch would make; this process then forwards its share of the chosen rows."""
        cfg, G = self.cfg, self.cfg.samples_per_prompt
        size, world, rank = cfg.rollout_batch_size, self.accelerator.num_processes, self.accelerator.process_index
        target = size * world  # groups in the whole batch
        rounds = [self._everyone(first, timing)]
        flat = [self._flat(rounds[0])]
        while len(rounds) < cfg.dynamic_sampling_rounds and int(sum((~f).sum() for f in flat)) < target:
            r = len(rounds)
            more, _ = self._sample(self.round_indices(iteration, r), step_seed(cfg.seed, iteration, ROUND_SAMPLING + r),
                                   timing)
            rounds.append(self._everyone(more, timing))
            flat.append(self._flat(rounds[-1]))
        flat = torch.cat(flat)  # (groups sampled,) over the rounds, each round in global order
        chosen = fill_groups(flat, target)
        rows = (chosen.unsqueeze(1) * G + torch.arange(G)).flatten()
        mine = rows[rank * size * G : (rank + 1) * size * G]
        stats = {"rollout/dropped_groups": (flat.sum() - flat[chosen].sum()).item() / len(flat),
                 "rollout/sampling_rounds": float(len(rounds))}
        return Sampled.concat(rounds, self.roles.tokenizer.pad_token_id).select(mine), stats

    def _everyone(self, sampled: Sampled, timing: dict) -> Sampled:
        """Every process's rows of one round of sampling, in rank order, on every process."""
        if self.accelerator.num_processes == 1:
            return sampled
        t = time.perf_counter()
        ro, raw, gold, *logged = gather_experience(self.accelerator, sampled.rollout, self.roles.tokenizer.pad_token_id,
                                                   sampled.raw, sampled.gold, *sampled.logged.values())
        timing["timing/gather"] = timing.get("timing/gather", 0.0) + time.perf_counter() - t
        return Sampled(ro, raw, gold, dict(zip(sampled.logged, logged)))

    def _flat(self, sampled: Sampled) -> torch.Tensor:
        """(groups,) bool: the groups whose scores, with the EOS and overlong penalties (normalisation and clipping
        come once the batch is chosen), are all equal."""
        ro = sampled.rollout
        scores = shape_scores(sampled.raw, ro.eos, missing_eos_penalty=self.cfg.missing_eos_penalty, moments=None,
                              clip=None, overlong=self._overlong(ro.lengths))
        return flat_groups(scores, self.cfg.samples_per_prompt)

    def _overlong(self, lengths: torch.Tensor | None) -> torch.Tensor | None:
        """(B,) DAPO's soft overlong penalties of responses of `lengths`; None when overlong_buffer is 0."""
        cfg = self.cfg
        if not cfg.overlong_buffer or lengths is None:
            return None
        return overlong_penalty(lengths, cfg.generation.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)

    def _chunked(self, forward, ro: Rollout) -> list[torch.Tensor | None]:
        """Run `forward` over micro-batches under autocast; its (B, R) outputs in row order, 0 on padding.

        The rows go in order of length, each micro-batch cut to its own longest row (`Rollout.by_length`)."""
        B, R = len(ro), ro.response_ids.shape[1]
        outs: list[torch.Tensor | None] = [None, None, None]
        for rows, mb in ro.by_length(self.cfg.micro_batch_size):
            with self.accelerator.autocast():
                # the models' device; the rollout stays where it is, its shared prefix counted here on the host
                part = forward(noted_prefix(mb).to(self.accelerator.device))
            for i, x in enumerate(part):
                if x is not None:
                    if outs[i] is None:
                        outs[i] = torch.zeros(B, R, dtype=x.dtype, device=ro.response_mask.device)
                    outs[i][rows, : x.shape[1]] = x.to(outs[i].device)
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
            mb = mb.to(self.accelerator.device)
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


    def round_indices(self, iteration: int, round_: int) -> list[int]:
        """This process's prompts for round `round_` >= 1 of dynamic sampling in `iteration`: rollout_batch_size of a
        permutation of their own per (iteration, round), taken in order by process, so the extra rounds take nothing
        from later iterations' prompts and do not depend on how the batch is split across processes."""
        n, size = len(self.prompt_ids), self.cfg.rollout_batch_size
        g = torch.Generator().manual_seed(step_seed(self.cfg.seed, iteration, ROUND_PROMPTS + round_))
        perm = torch.randperm(n, generator=g).tolist()
        first = self.accelerator.process_index * size
        return [perm[(first + k) % n] for k in range(size)]


def gather_experience(accelerator, ro: Rollout, pad_id: int, *per_row):
    """Every process's rows, in rank order, on every process: the Rollout (prompts left-padded and responses
    right-padded to common widths) and each (B, ...) tensor in `per_row` (None stays None)."""

    def cat(x, pad_first=False, value=0):
        if x is None:
            return None
        home, x = x.device, x.to(accelerator.device)  # NCCL gathers GPU tensors; the rows go back where they were
        x = accelerator.pad_across_processes(x.contiguous(), dim=1, pad_index=value, pad_first=pad_first) if x.dim() > 1 else x
        return accelerator.gather(x.contiguous()).to(home)

    pad = pad_id
    out = Rollout(
        prompt_ids=cat(ro.prompt_ids, True, pad), prompt_mask=cat(ro.prompt_mask, True, 0),
        response_ids=cat(ro.response_ids, False, pad), response_mask=cat(ro.response_mask),
        eos=cat(ro.eos.long()).bool(), prompts=gather_object(list(ro.prompts)),
        responses=gather_object(list(ro.responses)), old_logprobs=cat(ro.old_logprobs),
        ref_logprobs=cat(ro.ref_logprobs), values=cat(ro.values), engine_logprobs=cat(ro.engine_logprobs),
        engine_entropy=cat(ro.engine_entropy),
    )
    return (out, *(cat(x) if x is None or x.dtype != torch.bool else cat(x.long()).bool() for x in per_row))


ROUND_SAMPLING, ROUND_PROMPTS = 100, 200
"""dynamic sampling's round r >= 1 samples from stream ROUND_SAMPLING + r, its prompts from ROUND_PROMPTS + r"""


def step_seed(seed: int, iteration: int, stream: int) -> int:
    """The seed of one random stream of one iteration (1 sampling, 2 minibatch order, 3 prompt order; dynamic
    sampling's extra rounds: ROUND_SAMPLING + r, ROUND_PROMPTS + r)."""
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
