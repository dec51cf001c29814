"""Batches of similar length: the order every batched forward over ragged texts or token lists walks.

A forward over a padded batch costs its longest row in every row; sorting by length first puts rows of a size
together, so little of a batch is padding. The results are the same as in any order (each row's output is put
back at its index), up to the float rounding a different batch shape brings.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence, Sized


def by_length(items: Sequence[Sized], batch_size: int) -> Iterator[list[int]]:
    """Indices of `items` in batches of at most `batch_size`, shortest first (`len` of each item; ties keep their
    order)."""
    if batch_size < 1:
        raise ValueError(f"by_length: batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(items)), key=lambda i: len(items[i]))
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]
