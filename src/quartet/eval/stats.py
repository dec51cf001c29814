"""Small statistics for comparing policies: diversity, repetition, bootstrap intervals, win rate, pass@k.

Everything here is plain Python + numpy, deterministic given ``seed``, and has a closed-form or
hand-worked reference test in tests/eval/test_stats.py.

Texts are split on whitespace; token-id lists are used as they are. A "sequence" below is either.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

# bootstrap resamples are drawn in chunks of at most this many indices, so memory stays bounded
_CHUNK_ELEMENTS = 1_000_000


# --------------------------------------------------------------------------- n-gram diversity
def _as_tokens(seq) -> list:
    if isinstance(seq, str):
        return seq.split()
    # tensors / arrays: compare token ids by value (a torch scalar hashes by identity)
    return seq.tolist() if hasattr(seq, "tolist") else list(seq)


def _as_corpus(seqs) -> list[list]:
    """A corpus: texts or token lists (a 2-D tensor / array is one sequence per row).
    One text, or one flat list of ints, is a corpus of one."""
    if isinstance(seqs, str):
        return [seqs.split()]
    seqs = seqs.tolist() if hasattr(seqs, "tolist") else list(seqs)
    if seqs and isinstance(seqs[0], (int, np.integer)):
        return [seqs]
    return [_as_tokens(s) for s in seqs]


def ngrams(tokens: Sequence, n: int) -> list[tuple]:
    """The len(tokens) - n + 1 contiguous n-grams of one sequence (none when it is shorter than n)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    tokens = _as_tokens(tokens)
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(seqs, n: int = 2, per_sequence: bool = False) -> float:
    """Distinct-n (Li et al. 2016): distinct n-grams / total n-grams.

    Corpus level (default): n-grams are pooled over all sequences, so a policy that gives every prompt the
    same answer scores low even when each answer is varied in itself.
    ``per_sequence=True``: the ratio is computed within each sequence and averaged over the sequences that
    have at least one n-gram.
    Returns 0.0 when there is no n-gram at all (every sequence shorter than n).
    """
    corpus = [ngrams(s, n) for s in _as_corpus(seqs)]
    if per_sequence:
        ratios = [len(set(g)) / len(g) for g in corpus if g]
        return float(np.mean(ratios)) if ratios else 0.0
    total = sum(len(g) for g in corpus)
    if total == 0:
        return 0.0
    return len({gram for g in corpus for gram in g}) / total


def repetition_rate(tokens, n: int = 4) -> float:
    """Share of a sequence's n-grams that repeat an n-gram seen earlier in the same sequence.

    With k = len(tokens) - n + 1 n-grams of which u are distinct, the rate is (k - u) / k = 1 - distinct-n of
    that one sequence: 0.0 for a sequence without repeats (or shorter than n), approaching 1.0 for a
    sequence stuck in a loop. The default n = 4 ignores natural repeats such as "of the".
    """
    grams = ngrams(tokens, n)
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def mean_repetition_rate(seqs: Iterable, n: int = 4) -> float:
    """repetition_rate averaged over sequences (every sequence counts once); 0.0 for an empty corpus."""
    rates = [repetition_rate(s, n) for s in _as_corpus(seqs)]
    return float(np.mean(rates)) if rates else 0.0


# --------------------------------------------------------------------------- bootstrap
def _as_values(values, name: str) -> np.ndarray:
    x = np.asarray(list(values) if not isinstance(values, np.ndarray) else values, dtype=np.float64).ravel()
    if x.size == 0:
        raise ValueError(f"{name}: needs at least one value")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name}: contains NaN or infinite values")
    return x


def _bootstrap_means(x: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """Means of ``n_boot`` resamples (with replacement, same size as x)."""
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    rng = np.random.default_rng(seed)
    rows = max(1, _CHUNK_ELEMENTS // x.size)
    out = np.empty(n_boot)
    for start in range(0, n_boot, rows):
        stop = min(start + rows, n_boot)
        idx = rng.integers(0, x.size, size=(stop - start, x.size))
        out[start:stop] = x[idx].mean(axis=1)
    return out


def _interval(boots: np.ndarray, alpha: float) -> tuple[float, float]:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    lo, hi = np.quantile(boots, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def bootstrap_ci(values, n_boot: int = 2000, alpha: float = 0.05, seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``values`` and its percentile-bootstrap (1 - alpha) confidence interval: (mean, lo, hi).

    The interval holds the alpha/2 and 1 - alpha/2 quantiles of the means of ``n_boot`` resamples drawn
    with replacement (Efron & Tibshirani 1993, ch. 13). Same seed, same interval.
    """
    x = _as_values(values, "values")
    lo, hi = _interval(_bootstrap_means(x, n_boot, seed), alpha)
    return float(x.mean()), lo, hi


def paired_bootstrap_diff(
    a, b, n_boot: int = 2000, alpha: float = 0.05, seed: int = 0
) -> tuple[float, float, float]:
    """Mean of a - b over paired items (same prompts) and its bootstrap interval: (mean_diff, lo, hi).

    Prompts are resampled, not the two score lists separately, so the shared per-prompt difficulty cancels
    and the interval is as narrow as the pairing allows (Koehn 2004, paired bootstrap resampling).
    """
    xa, xb = _as_values(a, "a"), _as_values(b, "b")
    if xa.size != xb.size:
        raise ValueError(f"paired scores need equal lengths, got {xa.size} and {xb.size}")
    return bootstrap_ci(xa - xb, n_boot=n_boot, alpha=alpha, seed=seed)


# --------------------------------------------------------------------------- win rate
def win_rate(a_scores, b_scores, tie_eps: float = 0.0) -> float:
    """Share of paired items where a beats b; a tie (|a - b| <= tie_eps) counts as half a win.

    0.5 means no difference; 1.0 means a wins every prompt.
    """
    xa, xb = _as_values(a_scores, "a_scores"), _as_values(b_scores, "b_scores")
    if xa.size != xb.size:
        raise ValueError(f"paired scores need equal lengths, got {xa.size} and {xb.size}")
    if tie_eps < 0:
        raise ValueError(f"tie_eps must be >= 0, got {tie_eps}")
    diff = xa - xb
    ties = np.abs(diff) <= tie_eps
    wins = (diff > 0) & ~ties
    return float((wins.sum() + 0.5 * ties.sum()) / diff.size)


# --------------------------------------------------------------------------- pass@k
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k, the chance that at least one of k samples is right, from n samples of which c
    were right (Chen et al. 2021, eq. 1): 1 - C(n - c, k) / C(n, k), as their numerically stable product
    1 - prod_{i = n - c + 1}^{n} (1 - k / i). Averaged over prompts it estimates the mean pass@k without the bias
    of 1 - (1 - c/n)^k."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_ks(n: int) -> list[int]:
    """The k reported for n samples per prompt: 1, the powers of two below n, and n."""
    return sorted({1, n, *(2**i for i in range(n.bit_length()) if 2**i < n)})
