"""Calls on the pool's worker actors that are re-run on a live worker when theirs died.

Shards (`dispatch.py`) and joins (`assemble.py`) are both such calls: each is launched on a chosen
worker and answers with a small receipt, and only receipts are fetched here (embeddings stay in the
object store). A call whose worker died is launched again on the worker the pool names
(`EncoderPool.retry_target`: a ready one, while it starts a replacement); after `max_attempts`
the error is raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import ray

from raypipe.encode.pool import WORKER_LOST, EncoderPool

log = logging.getLogger(__name__)
Job = TypeVar("Job")


def run_with_retries(jobs: Sequence[tuple[int, Job]], workers: list, pool: EncoderPool, *, max_attempts: int,
                     launch: Callable[[Any, Job], ray.ObjectRef], on_done: Callable[[int, Job, Any], None],
                     what: str) -> int:
    """Run each `(worker index, job)`: `launch(actor, job)` sends it and returns its receipt's ref;
    `on_done(worker index, job, receipt)` sees each receipt of a call that succeeded. `workers` is
    the pool's actors the jobs were placed on. Returns how many calls were re-run."""
    pending = {}  # receipt ref -> (actor, worker index, job, attempt)
    for w, job in jobs:
        pending[launch(workers[w], job)] = (workers[w], w, job, 1)
    retried = 0
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        actor, w, job, attempt = pending.pop(ready[0])
        try:
            receipt = ray.get(ready[0])
        except WORKER_LOST as exc:
            if attempt >= max_attempts:
                raise
            log.warning("encoder worker %d lost (%s); re-running its %s", w, type(exc).__name__, what)
            retry_on = pool.retry_target(actor, w)
            retried += 1
            target = pool.worker(retry_on)
            pending[launch(target, job)] = (target, retry_on, job, attempt + 1)
            continue
        on_done(w, job, receipt)
    return retried
