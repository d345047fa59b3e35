"""Per-image results from per-unit embeddings, in input order, and the cache filled with them.

An image cut into several units gets one small task that joins them (`VisionAdapter.join_units`:
a concatenation, or the family's own layout; units of one image may sit on different workers). Everything stays an
`ObjectRef`: nothing is fetched into this process.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import ray

from raypipe.encode.cache import EmbeddingCache
from raypipe.encode.plan import Plan, UnitId
from raypipe.models.base import VisionAdapter


@dataclasses.dataclass(slots=True)
class EncodedVisual:
    ref: ray.ObjectRef  # resolves to a (num_tokens, hidden) CPU tensor
    num_tokens: int
    grid: tuple[int, ...]
    content_hash: str
    cached: bool


def assemble(plan: Plan, unit_refs: dict[UnitId, ray.ObjectRef], cache: EmbeddingCache,
             adapter: VisionAdapter) -> list[EncodedVisual]:
    """One `EncodedVisual` per input; each newly encoded item is put in the cache."""
    refs = dict(plan.hits)
    adapter_ref = None  # put once per batch, for the join tasks
    for t, item in enumerate(plan.todo):
        parts = [unit_refs[uid] for uid in plan.unit_ids(t)]
        if len(parts) > 1 and adapter_ref is None:
            adapter_ref = ray.put(adapter)
        # The join needs the item's geometry, not its pixels.
        refs[item.content_hash] = parts[0] if len(parts) == 1 else \
            _join.remote(adapter_ref, dataclasses.replace(item, pixels=_NO_PIXELS), *parts)
        cache.put(item.content_hash, refs[item.content_hash], adapter.embedding_nbytes(item))
    return [EncodedVisual(refs[item.content_hash], item.num_tokens, item.grid, item.content_hash,
                         item.content_hash in plan.hits) for item in plan.items]


_NO_PIXELS = np.zeros((0, 0, 3), np.uint8)


@ray.remote(num_cpus=0)
def _join(adapter: VisionAdapter, item, *parts):
    """An item's embedding from its units' embeddings."""
    return adapter.join_units(item, list(parts))
