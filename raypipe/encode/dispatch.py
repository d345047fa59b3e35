"""Running placed shards on the workers, re-running a shard whose worker died.

One `ray.put` per shard (exactly that worker's units) and one task per non-empty shard, returning
one object per unit plus a small receipt. Only receipts are fetched here, so embeddings never
pass through this process. A shard whose worker died goes to a live worker while the pool starts
a replacement; after `max_attempts` the error is raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import ray

from raypipe.encode.plan import Plan, UnitId
from raypipe.encode.pool import WORKER_LOST, EncoderPool

log = logging.getLogger(__name__)


def dispatch(plan: Plan, shards: list[list[UnitId]], workers: list, pool: EncoderPool, *, max_attempts: int,
             on_receipt: Callable[[dict, list[UnitId]], None]) -> tuple[dict[UnitId, ray.ObjectRef], int]:
    """`(unit refs, shards retried)`; `workers` is the pool's actors the shards were placed on."""
    refs: dict[UnitId, ray.ObjectRef] = {}
    pending = {}  # receipt ref -> (worker index, shard, attempt)
    for w, shard in enumerate(shards):
        if shard:
            pending[_launch(workers[w], plan, shard, refs)] = (w, shard, 1)
    retried = 0
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        w, shard, attempt = pending.pop(ready[0])
        try:
            receipt = ray.get(ready[0])
        except WORKER_LOST as exc:
            if attempt >= max_attempts:
                raise
            log.warning("encoder worker %d lost (%s); re-running its %d units", w, type(exc).__name__, len(shard))
            retry_on = pool.retry_target(workers[w], w)
            retried += 1
            pending[_launch(pool.worker(retry_on), plan, shard, refs)] = (retry_on, shard, attempt + 1)
            continue
        on_receipt(receipt, shard)
    return refs, retried


def _launch(worker, plan: Plan, shard: list[UnitId], refs: dict) -> ray.ObjectRef:
    """Send `shard` to `worker`; its unit refs go into `refs`, the receipt ref is returned."""
    payload = ray.put([plan.unit(uid) for uid in shard])  # exactly this worker's shard, once
    out = worker.encode.options(num_returns=len(shard) + 1).remote(payload)
    for uid, ref in zip(shard, out[:-1]):
        refs[uid] = ref
    return out[-1]
