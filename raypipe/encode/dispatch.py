"""Running placed shards on the workers, re-running a shard whose worker died.

One `ray.put` per shard (exactly that worker's units) and one task per non-empty shard, returning
one object per unit plus a small receipt. Only receipts are fetched here, so embeddings never
pass through this process. A shard whose worker died goes to a live worker while the pool starts
a replacement (`worker_calls.py`); after `max_attempts` the error is raised.
"""

from __future__ import annotations

from collections.abc import Callable

import ray

from raypipe.encode.plan import Plan, UnitId
from raypipe.encode.pool import EncoderPool
from raypipe.encode.worker_calls import run_with_retries


def dispatch(plan: Plan, shards: list[list[UnitId]], workers: list, pool: EncoderPool, *, max_attempts: int,
             on_receipt: Callable[[dict, list[UnitId]], None]
             ) -> tuple[dict[UnitId, ray.ObjectRef], dict[UnitId, int], int]:
    """`(unit refs, the worker index each unit was encoded on, shards retried)`; `workers` is the
    pool's actors the shards were placed on."""
    refs: dict[UnitId, ray.ObjectRef] = {}
    holders: dict[UnitId, int] = {}

    def launch(worker, shard: list[UnitId]) -> ray.ObjectRef:
        payload = ray.put([plan.unit(uid) for uid in shard])  # exactly this worker's shard, once
        loras = [plan.todo_loras[uid.item] for uid in shard]  # each unit's tower adapter (refs, not factors)
        out = worker.encode.options(num_returns=len(shard) + 1).remote(payload, loras if any(loras) else None)
        refs.update(zip(shard, out[:-1]))
        return out[-1]

    def done(w: int, shard: list[UnitId], receipt: dict) -> None:
        holders.update(dict.fromkeys(shard, w))
        on_receipt(receipt, shard)

    retried = run_with_retries([(w, shard) for w, shard in enumerate(shards) if shard], workers, pool,
                               max_attempts=max_attempts, launch=launch, on_done=done, what="shard")
    return refs, holders, retried
