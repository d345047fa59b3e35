"""The balancer's contract (vLLM's `get_load_balance_assignment`) and the cost models."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe.encode.balance import even_split_assignment, get_load_balance_assignment, split_by_counts


def test_empty_input():
    assert get_load_balance_assignment([], 3) == ([], [0, 0, 0], [0, 0, 0])


def test_worked_example_largest_first_least_loaded():
    # sorted desc: 9(i1), 7(i3), 4(i0), 2(i2) ; 9->g0, 7->g1, 4->g1 (7<9), 2->g0 (9<11)
    shuffle, counts, loads = get_load_balance_assignment([4, 9, 2, 7], 2)
    assert shuffle == [1, 2, 3, 0]
    assert counts == [2, 2]
    assert loads == [11, 11]


def test_stable_sort_and_lowest_index_on_ties():
    # All equal: visited in input order, each to the lowest-index least-loaded GPU.
    shuffle, counts, loads = get_load_balance_assignment([5, 5, 5, 5, 5], 2)
    assert shuffle == [0, 2, 4, 1, 3]
    assert counts == [3, 2]
    assert loads == [15, 10]


def test_fewer_items_than_gpus_leaves_empty_gpus():
    shuffle, counts, loads = get_load_balance_assignment([3], 3)
    assert shuffle == [0] and counts == [1, 0, 0] and loads == [3, 0, 0]


def test_returns_lists():
    result = get_load_balance_assignment([1, 2, 3], 2)
    assert all(isinstance(part, list) for part in result)


def test_rejects_zero_gpus():
    with pytest.raises(ValueError):
        get_load_balance_assignment([1], 0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=10_000), max_size=60), st.integers(min_value=1, max_value=9))
def test_properties(sizes, n):
    shuffle, counts, loads = get_load_balance_assignment(sizes, n)
    assert sorted(shuffle) == list(range(len(sizes)))  # every item exactly once
    assert len(counts) == len(loads) == n and sum(counts) == len(sizes)
    shards = split_by_counts(shuffle, counts)
    assert [sum(sizes[i] for i in shard) for shard in shards] == loads
    if sizes:
        assert max(loads) <= sum(sizes) / n + max(sizes)  # LPT / greedy bound
    for shard in shards:  # each GPU receives its items largest first
        assert [sizes[i] for i in shard] == sorted((sizes[i] for i in shard), reverse=True)


def test_even_split_baseline():
    assert even_split_assignment(5, 2) == [[0, 1, 2], [3, 4]]
    assert even_split_assignment(1, 3) == [[0], [], []]
    assert even_split_assignment(0, 2) == [[], []]


def test_cost_models_order_images(tiny_ckpt):
    from raypipe.inputs.images import load_image
    from raypipe.models.registry import vision_adapter
    from tests.conftest import random_images

    adapter = vision_adapter(tiny_ckpt)
    small, large = (adapter.make_item(load_image(img)) for img in random_images([(56, 56), (448, 448)]))
    assert adapter.cost(small) == small.grid[1] * small.grid[2]
    # The attention model grows faster than linearly in patch count (full-attention blocks).
    ratio_patches = adapter.cost(large) / adapter.cost(small)
    ratio_attention = adapter.cost(large, "attention") / adapter.cost(small, "attention")
    assert ratio_attention > ratio_patches
    with pytest.raises(ValueError):
        adapter.cost(small, "bogus")


def test_initial_loads_steer_new_work_away_from_busy_workers():
    # Worker 0 already has 10 in flight: a lone item goes to worker 1, not to the lowest index.
    assert get_load_balance_assignment([3], 2, initial_loads=[10, 0]) == ([0], [0, 1], [0, 3])
    # The third list stays this batch's own sums; zeros reproduce the plain contract.
    assert get_load_balance_assignment([4, 9, 2, 7], 2, [0, 0]) == get_load_balance_assignment([4, 9, 2, 7], 2)
    with pytest.raises(ValueError):
        get_load_balance_assignment([1], 2, initial_loads=[0])
