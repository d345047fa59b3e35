"""Per-item results from per-unit embeddings, in input order, and the cache filled with them.

An item cut into several units is joined (`VisionAdapter.join_units`: a concatenation, or the
family's own layout) by `EncoderWorker.join` on the worker that holds most of its units' bytes, so
the fewest rows move and nothing starts a process (a Ray task would, whenever no idle task worker
is left: seconds of imports). A join whose worker died is re-run on a live one, like a shard.
Everything stays an `ObjectRef`: nothing is fetched into this process but the joins' receipts.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import ray

from raypipe.encode.cache import EmbeddingCache
from raypipe.encode.plan import Plan, UnitId
from raypipe.encode.pool import EncoderPool
from raypipe.encode.worker_calls import run_with_retries
from raypipe.models.base import VisionAdapter


@dataclasses.dataclass(slots=True)
class EncodedVisual:
    ref: ray.ObjectRef  # resolves to a (num_tokens, hidden) CPU tensor
    num_tokens: int
    grid: tuple[int, ...]
    content_hash: str
    cached: bool


def assemble(plan: Plan, unit_refs: dict[UnitId, ray.ObjectRef], holders: dict[UnitId, int], workers: list,
             pool: EncoderPool, cache: EmbeddingCache, adapter: VisionAdapter, *, max_attempts: int
             ) -> tuple[list[EncodedVisual], int]:
    """`(one EncodedVisual per input, joins re-run)`; each newly encoded item is put in the cache.
    `holders`: the index (into `workers`) of the worker each unit was encoded on."""
    refs = dict(plan.hits)
    joins = []  # (worker index, todo index)
    for t, item in enumerate(plan.todo):
        uids = plan.unit_ids(t)
        if len(uids) == 1:
            refs[item.content_hash] = unit_refs[uids[0]]
        else:
            joins.append((join_worker(uids, holders, plan, adapter), t))

    def launch(worker, t: int) -> ray.ObjectRef:
        # The join needs the item's geometry, not its pixels.
        item = dataclasses.replace(plan.todo[t], pixels=_NO_PIXELS)
        embedding, receipt = worker.join.remote(item, *(unit_refs[uid] for uid in plan.unit_ids(t)))
        refs[item.content_hash] = embedding
        return receipt

    retried = run_with_retries(joins, workers, pool, max_attempts=max_attempts, launch=launch,
                     on_done=lambda w, t, receipt: None, what="join")
    for item in plan.todo:
        cache.put(item.content_hash, refs[item.content_hash], adapter.embedding_nbytes(item))
    return [EncodedVisual(refs[item.content_hash], item.num_tokens, item.grid, item.content_hash,
                          item.content_hash in plan.hits) for item in plan.items], retried


def join_worker(uids: list[UnitId], holders: dict[UnitId, int], plan: Plan, adapter: VisionAdapter) -> int:
    """The worker holding the most bytes of these units (the first such, on a tie)."""
    held: collections.Counter[int] = collections.Counter()
    for uid in uids:
        held[holders[uid]] += adapter.embedding_nbytes(plan.unit(uid))
    return max(held, key=lambda w: (held[w], -w))


_NO_PIXELS = np.zeros((0, 0, 3), np.uint8)
