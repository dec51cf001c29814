"""The doctor's rules: each a function of the metrics logged so far (a `History`) that returns a `Finding` or None,
registered in `RULES` in the order the doctor checks them (quartet.monitor.doctor runs them, live and afterwards).
Apart from ``nan``, no rule fires on fewer than 3 points of its metrics, so short runs do not raise noise. Each rule
declares the points it needs to fire at all (``Rule.needs``), and `unjudged_counts` names the rules a run was too
short for, so a short run's "no findings" says what it could not see.
`History` (what a rule reads) and `Finding` (what it returns) live here with the rules, so that the doctor's engines
import the rules and nothing here imports the doctor.

Rules and thresholds (metric keys of docs/CONTRACTS.md; "now" = median of the last 3 points, "start" =
median of the first 3; "score up" = objective/score (else objective/reward) now > start; KL is per
sequence in nats, "per token" divides by rollout/length_mean now, or by 48 when length is not logged):

=========================== ======================================================================
nan                         any logged objective / loss / grad-norm / other metric is NaN or inf
grad_spike                  optim/grad_norm > 10x the median of the previous (up to 20) values, >= 5 of them
reward_flat_kl_zero         |objective/kl| < 0.05 for the last 10 points and objective/score not rising
                            (trend t-statistic < 2 over those points)
kl_blowup                   KL now > 3x the adaptive target (objective/kl_target or kl_target=); or
                            KL now > 0.5 nats per response token; or, over the last 10 points, KL rose
                            at 8 of 9 steps, gained >= 25% of its value, did not level off (second-half
                            rise >= 0.9x first-half rise) and is above 0.2 nats per token
negative_kl                 mean of the last (up to 5) objective/kl values < -0.1 nats
reward_hacking_length       rollout/length_mean now >= 1.5x start and >= 4 tokens longer, score up
reward_hacking_repetition   rollout/distinct_2 (or distinct_1) now <= 0.7x start, or rollout/repetition
                            now >= start + 0.15 and >= 2x start, with score up
off_task_drift              >= 6 points of rollout/relevance (an on-task judge's mean, e.g. MiniLM similarity of
                            response and prompt); its mean over the last k = max(3, n/4) points <= 0.8x the
                            mean over the first k, lower by > 5 noise sd of such a difference, with score up
overoptimization            objective/gold, averaged over windows of k = max(3, n/10) points, fell from
                            its peak window by > 30% of its gain and by > 4 noise sd, while
                            objective/score is higher now than during the peak window
entropy_collapse            policy/entropy now < 0.3x start, or < 0.02 nats
clipfrac_zero               policy/clipfrac <= 0.001 at every one of the last (up to 10) points, >= 5 of them
clipfrac_high               median of the last (up to 5) policy/clipfrac > 0.3
value_loss_explosion        value/loss now > 10x its best 3-point median and above its start, or > 100x best
value_loss_stuck            >= 15 points; value/loss median of last 5 >= 0.9x median of first 5, and
                            value/explained_variance (when logged) below 0.1
explained_variance_negative >= 10 points; the last 5 value/explained_variance all below 0, their median < -0.1
truncation                  rollout/eos_rate now < 0.5 (most responses hit max_new_tokens)
no_group_signal             rollout/zero_std_groups (share of the batch's prompt groups whose samples all scored
                            the same: advantage 0) now > 0.5
engine_mismatch             rollout/logprob_diff_mean (|trainer - engine| log-prob of the sampled tokens, per
                            token, logged when the engine returns log-probs, e.g. vLLM) now > 0.5 nats; or, with
                            >= 6 points, now >= 3x start and > start + 0.05 nats
both_logps_down             DPO, >= 6 points: the chosen answers' log-ratio to the reference (rewards/chosen
                            / dpo/beta, change from start) fell > 1 nat, the rejected ones' fell further,
                            and the chosen fall is >= 25% of the margin gained
=========================== ======================================================================
"""

from __future__ import annotations

import difflib
import itertools
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from quartet.errors import ConfigError

MIN_POINTS = 3
SCORE_KEYS = ("objective/score", "objective/reward")
DEFAULT_RESPONSE_TOKENS = 48  # GenerationConfig.max_new_tokens; scales KL thresholds when length is not logged

GRAD_SPIKE_RATIO, GRAD_SPIKE_HISTORY, GRAD_SPIKE_MIN_HISTORY = 10.0, 20, 5
KL_ZERO, KL_ZERO_WINDOW, FLAT_T = 0.05, 10, 2.0
KL_TARGET_RATIO, KL_MAX_PER_TOKEN, KL_GROWTH_PER_TOKEN, KL_GROWTH_WINDOW, KL_GROWTH_REL = 3.0, 0.5, 0.2, 10, 0.25
NEGATIVE_KL = -0.1
LENGTH_RATIO, LENGTH_MIN_TOKENS = 1.5, 4.0
DISTINCT_RATIO, REPETITION_RISE = 0.7, 0.15
GOLD_DROP_OF_GAIN, GOLD_DROP_NOISE, GOLD_MIN_POINTS = 0.3, 4.0, 6
ENTROPY_RATIO, ENTROPY_FLOOR = 0.3, 0.02
CLIPFRAC_ZERO, CLIPFRAC_ZERO_WINDOW, CLIPFRAC_ZERO_MIN = 1e-3, 10, 5
CLIPFRAC_HIGH = 0.3
VALUE_EXPLOSION_RATIO, VALUE_EXPLOSION_HARD = 10.0, 100.0
VALUE_STUCK_MIN, VALUE_STUCK_RATIO, VALUE_STUCK_EV = 15, 0.9, 0.1
EV_MIN_POINTS, EV_WINDOW, EV_MEDIAN_MAX = 10, 5, -0.1
EOS_RATE_MIN = 0.5
RELEVANCE_KEY, RELEVANCE_RATIO, RELEVANCE_NOISE = "rollout/relevance", 0.8, 5.0
CHOSEN_DROP_NATS, CHOSEN_SHARE = 1.0, 0.25
MISMATCH_KEY, MISMATCH_MAX, MISMATCH_RATIO, MISMATCH_RISE = "rollout/logprob_diff_mean", 0.5, 3.0, 0.05
FLAT_GROUPS_KEY, FLAT_GROUPS_MAX = "rollout/zero_std_groups", 0.5


# --------------------------------------------------------------------------- findings
@dataclass
class Finding:
    """One diagnosis: what was seen, the numbers that show it, why it usually happens, what to change."""

    rule: str
    severity: str
    """"error" (the run is broken or about to be) or "warning" (likely wasting compute or gaming the reward)"""
    step: int
    symptom: str
    evidence: dict
    """metric key, window [first_step, last_step], the values in it, optionally related metrics' values"""
    cause: str
    fix: str
    stage: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Finding:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def format(self) -> str:
        ev = self.evidence
        window = ev.get("window") or ["?", "?"]
        values = " ".join(_fmt(v) for v in ev.get("values", []))
        where = f"  [{self.stage}]" if self.stage else ""
        lines = [
            f"{self.severity.upper():7s} {self.rule} at step {self.step}{where}",
            f"  symptom   {self.symptom}",
            f"  evidence  {ev.get('metric')} at steps {window[0]}..{window[-1]}: {values}",
        ]
        for key, vals in (ev.get("related") or {}).items():
            lines.append(f"            {key}: {' '.join(_fmt(v) for v in vals)}")
        lines += [f"  cause     {self.cause}", f"  fix       {self.fix}"]
        return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _json_value(v):
    """Non-finite floats as strings, so findings.jsonl is strict JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return round(v, 6) if isinstance(v, float) else v


# --------------------------------------------------------------------------- history of one run
class History:
    """Metrics of one stage so far: per key, the steps where it was logged with a finite value, and those values.

    Non-finite values are kept only in ``current`` (the latest step's metrics), where the ``nan`` rule sees them.
    """

    def __init__(self, kl_target: float | None = None):
        self.kl_target = kl_target
        self.step = None
        self.current: dict[str, float] = {}
        self._steps: dict[str, list] = {}
        self._values: dict[str, list[float]] = {}
        self._best3: dict[str, tuple[int, float]] = {}

    def add(self, step, metrics: dict) -> None:
        if step != self.step:
            self.current = {}
        self.step = step
        for key, value in metrics.items():
            if key in ("stage", "step", "time") or isinstance(value, bool) or value is None:
                continue
            try:
                value = float(value)
            except (TypeError, ValueError):
                continue
            self.current[key] = value
            steps, values = self._steps.setdefault(key, []), self._values.setdefault(key, [])
            if steps and steps[-1] == step:  # the same step logged twice: the later value wins
                steps.pop()
                values.pop()
                self._best3.pop(key, None)
            if math.isfinite(value):
                steps.append(step)
                values.append(value)

    def tail(self, key: str, n: int | None = None) -> tuple[list, list[float]]:
        """(steps, values) of the last ``n`` finite values of ``key`` (all of them when n is None)."""
        steps, values = self._steps.get(key, []), self._values.get(key, [])
        if n is None:
            return list(steps), list(values)
        return steps[-n:], values[-n:]

    def head(self, key: str, n: int) -> list[float]:
        """The first ``n`` finite values of ``key``."""
        return self._values.get(key, [])[:n]

    def best_median3(self, key: str) -> float:
        """Lowest median of 3 consecutive values of ``key`` so far (inf with fewer than 3), kept incrementally."""
        values = self._values.get(key, [])
        done, best = self._best3.get(key, (2, math.inf))
        for i in range(done, len(values)):
            best = min(best, _median(values[i - 2 : i + 1]))
        self._best3[key] = (max(done, len(values)), best)
        return best

    def count(self, key: str) -> int:
        return len(self._values.get(key, []))

    def counts(self) -> dict[str, int]:
        """Every key logged so far -> its number of finite points."""
        return {key: len(values) for key, values in self._values.items()}

    def has(self, key: str, n: int = MIN_POINTS) -> bool:
        return self.count(key) >= n

    def logged_now(self, key: str) -> bool:
        return key in self.current

    def score_key(self) -> str | None:
        return next((k for k in SCORE_KEYS if self.has(k, 1)), None)


def _median(xs) -> float:
    return float(statistics.median(xs))


def _mean(xs) -> float:
    return float(statistics.fmean(xs))


def _trend_t(values: list[float]) -> float:
    """t-statistic of the least-squares slope of values against their index (+-inf for an exact line)."""
    n = len(values)
    if n < 3:
        return 0.0
    xs = range(n)
    mx, my = (n - 1) / 2, _mean(values)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, values)) / sxx
    resid = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, values))
    se = math.sqrt(resid / (n - 2) / sxx)
    if se < 1e-12 * max(1.0, abs(my)):
        return 0.0 if abs(slope) < 1e-12 * max(1.0, abs(my)) else math.copysign(math.inf, slope)
    return slope / se


def _score_gain(h: History) -> tuple[str, float, list, list] | None:
    """(key, now - start, steps, values) of the score, or None with fewer than 3 points."""
    key = h.score_key()
    if key is None or not h.has(key):
        return None
    steps, values = h.tail(key, 10)
    return key, _median(values[-3:]) - _median(h.head(key, 3)), steps, values


# --------------------------------------------------------------------------- rules
@dataclass(frozen=True)
class Rule:
    name: str
    severity: str
    check: Callable[[History], Finding | None] = field(repr=False)
    needs: tuple[tuple[str, int, str], ...] = ()
    """(metric key, points, part): the rule (or the named part of it; "" = the whole rule) cannot fire before
    that metric has been logged at that many steps; a run with fewer is too short for it to judge"""


RULES: dict[str, Rule] = {}


def _rule(name: str, severity: str, *needs: tuple):
    def register(fn):
        RULES[name] = Rule(name, severity, fn, tuple((key, n, part[0] if part else "") for key, n, *part in needs))
        return fn

    return register


def unjudged_counts(counts: dict[str, int]) -> list[str]:
    """What a run logged too few points of to judge: ``counts`` maps a metric key to the number of steps that
    logged it. Rules whose metric was never logged (another stage's rules) are left out: they do not apply.
    One line per rule or part, e.g. ``value_loss_stuck (value/loss: 7 of the 15 points it needs)``."""
    out = []
    for rule in RULES.values():
        for key, n, part in rule.needs:
            if 0 < counts.get(key, 0) < n:
                what = f"{rule.name}'s {part}" if part else rule.name
                out.append(f"{what} ({key}: {counts[key]} of the {n} points it needs)")
    return out


def _found(name, h, key, steps, values, symptom, cause, fix, related=None) -> Finding:
    evidence = {
        "metric": key,
        "window": [steps[0], steps[-1]] if steps else [h.step, h.step],
        "values": [_json_value(v) for v in values],
    }
    if related:
        evidence["related"] = {k: [_json_value(v) for v in vs] for k, vs in related.items()}
    return Finding(name, RULES[name].severity, h.step, symptom, evidence, cause, fix)


@_rule("nan", "error")
def _nan(h: History):
    bad = {k: v for k, v in h.current.items() if not math.isfinite(v)}
    if not bad:
        return None
    order = ("policy/loss", "value/loss", "optim/grad_norm", "sft/loss", "rm/loss", "dpo/loss")
    key = next((k for k in order if k in bad), sorted(bad)[0])
    return _found(
        "nan", h, key, [h.step], [bad[key]],
        f"{key} is {bad[key]} ({len(bad)} metric(s) non-finite: {', '.join(sorted(bad))})",
        "exploding gradients (learning rate too high, no gradient clipping), fp16 overflow, a log of 0 "
        "(a probability of exactly 0 under top-k/top-p sampling), or a non-finite reward",
        "lower optim.lr, keep optim.max_grad_norm set (1.0), use precision=fp32 or bf16 instead of fp16, "
        "and check the reward function returns finite numbers",
    )


@_rule("grad_spike", "warning", ("optim/grad_norm", GRAD_SPIKE_MIN_HISTORY + 1))
def _grad_spike(h: History):
    key = "optim/grad_norm"
    if not h.logged_now(key):
        return None
    steps, values = h.tail(key, GRAD_SPIKE_HISTORY + 1)
    if len(values) < GRAD_SPIKE_MIN_HISTORY + 1 or steps[-1] != h.step:
        return None
    typical = _median(values[:-1])
    if typical <= 0 or values[-1] <= GRAD_SPIKE_RATIO * typical:
        return None
    return _found(
        "grad_spike", h, key, steps, values,
        f"gradient norm {values[-1]:.3g} is {values[-1] / typical:.0f}x its recent median {typical:.3g}",
        "a few extreme samples (very large advantages or rewards) or a learning rate too high for this batch",
        "keep optim.max_grad_norm at 1.0 or lower it, lower optim.lr, add warmup, and normalise rewards "
        "(reward_norm=true, reward_clip)",
    )


@_rule("reward_flat_kl_zero", "warning", ("objective/kl", KL_ZERO_WINDOW))
def _reward_flat_kl_zero(h: History):
    key = "objective/kl"
    steps, kl = h.tail(key, KL_ZERO_WINDOW)
    if len(kl) < KL_ZERO_WINDOW or max(abs(v) for v in kl) >= KL_ZERO:
        return None
    related = None
    score_key = h.score_key()
    if score_key is not None:
        _, score = h.tail(score_key, KL_ZERO_WINDOW)
        if len(score) >= MIN_POINTS and _trend_t(score) >= FLAT_T:
            return None
        related = {score_key: score}
    return _found(
        "reward_flat_kl_zero", h, key, steps, kl,
        f"the policy has not moved from the reference in {len(kl)} logged steps (|KL| < {KL_ZERO} nats) "
        "and the score is flat",
        "the KL penalty beta (kl_coef) is so large that any change costs more than it earns, or the "
        "learning rate is too small for the updates to move the policy",
        "lower kl_coef (e.g. 0.05 -> 0.01) or enable adaptive_kl, raise optim.lr (e.g. 1e-5 -> 3e-5), "
        "and check the score actually differs between responses",
        related,
    )


@_rule("kl_blowup", "error", ("objective/kl", MIN_POINTS), ("objective/kl", KL_GROWTH_WINDOW, "KL-growth test"))
def _kl_blowup(h: History):
    key = "objective/kl"
    if not h.has(key):
        return None
    steps, kl = h.tail(key, KL_GROWTH_WINDOW)
    now = _median(kl[-3:])
    _, lengths = h.tail("rollout/length_mean", 3)
    tokens = max(_median(lengths), 1.0) if lengths else DEFAULT_RESPONSE_TOKENS
    target = h.kl_target
    if h.has("objective/kl_target", 1):
        target = h.tail("objective/kl_target", 1)[1][0]
    fix = ("raise kl_coef (or enable adaptive_kl with a kl_target), lower optim.lr or ppo_epochs, and "
           "compare samples with the reference to see what drifted")
    cause = ("the penalty beta (kl_coef) is too small for this learning rate, so the policy is free to "
             "exploit the reward model far from the reference")
    if target and target > 0 and now > KL_TARGET_RATIO * target:
        return _found(
            "kl_blowup", h, key, steps, kl,
            f"KL {now:.3g} nats is {now / target:.1f}x the adaptive target {target:.3g}",
            "the adaptive controller cannot raise beta fast enough (kl_horizon too long) or the learning "
            "rate moves the policy faster than the penalty can hold it",
            "shorten kl_horizon, start from a larger kl_coef, or lower optim.lr",
        )
    if now / tokens > KL_MAX_PER_TOKEN:
        return _found(
            "kl_blowup", h, key, steps, kl,
            f"KL to the reference is {now:.3g} nats per response ({now / tokens:.2f} per token): "
            "outputs have likely drifted into text the reference finds implausible",
            cause, fix,
        )
    if len(kl) >= KL_GROWTH_WINDOW:
        win = kl[-KL_GROWTH_WINDOW:]
        rises = sum(b > a for a, b in zip(win, win[1:]))
        grew = win[-1] - win[0] >= KL_GROWTH_REL * win[-1]
        # a healthy KL curve levels off: it rises clearly less in the second half of the window than in the first
        half = KL_GROWTH_WINDOW // 2
        not_slowing = win[-1] - win[half] >= 0.9 * (win[half - 1] - win[0])
        if rises >= KL_GROWTH_WINDOW - 2 and grew and not_slowing and win[-1] / tokens > KL_GROWTH_PER_TOKEN:
            return _found(
                "kl_blowup", h, key, steps[-KL_GROWTH_WINDOW:], win,
                f"KL rose at {rises} of the last {KL_GROWTH_WINDOW - 1} steps to {win[-1]:.3g} nats "
                "with no sign of levelling off",
                cause, fix,
            )
    return None


@_rule("negative_kl", "error", ("objective/kl", MIN_POINTS))
def _negative_kl(h: History):
    key = "objective/kl"
    steps, kl = h.tail(key, 5)
    if len(kl) < MIN_POINTS or _mean(kl) >= NEGATIVE_KL:
        return None
    return _found(
        "negative_kl", h, key, steps, kl,
        f"the k1 KL estimate averages {_mean(kl):.3g} nats: the responses look more likely under the "
        "reference than under the policy that sampled them",
        "log-probs at training time do not match the sampling distribution: sampling with temperature "
        "!= 1, top-k or top-p, a different padding / position ids / attention mask between generation "
        "and scoring, dropout left on, or policy and reference swapped",
        "sample with temperature=1.0, top_p=1.0, top_k=0 for PPO; score responses with the same "
        "padding and position ids as generation; put models in eval mode; or use kl_estimator=k3",
    )


@_rule("reward_hacking_length", "warning", ("rollout/length_mean", 2 * MIN_POINTS))
def _reward_hacking_length(h: History):
    key = "rollout/length_mean"
    score = _score_gain(h)
    if score is None or not h.has(key, 2 * MIN_POINTS):
        return None
    steps, lengths = h.tail(key, 10)
    start, now = _median(h.head(key, 3)), _median(lengths[-3:])
    if not (now >= LENGTH_RATIO * start and now - start >= LENGTH_MIN_TOKENS and score[1] > 0):
        return None
    return _found(
        "reward_hacking_length", h, key, steps, lengths,
        f"responses grew from {start:.3g} to {now:.3g} tokens while {score[0]} rose by {score[1]:.3g}",
        "the reward model prefers longer answers regardless of quality, so length is the easiest way up",
        "check the correlation of score and length in the preference data, add a length penalty or "
        "length-balanced pairs to the reward model, or raise kl_coef; read samples before trusting the score",
        {score[0]: score[3]},
    )


@_rule("reward_hacking_repetition", "warning", ("rollout/distinct_2", 2 * MIN_POINTS))
def _reward_hacking_repetition(h: History):
    score = _score_gain(h)
    if score is None:
        return None
    symptom = None
    for key in ("rollout/distinct_2", "rollout/distinct_1"):
        if h.has(key, 2 * MIN_POINTS):
            steps, values = h.tail(key, 10)
            start, now = _median(h.head(key, 3)), _median(values[-3:])
            if start > 0 and now <= DISTINCT_RATIO * start:
                symptom = f"{key} fell from {start:.3g} to {now:.3g}"
            break
    if symptom is None and h.has("rollout/repetition", 2 * MIN_POINTS):
        key = "rollout/repetition"
        steps, values = h.tail(key, 10)
        start, now = _median(h.head(key, 3)), _median(values[-3:])
        if now >= start + REPETITION_RISE and now >= 2 * start:
            symptom = f"{key} rose from {start:.3g} to {now:.3g}"
    if symptom is None or score[1] <= 0:
        return None
    return _found(
        "reward_hacking_repetition", h, key, steps, values,
        f"{symptom} while {score[0]} rose by {score[1]:.3g}: the policy repeats a few phrases the reward likes",
        "the reward (a reward model, or a rule such as a format reward) pays for a phrase or template wherever "
        "it appears, and the policy's entropy is collapsing onto it (mode collapse); on a verifiable task this "
        "is often answers shrinking to the marked answer alone, without the working",
        "raise kl_coef, add an entropy bonus (entropy_coef), add repetitive responses as rejected "
        "examples to the preference data (or lower a format reward's weight), and stop at an earlier checkpoint",
        {score[0]: score[3]},
    )


@_rule("off_task_drift", "warning", (RELEVANCE_KEY, 2 * MIN_POINTS))
def _off_task_drift(h: History):
    key = RELEVANCE_KEY
    score = _score_gain(h)
    if score is None or score[1] <= 0 or not h.has(key, 2 * MIN_POINTS):
        return None
    all_steps, relevance = h.tail(key)
    k = max(MIN_POINTS, len(relevance) // 4)  # means of k points: 3-point medians raised false alarms
    start, now = _mean(relevance[:k]), _mean(relevance[-k:])
    diffs = [b - a for a, b in zip(relevance, relevance[1:])]
    mean_diff = sum(diffs) / len(diffs)
    noise = math.sqrt(sum((d - mean_diff) ** 2 for d in diffs) / len(diffs) / 2)  # per point, trend removed
    drop = start - now
    # two k-point means of independent noise differ with sd noise * sqrt(2 / k)
    if not (now <= RELEVANCE_RATIO * start and drop > max(RELEVANCE_NOISE * noise * math.sqrt(2 / k), 1e-9)):
        return None
    related = {score[0]: score[3]}
    if h.has("rollout/length_mean", 1):
        related["rollout/length_mean"] = h.tail("rollout/length_mean", 10)[1]
    return _found(
        "off_task_drift", h, key, all_steps[-10:], relevance[-10:],
        f"{key} fell from {start:.3g} to {now:.3g} while {score[0]} rose by {score[1]:.3g}: the answers are "
        "drifting away from their prompts",
        "the reward cannot see whether a response is about its prompt (a judge such as VADER reads the "
        "response alone; a reward model trained on its labels inherits that), so generic text it likes "
        "(praise, a stock phrase) pays as well as an answer, and is easier to reach",
        "reward a composite judge that pays only on-task answers (e.g. reward: task:positive-review/on-task, "
        "or gate(<judge>, judge:relevance, lo=.., hi=..)) and label preferences with it when a reward model "
        "is trained; raise kl_coef; add a relevance or length term (sum(<judge>, 0.5*judge:relevance)); or "
        "keep an earlier checkpoint (stop_on: [off_task_drift])",
        related,
    )


@_rule("overoptimization", "warning", ("objective/gold", GOLD_MIN_POINTS))
def _overoptimization(h: History):
    key = "objective/gold"
    score_key = h.score_key()
    if score_key is None or not h.has(key, GOLD_MIN_POINTS) or not h.has(score_key, GOLD_MIN_POINTS):
        return None
    steps, gold = h.tail(key)
    n = len(gold)
    k = max(3, n // 10)  # smoothing grows with the run, so the peak of a long noisy plateau is not a "drop"
    sums = [0.0, *itertools.accumulate(gold)]
    means = [(sums[i + k] - sums[i]) / k for i in range(n - k + 1)]  # means[i]: gold[i : i + k]
    earlier = means[: n - 2 * k + 1]  # windows that end before the current one starts
    if not earlier:
        return None
    peak_i = max(range(len(earlier)), key=earlier.__getitem__)
    peak, now = means[peak_i], means[-1]
    drop, gain = peak - now, peak - means[0]
    diffs = [b - a for a, b in zip(gold, gold[1:])]
    mean_diff = sum(diffs) / len(diffs)
    noise = math.sqrt(sum((d - mean_diff) ** 2 for d in diffs) / len(diffs) / 2)
    # two k-point means of independent noise differ with sd noise * sqrt(2 / k)
    if drop <= max(GOLD_DROP_OF_GAIN * gain, GOLD_DROP_NOISE * noise * math.sqrt(2 / k), 1e-9):
        return None
    lo, hi = steps[peak_i], steps[peak_i + k - 1]
    s_steps, score = h.tail(score_key, n)
    at_peak = [v for s, v in zip(s_steps, score) if lo <= s <= hi]
    if not at_peak or _mean(score[-k:]) <= _mean(at_peak):
        return None
    return _found(
        "overoptimization", h, key, steps[-10:], gold[-10:],
        f"the gold score fell {drop:.3g} from its peak around steps {lo}-{hi} while {score_key} kept "
        f"rising ({_mean(at_peak):.3g} -> {_mean(score[-k:]):.3g})",
        "the policy is optimising the proxy reward past the point where it agrees with the gold judge "
        "(Goodhart; Gao et al. 2022 reward-model overoptimization)",
        f"keep the checkpoint from around step {hi}, raise kl_coef, train the reward model on "
        "more (or on-policy) preference pairs, or stop earlier (stop_on: [overoptimization])",
        {score_key: score[-10:]},
    )


@_rule("entropy_collapse", "warning", ("policy/entropy", MIN_POINTS))
def _entropy_collapse(h: History):
    key = "policy/entropy"
    if not h.has(key):
        return None
    steps, ent = h.tail(key, 10)
    start, now = _median(h.head(key, 3)), _median(ent[-3:])
    if not (now < ENTROPY_FLOOR or (start > 0 and now < ENTROPY_RATIO * start)):
        return None
    return _found(
        "entropy_collapse", h, key, steps, ent,
        f"policy entropy fell from {start:.3g} to {now:.3g} nats per token: sampling is nearly deterministic",
        "updates too large (learning rate, ppo_epochs) or a weak KL penalty let the policy put all its mass "
        "on a few tokens; exploration stops and diversity goes with it",
        "lower optim.lr or ppo_epochs, raise kl_coef, or add a small entropy bonus (entropy_coef=0.01)",
    )


@_rule("clipfrac_zero", "warning", ("policy/clipfrac", CLIPFRAC_ZERO_MIN))
def _clipfrac_zero(h: History):
    key = "policy/clipfrac"
    steps, cf = h.tail(key, CLIPFRAC_ZERO_WINDOW)
    if len(cf) < CLIPFRAC_ZERO_MIN or max(cf) > CLIPFRAC_ZERO:
        return None
    return _found(
        "clipfrac_zero", h, key, steps, cf,
        f"the policy ratio was (almost) never clipped in the last {len(cf)} steps: updates barely move it",
        "the learning rate is too small, or there is one optimizer step per rollout (ppo_epochs=1 and "
        "minibatch_size=rollout_batch_size), where the ratio is exactly 1 by construction",
        "raise optim.lr, or use several minibatches / ppo_epochs per rollout so the clip can act",
    )


@_rule("clipfrac_high", "warning", ("policy/clipfrac", MIN_POINTS))
def _clipfrac_high(h: History):
    key = "policy/clipfrac"
    steps, cf = h.tail(key, 5)
    if len(cf) < MIN_POINTS or _median(cf) <= CLIPFRAC_HIGH:
        return None
    return _found(
        "clipfrac_high", h, key, steps, cf,
        f"{_median(cf):.0%} of tokens hit the ratio clip: most of each update is thrown away",
        "steps too large (learning rate, ppo_epochs, small minibatches), or old log-probs that do not "
        "match the policy (ratio far from 1 already at the first minibatch)",
        "lower optim.lr or ppo_epochs, use larger minibatches, and check old_logprobs are computed "
        "exactly as in the update (same dtype, padding and position ids)",
    )


@_rule("value_loss_explosion", "error", ("value/loss", MIN_POINTS + 1))  # at 3 points, now is the best median
def _value_loss_explosion(h: History):
    key = "value/loss"
    if not h.has(key):
        return None
    steps, vl = h.tail(key, 10)
    best, now, start = max(h.best_median3(key), 1e-12), _median(vl[-3:]), _median(h.head(key, 3))
    if not ((now > VALUE_EXPLOSION_RATIO * best and now > start) or now > VALUE_EXPLOSION_HARD * best):
        return None
    return _found(
        "value_loss_explosion", h, key, steps, vl,
        f"value loss is {now:.3g}, {now / best:.0f}x its best ({best:.3g})",
        "returns changed scale (unnormalised or growing rewards, KL penalty growing) or the critic's "
        "learning rate is too high; a bad critic makes advantages noisy and destabilises the actor",
        "normalise rewards (reward_norm=true), keep value_clip, lower critic_lr or vf_coef",
    )


@_rule("value_loss_stuck", "warning", ("value/loss", VALUE_STUCK_MIN))
def _value_loss_stuck(h: History):
    key = "value/loss"
    if not h.has(key, VALUE_STUCK_MIN):
        return None
    steps, vl = h.tail(key, 10)
    start, now = _median(h.head(key, 5)), _median(vl[-5:])
    if now < VALUE_STUCK_RATIO * start:
        return None
    related = None
    if h.has("value/explained_variance", 5):
        _, ev = h.tail("value/explained_variance", 5)
        if _median(ev) >= VALUE_STUCK_EV:
            return None
        related = {"value/explained_variance": ev}
    return _found(
        "value_loss_stuck", h, key, steps, vl,
        f"value loss has not decreased in {h.count(key)} logged steps ({start:.3g} -> {now:.3g})",
        "the critic is not learning: learning rate too small, vf_coef too small on a shared backbone, or "
        "a value head reading the wrong token positions",
        "raise critic_lr or vf_coef, try critic=separate initialised from the reward model, and check the "
        "values are read at response positions",
        related,
    )


@_rule("explained_variance_negative", "warning", ("value/explained_variance", EV_MIN_POINTS))
def _explained_variance_negative(h: History):
    key = "value/explained_variance"
    if not h.has(key, EV_MIN_POINTS):
        return None
    steps, ev = h.tail(key, EV_WINDOW)
    if max(ev) >= 0 or _median(ev) >= EV_MEDIAN_MAX:
        return None
    return _found(
        "explained_variance_negative", h, key, steps, ev,
        f"explained variance stayed below 0 for {len(ev)} steps: the critic predicts returns worse than "
        "their mean would",
        "the critic has not warmed up or is fitting stale targets: returns change scale each iteration, or "
        "its learning rate is too small / large",
        "normalise rewards, initialise the critic from the reward model, tune critic_lr, or pre-train the "
        "value head for a few iterations before updating the actor",
    )


@_rule("truncation", "warning", ("rollout/eos_rate", MIN_POINTS))
def _truncation(h: History):
    key = "rollout/eos_rate"
    steps, eos = h.tail(key, 10)
    if len(eos) < MIN_POINTS or _median(eos[-3:]) >= EOS_RATE_MIN:
        return None
    now = _median(eos[-3:])
    return _found(
        "truncation", h, key, steps, eos,
        f"only {now:.0%} of responses end with EOS; the rest are cut off at max_new_tokens",
        "max_new_tokens is too small for the task, or the SFT model never learned to stop (EOS missing "
        "from the SFT targets or the chat template); the reward is then given to unfinished text",
        "raise generation.max_new_tokens, make sure SFT completions end with the EOS token, or set "
        "missing_eos_penalty so unfinished responses score low",
    )


@_rule("no_group_signal", "warning", (FLAT_GROUPS_KEY, MIN_POINTS))
def _no_group_signal(h: History):
    key = FLAT_GROUPS_KEY
    steps, share = h.tail(key, 10)
    if len(share) < MIN_POINTS or _median(share[-3:]) <= FLAT_GROUPS_MAX:
        return None
    now = _median(share[-3:])
    related = {k: h.tail(k, 10)[1] for k in ("rollout/dropped_groups", "objective/score") if h.has(k, 1)}
    if "rollout/dropped_groups" in related:  # dynamic sampling is on, and its rounds ran out before the batch filled
        first = ("raise dynamic_sampling_rounds (its rounds ran out before enough groups with signal were found; "
                 "rollout/dropped_groups is the share it threw away)")
    else:
        first = ("set dynamic_sampling: true (DAPO: such groups are dropped and more prompts sampled to fill the "
                 "batch)")
    return _found(
        "no_group_signal", h, key, steps, share,
        f"{now:.0%} of the batch's prompts got the same score for every one of their samples: their group "
        "advantage is 0, so they teach nothing",
        "the prompts are too hard for the policy (every sample fails) or too easy (every sample passes) under a "
        "right-or-wrong reward, or there are too few samples per prompt to see a difference; the update then rests "
        "on the few groups left, a small and noisy gradient, while the KL term still pulls towards the reference",
        f"{first}; train on prompts nearer the policy's level (an easier curriculum: pass rates between 10% and "
        "90%); or raise samples_per_prompt",
        related,
    )


@_rule("engine_mismatch", "warning", (MISMATCH_KEY, MIN_POINTS), (MISMATCH_KEY, 2 * MIN_POINTS, "growth test"))
def _engine_mismatch(h: History):
    key = MISMATCH_KEY
    if not h.has(key):
        return None
    steps, gap = h.tail(key, 10)
    now, start = _median(gap[-3:]), _median(h.head(key, 3))
    grew = h.has(key, 2 * MIN_POINTS) and now >= MISMATCH_RATIO * start and now > start + MISMATCH_RISE
    if now <= MISMATCH_MAX and not grew:
        return None
    related = {"rollout/logprob_diff_max": h.tail("rollout/logprob_diff_max", 10)[1]}
    symptom = (f"the sampling engine and the trainer disagree by {now:.3g} nats per sampled token "
               f"(mean |log-prob difference|; {start:.3g} at the start)")
    return _found(
        "engine_mismatch", h, key, steps, gap, symptom,
        "the engine no longer samples from the weights being trained: a weight sync that does not reach it "
        "(stale or partly loaded weights, LoRA not merged), different sampling settings in the two (temperature, "
        "top-p, top-k), or precision drift as the policy moves to tokens where bf16 rounding matters more; PPO's "
        "ratio is then taken against a policy that did not draw the samples",
        "check that the engine's greedy output equals the trainer's after a sync, sample PPO with temperature 1, "
        "top_p 1, top_k 0, and set tis_cap (e.g. 2.0) to reweight tokens by min(pi_train / pi_engine, C)",
        {k: v for k, v in related.items() if v},
    )


@_rule("both_logps_down", "warning", ("rewards/chosen", 2 * MIN_POINTS))
def _both_logps_down(h: History):
    chosen_key, rejected_key = "rewards/chosen", "rewards/rejected"
    if not (h.has(chosen_key, 2 * MIN_POINTS) and h.has(rejected_key, 2 * MIN_POINTS)):
        return None
    beta = h.tail("dpo/beta", 1)[1][0] if h.has("dpo/beta", 1) else 1.0
    steps, chosen = h.tail(chosen_key, 10)
    _, rejected = h.tail(rejected_key, 10)
    # implicit rewards are beta (log pi - log pi_ref): divided by beta, the change since the start in nats
    d_chosen = (_median(chosen[-3:]) - _median(h.head(chosen_key, 3))) / beta
    d_rejected = (_median(rejected[-3:]) - _median(h.head(rejected_key, 3))) / beta
    gain = d_chosen - d_rejected
    if not (d_chosen < -CHOSEN_DROP_NATS and gain > 0 and -d_chosen >= CHOSEN_SHARE * gain):
        return None
    related = {rejected_key: rejected}
    for key in ("logps/chosen", "logps/rejected"):
        if h.has(key, 1):
            related[key] = h.tail(key, 10)[1]
    return _found(
        "both_logps_down", h, chosen_key, steps, chosen,
        f"the chosen answers became less likely ({d_chosen:.3g} nats against the reference) along with the "
        f"rejected ones ({d_rejected:.3g}): {-d_chosen / gain:.0%} of the margin gained comes from pushing "
        "the preferred answers down",
        "the DPO loss only sees the margin, and on pairs whose answers share most of their tokens, or with a "
        "small beta over many epochs, lowering the rejected answer drags the chosen one down with it; the "
        "probability goes to answers in neither set (likelihood displacement, Razin et al. 2024; Pal et al. 2024)",
        "raise beta, lower optim.lr or epochs, try loss: ipo (a bounded margin), drop pairs whose two answers "
        "are near-identical, and read samples against the reference before trusting the margin",
        related,
    )


def check_rule_names(names, where: str = "stop_on") -> list[str]:
    """Validate rule names (a name or a list of them); unknown ones are a one-line ConfigError."""
    if names is None:
        return []
    if isinstance(names, str):
        names = [names]
    out = []
    if not isinstance(names, (list, tuple)):
        raise ConfigError(f"{where}: must be a rule name or a list of them, got {names!r}")
    for name in names:
        if not isinstance(name, str) or name not in RULES:
            close = difflib.get_close_matches(str(name), list(RULES), n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{where}: unknown doctor rule '{name}'{hint}; known rules: {', '.join(RULES)}")
        out.append(name)
    return out
