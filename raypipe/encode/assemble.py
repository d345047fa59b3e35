"""Per-image results from per-unit embeddings, in input order, and the cache filled with them.

An image cut into several units gets one small task that concatenates them (units of one image
may sit on different workers; adapters order units for exactly this). Everything stays an
`ObjectRef`: nothing is fetched into this process.
"""

from __future__ import annotations

import dataclasses

import ray
import torch

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
    for t, item in enumerate(plan.todo):
        parts = [unit_refs[uid] for uid in plan.unit_ids(t)]
        refs[item.content_hash] = parts[0] if len(parts) == 1 else _concat.remote(*parts)
        cache.put(item.content_hash, refs[item.content_hash], adapter.embedding_nbytes(item))
    return [EncodedVisual(refs[item.content_hash], item.num_tokens, item.grid, item.content_hash,
                         item.content_hash in plan.hits) for item in plan.items]


@ray.remote(num_cpus=0)
def _concat(*parts):
    """An item's embedding from its units' embeddings."""
    return torch.cat(parts)
