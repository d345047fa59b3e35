"""A partitioner that starts from greedy (LPT) and then improves it by local search.

Greedy largest-first is within `sum/n + max` of optimal, but on a heavy-tailed mix it routinely
leaves the most-loaded worker a few percent above what a different split allows (the issue-13
benchmark: ~4% at n=8 even on exact costs). `partition` keeps greedy's answer as the starting
point and then repeats, while a time budget lasts:

    take the most-loaded worker m; among all single moves of one of m's units to another worker w,
    and all swaps of a unit of m with a smaller unit of w, apply the one that leaves the pair's
    larger load smallest, if that is below m's load.

Each applied step strictly lowers m's load without raising any other worker to m's old load, so the
sorted load vector drops lexicographically: the makespan never rises, and the loop ends. Greedy's
result is never made worse. The budget (default 2 ms) is far below the encode time a better split
saves (tens to hundreds of ms per batch); `bench encode` measures both.

When every unit costs the same and no worker is busier than another (fixed-size towers: LLaVA-OneVision's
base views and tiles), the answer is vLLM's even split (`run_dp_sharded_vision_model`), contiguous and
without its padding: its makespan, ceil(units / workers) units, is optimal, and neighbouring units (the
tiles of one image) stay on one worker.

`balance.get_load_balance_assignment` stays vLLM's exact contract; this is raypipe's own choice for
the coordinator.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from raypipe.encode.balance import even_split_assignment, get_load_balance_assignment, split_by_counts

DEFAULT_BUDGET_S = 0.002


def partition(costs: Sequence[float], num_workers: int, initial_loads: Sequence[float] | None = None,
              *, budget_s: float = DEFAULT_BUDGET_S) -> tuple[list[list[int]], list[float]]:
    """`(shards, loads)`: unit indices per worker and each worker's summed cost of *these* units.

    `initial_loads` is work already in flight per worker (counted in the makespan, not in `loads`).
    """
    if len(set(costs)) == 1 and len(set(initial_loads or [0.0])) == 1:
        shards = even_split_assignment(len(costs), num_workers)
        return shards, [float(costs[0] * len(shard)) for shard in shards]
    order, counts, _ = get_load_balance_assignment(costs, num_workers, initial_loads)
    shards = split_by_counts(order, counts)
    improve(costs, shards, initial_loads, budget_s=budget_s)
    return shards, [float(sum(costs[i] for i in shard)) for shard in shards]


def improve(costs: Sequence[float], shards: list[list[int]], initial_loads: Sequence[float] | None = None,
            *, budget_s: float = DEFAULT_BUDGET_S) -> int:
    """Improve `shards` in place by moves and swaps off the most-loaded worker; returns steps applied."""
    n = len(shards)
    if n < 2:
        return 0
    base = list(initial_loads) if initial_loads is not None else [0.0] * n
    busy = [base[w] + sum(costs[i] for i in shard) for w, shard in enumerate(shards)]
    deadline = time.perf_counter() + budget_s
    steps = 0
    while time.perf_counter() < deadline:
        m = max(range(n), key=busy.__getitem__)
        best = _best_step(costs, shards, busy, m)
        if best is None:
            break
        pair_max, w, take, give = best
        shards[m].remove(take)
        shards[w].append(take)
        delta = costs[take]
        if give is not None:
            shards[w].remove(give)
            shards[m].append(give)
            delta -= costs[give]
        busy[m] -= delta
        busy[w] += delta
        steps += 1
    return steps


def _best_step(costs, shards, busy, m):
    """The move or swap off worker `m` that minimises the pair's larger load, if it beats `busy[m]`."""
    top = busy[m]
    best = None  # (pair_max, worker, unit taken from m, unit given back or None)
    for w in range(len(shards)):
        if w == m:
            continue
        gap = top - busy[w]  # a transfer of size d helps iff 0 < d < gap
        if gap <= 0:
            continue
        for take in shards[m]:
            d = costs[take]
            if 0 < d < gap:
                pair = max(top - d, busy[w] + d)
                if best is None or pair < best[0]:
                    best = (pair, w, take, None)
            for give in shards[w]:
                d = costs[take] - costs[give]
                if 0 < d < gap:
                    pair = max(top - d, busy[w] + d)
                    if best is None or pair < best[0]:
                        best = (pair, w, take, give)
    return best


def makespan(costs: Sequence[float], shards: Sequence[Sequence[int]],
             initial_loads: Sequence[float] | None = None) -> float:
    base = list(initial_loads) if initial_loads is not None else [0.0] * len(shards)
    return max(b + sum(costs[i] for i in shard) for b, shard in zip(base, shards))
