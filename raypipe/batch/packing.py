"""Encoder batches formed by cost budget, not by image count.

Ray Data hands an actor whatever rows a batch holds; with a fixed image count, a batch of 4K scans
costs many times a batch of thumbnails, and the actor that draws it becomes the straggler. Here the
CPU stage groups each slice of decoded images into packs of about `budget` cost, using the same
balancer as the online coordinator (`get_load_balance_assignment`: largest first, to the cheapest
pack), and ships each pack to the encoder pool as one row. `by_count` is the fixed-count baseline
that `raypipe bench batch` compares against.

The budget is a multiple of the model's largest image, so a slice of thumbnails fits in one pack:
the job would then have one pack per decode slice (32 images), too few to keep every encoder busy
to the end. Cost packs are therefore never fewer than fixed-count batching would make (`per_pack`
images on average); the two then differ only in how even the packs are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from raypipe.encode.balance import get_load_balance_assignment, split_by_counts


def by_cost(costs: Sequence[float], budget: float, per_pack: int | None = None) -> list[list[int]]:
    """Index groups whose summed costs are each about `budget` or less (as even as LPT makes them),
    with at most `per_pack` items per group on average."""
    if budget <= 0:
        raise ValueError(f"budget must be positive, got {budget}")
    total = float(sum(costs))
    if not costs:
        return []
    num_packs = max(1, round(total / budget), math.ceil(len(costs) / per_pack) if per_pack else 1)
    num_packs = min(len(costs), num_packs)
    order, counts, _ = get_load_balance_assignment(list(costs), num_packs)
    return [sorted(pack) for pack in split_by_counts(order, counts) if pack]


def by_count(num_items: int, per_pack: int) -> list[list[int]]:
    """Consecutive groups of `per_pack` items (the last may be smaller)."""
    if per_pack < 1:
        raise ValueError(f"per_pack must be >= 1, got {per_pack}")
    return [list(range(start, min(start + per_pack, num_items))) for start in range(0, num_items, per_pack)]
