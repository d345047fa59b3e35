"""The improving partitioner: every unit once, loads consistent, never worse than greedy, sometimes better."""

from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe.encode.balance import get_load_balance_assignment, split_by_counts
from raypipe.encode.partition import improve, makespan, partition


def greedy_makespan(costs, n, initial=None):
    order, counts, _ = get_load_balance_assignment(costs, n, initial)
    return makespan(costs, split_by_counts(order, counts), initial)


def not_worse(makespan_: float, greedy: float) -> bool:
    """Never worse than greedy, up to rounding: equal loads summed in another order differ in the last bits."""
    return makespan_ <= greedy * (1 + 1e-12)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1e4, allow_nan=False), max_size=60),
       st.integers(min_value=1, max_value=9), st.data())
def test_properties(costs, n, data):
    initial = data.draw(st.none() | st.lists(st.floats(min_value=0.0, max_value=1e4), min_size=n, max_size=n))
    shards, loads = partition(costs, n, initial, budget_s=1.0)
    assert len(shards) == len(loads) == n
    assert sorted(i for shard in shards for i in shard) == list(range(len(costs)))  # every unit exactly once
    for shard, load in zip(shards, loads):
        assert abs(load - sum(costs[i] for i in shard)) <= 1e-9 * max(1.0, load)
    if costs:
        assert not_worse(makespan(costs, shards, initial), greedy_makespan(costs, n, initial))


def test_a_split_as_good_as_greedys_summed_in_another_order_is_not_worse():
    """Hypothesis found this in a clean-clone run: the improved split's makespan is greedy's, summed in another
    order, 3e-12 above it. A strict `<=` failed; the property is "not worse up to rounding"."""
    costs = [2.0, 3830.0, 8192.0, 8194.0, 8194.0, 8194.0, 1.9406106584981444, 1.9406106584981444, 3830.963050930005,
             4362.963050930005, 4362.963050930005]
    shards, _ = partition(costs, 6, budget_s=1.0)
    assert makespan(costs, shards) != greedy_makespan(costs, 6)  # the case still differs in the last bits
    assert not_worse(makespan(costs, shards), greedy_makespan(costs, 6))


def test_strictly_better_than_greedy():
    # LPT's classic bad case: greedy puts 3+3 and 3+2+2 ... here on 2 workers:
    # sorted 3,3,2,2,2 -> greedy: w0 = 3+2+2 = 7, w1 = 3+2 = 5 (makespan 7); optimum 6 = 3+3 | 2+2+2.
    costs = [3, 3, 2, 2, 2]
    assert greedy_makespan(costs, 2) == 7
    shards, loads = partition(costs, 2, budget_s=1.0)
    assert makespan(costs, shards) == 6
    assert sorted(loads) == [6, 6]


def test_improve_counts_steps_and_keeps_an_optimal_split():
    shards = [[0, 1], [2, 3]]  # already optimal: 5 | 5
    assert improve([4, 1, 3, 2], shards, budget_s=1.0) == 0
    assert shards == [[0, 1], [2, 3]]


def test_in_flight_load_is_respected():
    # Worker 0 already has 10 in flight: everything new goes to worker 1 unless that is worse.
    shards, loads = partition([4, 3, 2], 2, [10.0, 0.0], budget_s=1.0)
    assert shards[0] == [] and loads == [0.0, 9.0]
