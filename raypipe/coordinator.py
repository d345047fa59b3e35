"""Shard a batch of images over encoder workers, gather per-image embeddings in input order.

Flow of `submit`: geometry and cost per image (adapter) -> cache lookup by content hash, and
duplicates inside the batch encoded once -> partition over the live workers (greedy plus an
improvement pass, `partition.py`) -> one `ray.put` per shard and one task per non-empty shard,
returning one object per item -> wait for the small receipts only (each shard's measured time
feeds the `calibrated` cost model, `calibration.py`); a shard whose worker died is re-run on a
live worker while a replacement actor is started. Embeddings never pass through this process: callers get `ObjectRef`s in input order.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from raypipe.cache import EmbeddingCache
from raypipe.calibration import CalibratedCosts
from raypipe.models.base import VisionAdapter, VisionItem, check_cost_model
from raypipe.partition import partition
from raypipe.preprocess import DecodedImage

log = logging.getLogger(__name__)
WORKER_LOST = (RayActorError, ActorUnavailableError)


@dataclasses.dataclass(slots=True)
class EncodedImage:
    ref: ray.ObjectRef  # resolves to a (num_tokens, hidden) CPU tensor
    num_tokens: int
    grid: tuple[int, ...]
    content_hash: str
    cached: bool


@dataclasses.dataclass(slots=True)
class EncodeReport:
    """What the last `submit` did: which input indices each worker got, and their loads."""

    assignment: list[list[int]]
    loads: list[float]
    cache_hits: int
    retried_shards: int

    @property
    def imbalance(self) -> float:
        return imbalance(self.loads)


def imbalance(loads: Sequence[float]) -> float:
    """Max worker load over mean worker load: 1.0 is perfectly even (and the value for no load)."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean else 1.0


class Coordinator:
    def __init__(self, adapter: VisionAdapter, workers: Sequence, *, cost_model: str = "patches",
                 cache_bytes: int = 256 * 1024 * 1024, worker_factory: Callable[[], object] | None = None,
                 max_shard_attempts: int = 3):
        if not workers:
            raise ValueError("Coordinator needs at least one encoder worker")
        check_cost_model(cost_model)  # at start-up, not on the first batch
        self.adapter = adapter
        self.workers = list(workers)
        self.cost_model = cost_model
        self.cache = EmbeddingCache(cache_bytes)
        self.worker_factory = worker_factory
        self.max_shard_attempts = max_shard_attempts
        self.last_report: EncodeReport | None = None
        self.total_loads = [0.0] * len(self.workers)
        self.inflight_loads = [0.0] * len(self.workers)
        self.workers_replaced = 0
        # Fitted from every shard's measured time, whatever the cost model (stats show the fit);
        # only `calibrated` balances with it. Keyed by the workers' device kind, from their receipts.
        self.calibration = CalibratedCosts()
        self.device_kind = "unknown"
        self._lock = threading.Lock()

    def encode(self, images: Sequence[DecodedImage]) -> list:
        """Per-image embedding tensors in input order (fetches them into this process)."""
        return ray.get([encoded.ref for encoded in self.submit(images)])

    def submit(self, images: Sequence[DecodedImage]) -> list[EncodedImage]:
        items = [self.adapter.make_item(image) for image in images]
        refs: dict[str, ray.ObjectRef] = {}
        cached_keys: set[str] = set()
        todo: list[VisionItem] = []  # unique misses, in order of first occurrence
        todo_index: dict[str, int] = {}
        todo_inputs: list[list[int]] = []  # input indices served by each todo item
        for index, item in enumerate(items):
            key = item.content_hash
            if key in todo_index:
                todo_inputs[todo_index[key]].append(index)
            elif key not in cached_keys:
                hit = self.cache.get(key)
                if hit is not None:
                    refs[key] = hit
                    cached_keys.add(key)
                else:
                    todo_index[key] = len(todo)
                    todo.append(item)
                    todo_inputs.append([index])

        patches = [self.adapter.cost(item, "patches") for item in todo]
        prior = [self.adapter.cost(item, "attention") for item in todo]
        if self.cost_model == "calibrated":
            sizes = self.calibration.for_device(self.device_kind).unit_costs(patches, prior)
        else:
            sizes = patches if self.cost_model == "patches" else prior
        with self._lock:  # concurrent calls (a Serve replica) see each other's work in flight
            workers = list(self.workers)
            # Greedy plus local search: never a worse makespan than vLLM's greedy (see partition.py).
            shards, loads = partition(sizes, len(workers), self.inflight_loads)
            self.inflight_loads = [a + b for a, b in zip(self.inflight_loads, loads)]
        try:
            retried = self._run_shards(todo, shards, workers, refs, (patches, prior))
        finally:
            with self._lock:
                self.inflight_loads = [a - b for a, b in zip(self.inflight_loads, loads)]

        for item in todo:
            self.cache.put(item.content_hash, refs[item.content_hash], self.adapter.embedding_nbytes(item))
        with self._lock:
            self.total_loads = [a + b for a, b in zip(self.total_loads, loads)]
        self.last_report = EncodeReport(
            assignment=[[i for t in shard for i in todo_inputs[t]] for shard in shards],
            loads=list(loads), cache_hits=sum(1 for item in items if item.content_hash in cached_keys),
            retried_shards=retried)
        return [EncodedImage(refs[item.content_hash], item.num_tokens, item.grid, item.content_hash,
                             item.content_hash in cached_keys) for item in items]

    def _run_shards(self, todo: list[VisionItem], shards: list[list[int]], workers: list,
                    refs: dict[str, ray.ObjectRef], unit_costs: tuple[list[float], list[float]]) -> int:
        pending = {}  # receipt ref -> (worker index, shard, attempt)
        for w, shard in enumerate(shards):
            if shard:
                pending[self._launch(workers[w], todo, shard, refs)] = (w, shard, 1)
        retried = 0
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            w, shard, attempt = pending.pop(ready[0])
            try:
                receipt = ray.get(ready[0])
            except WORKER_LOST as exc:
                if attempt >= self.max_shard_attempts:
                    raise
                log.warning("encoder worker %d lost (%s); re-running its %d items", w, type(exc).__name__, len(shard))
                retry_on = self._replace_and_pick(workers[w], w)
                retried += 1
                pending[self._launch(self.workers[retry_on], todo, shard, refs)] = (retry_on, shard, attempt + 1)
                continue
            self._calibrate(receipt, shard, *unit_costs)
        return retried

    def _calibrate(self, receipt: dict, shard: list[int], patches: list[float], prior: list[float]) -> None:
        self.device_kind = receipt.get("device", self.device_kind)
        self.calibration.for_device(self.device_kind).observe(
            [patches[t] for t in shard], [prior[t] for t in shard], receipt["seconds"])

    def _launch(self, worker, todo: list[VisionItem], shard: list[int], refs: dict) -> ray.ObjectRef:
        payload = ray.put([todo[t] for t in shard])  # exactly this worker's shard, once
        out = worker.encode.options(num_returns=len(shard) + 1).remote(payload)
        for t, ref in zip(shard, out[:-1]):
            refs[todo[t].content_hash] = ref
        return out[-1]

    def _replace_and_pick(self, dead, dead_index: int) -> int:
        """Swap a replacement in for `dead` (if we can build one) and return a worker index to retry on."""
        with self._lock:
            if self.workers[dead_index] is dead and self.worker_factory is not None:
                self.workers[dead_index] = self.worker_factory()
                self.workers_replaced += 1
            # Prefer a worker that has been alive all along: the replacement still has to load weights.
            others = [i for i in range(len(self.workers)) if i != dead_index]
            return others[0] if others else dead_index

    def stats(self) -> dict:
        with self._lock:
            loads = list(self.total_loads)
        report = self.last_report
        return {"workers": len(self.workers), "cost_model": self.cost_model, "cache": self.cache.stats(),
                "worker_total_load": loads, "total_imbalance": imbalance(loads),
                "last_call_loads": report.loads if report else [], "last_call_imbalance":
                report.imbalance if report else 1.0, "workers_replaced": self.workers_replaced,
                "cost_fit": self.calibration.stats()}
