import pytest

from quartet.batching import by_length


def test_batches_hold_every_index_once_shortest_first_ties_in_order():
    items = ["ccc", "a", "bb", "a", "dddd", "bb"]  # lengths 3 1 2 1 4 2
    batches = list(by_length(items, 4))
    assert batches == [[1, 3, 2, 5], [0, 4]]
    assert list(by_length(items, 1)) == [[1], [3], [2], [5], [0], [4]]
    assert list(by_length([], 8)) == []
    assert list(by_length([[7, 8], [9]], 8)) == [[1, 0]]  # token lists as well as strings


def test_a_batch_size_below_one_is_refused():
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        list(by_length(["a"], 0))
