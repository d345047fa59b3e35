"""Size-based greedy load balancing of a batch over data-parallel encoder replicas.

`get_load_balance_assignment` follows vLLM's contract exactly (vllm/multimodal/utils.py): items are
visited largest-first (a *stable* sort, so equal sizes keep input order), each goes to the GPU with
the least load so far (lowest index on ties), and the result is three plain lists. This is the
classic LPT heuristic: makespan <= sum/n + max(size).

Nothing here knows about Ray or torch; the cost models only turn item geometry into numbers.
"""

from __future__ import annotations

from collections.abc import Sequence


def get_load_balance_assignment(
    sizes: Sequence[float], num_gpus: int = 2, initial_loads: Sequence[float] | None = None
) -> tuple[list[int], list[int], list[float]]:
    """Assign items to `num_gpus` workers, largest first, each to the least-loaded worker.

    Returns `(shuffle_indices, gpu_sample_counts, grouped_sizes_per_gpu)`: the original indices
    grouped by worker (worker 0's items first, each group in assignment order), how many items each
    worker got, and each worker's summed size of *these* items.

    `initial_loads` (raypipe's extension; default all zero = vLLM's behaviour) is work the workers
    already have in flight, so that concurrent batches do not all start on worker 0.
    """
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    if initial_loads is not None and len(initial_loads) != num_gpus:
        raise ValueError(f"initial_loads has {len(initial_loads)} entries for {num_gpus} GPUs")
    if not sizes:
        return [], [0] * num_gpus, [0] * num_gpus

    assignments: list[list[int]] = [[] for _ in range(num_gpus)]
    loads = [0] * num_gpus
    busy = list(initial_loads) if initial_loads is not None else [0] * num_gpus
    for idx in sorted(range(len(sizes)), key=lambda i: sizes[i], reverse=True):
        target = min(range(num_gpus), key=lambda g: busy[g])  # min() keeps the lowest index on ties
        assignments[target].append(idx)
        loads[target] += sizes[idx]
        busy[target] += sizes[idx]

    shuffle_indices = [i for group in assignments for i in group]
    return shuffle_indices, [len(group) for group in assignments], loads


def split_by_counts(shuffle_indices: Sequence[int], counts: Sequence[int]) -> list[list[int]]:
    """Cut the flat `shuffle_indices` into one index list per worker."""
    shards, start = [], 0
    for count in counts:
        shards.append(list(shuffle_indices[start : start + count]))
        start += count
    return shards


def even_split_assignment(num_items: int, num_gpus: int) -> list[list[int]]:
    """Count-based contiguous split (vLLM's `run_dp_sharded_vision_model` style): the baseline."""
    per = -(-num_items // num_gpus) if num_items else 0
    return [list(range(g * per, min((g + 1) * per, num_items))) for g in range(num_gpus)]
