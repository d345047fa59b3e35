"""Shard a batch of images over encoder workers, gather per-image embeddings in input order.

Flow of `submit`: geometry per image (adapter) -> cache lookup by content hash, and duplicates
inside the batch encoded once -> units of work and their costs (adapter: a whole image, or an
image's slices) -> balancer over the live workers -> one `ray.put` per shard and one task per
non-empty shard, returning one object per unit -> an image cut into several units gets one small
task that concatenates them (units of one image may sit on different workers) -> wait for the small
receipts only; a shard whose worker died is re-run on a live worker while a replacement actor is
started. Embeddings never pass through this process: callers get `ObjectRef`s in input order.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence

import ray
import torch
from ray.exceptions import ActorUnavailableError, RayActorError

from raypipe.balance import get_load_balance_assignment, split_by_counts
from raypipe.cache import EmbeddingCache
from raypipe.models.base import VisionAdapter, VisionItem, check_cost_model
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
                 max_shard_attempts: int = 3, split_units: bool | None = None):
        if not workers:
            raise ValueError("Coordinator needs at least one encoder worker")
        check_cost_model(cost_model)  # at start-up, not on the first batch
        self.adapter = adapter
        # Balance units (slices) rather than whole items; the adapter's measured default unless given.
        self.split_units = adapter.split_units if split_units is None else split_units
        self.workers = list(workers)
        self.cost_model = cost_model
        self.cache = EmbeddingCache(cache_bytes)
        self.worker_factory = worker_factory
        self.max_shard_attempts = max_shard_attempts
        self.last_report: EncodeReport | None = None
        self.total_loads = [0.0] * len(self.workers)
        self.inflight_loads = [0.0] * len(self.workers)
        self.workers_replaced = 0
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

        # Units of work: each item's units (an image, or a MiniCPM-V overview and slices); the
        # balancer places atoms: single units where the adapter splits items, else whole items.
        units = [self.adapter.units(item) for item in todo]
        atoms = ([[(t, u)] for t, item_units in enumerate(units) for u in range(len(item_units))]
                 if self.split_units else [[(t, u) for u in range(len(item_units))]
                                                   for t, item_units in enumerate(units)])
        sizes = [sum(self.adapter.cost(units[t][u], self.cost_model) for t, u in atom) for atom in atoms]
        with self._lock:  # concurrent calls (a Serve replica) see each other's work in flight
            workers = list(self.workers)
            order, counts, loads = get_load_balance_assignment(sizes, len(workers), self.inflight_loads)
            self.inflight_loads = [a + b for a, b in zip(self.inflight_loads, loads)]
        shards = [[unit for a in atom_shard for unit in atoms[a]] for atom_shard in split_by_counts(order, counts)]
        unit_refs: dict[tuple[int, int], ray.ObjectRef] = {}
        try:
            retried = self._run_shards(units, shards, workers, unit_refs)
        finally:
            with self._lock:
                self.inflight_loads = [a - b for a, b in zip(self.inflight_loads, loads)]

        for t, item in enumerate(todo):
            parts = [unit_refs[(t, u)] for u in range(len(units[t]))]
            refs[item.content_hash] = parts[0] if len(parts) == 1 else _concat.remote(*parts)
            self.cache.put(item.content_hash, refs[item.content_hash], self.adapter.embedding_nbytes(item))
        with self._lock:
            self.total_loads = [a + b for a, b in zip(self.total_loads, loads)]
        self.last_report = EncodeReport(
            assignment=[list(dict.fromkeys(i for t, _ in shard for i in todo_inputs[t])) for shard in shards],
            loads=list(loads), cache_hits=sum(1 for item in items if item.content_hash in cached_keys),
            retried_shards=retried)
        return [EncodedImage(refs[item.content_hash], item.num_tokens, item.grid, item.content_hash,
                             item.content_hash in cached_keys) for item in items]

    def _run_shards(self, units: list[list[VisionItem]], shards: list[list[tuple[int, int]]], workers: list,
                    refs: dict) -> int:
        pending = {}  # receipt ref -> (worker index, shard, attempt)
        for w, shard in enumerate(shards):
            if shard:
                pending[self._launch(workers[w], units, shard, refs)] = (w, shard, 1)
        retried = 0
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            w, shard, attempt = pending.pop(ready[0])
            try:
                ray.get(ready[0])
            except WORKER_LOST as exc:
                if attempt >= self.max_shard_attempts:
                    raise
                log.warning("encoder worker %d lost (%s); re-running its %d units", w, type(exc).__name__, len(shard))
                retry_on = self._replace_and_pick(workers[w], w)
                retried += 1
                pending[self._launch(self.workers[retry_on], units, shard, refs)] = (retry_on, shard, attempt + 1)
        return retried

    def _launch(self, worker, units: list[list[VisionItem]], shard: list[tuple[int, int]], refs: dict) -> ray.ObjectRef:
        payload = ray.put([units[t][u] for t, u in shard])  # exactly this worker's shard, once
        out = worker.encode.options(num_returns=len(shard) + 1).remote(payload)
        for key, ref in zip(shard, out[:-1]):
            refs[key] = ref
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
                report.imbalance if report else 1.0, "workers_replaced": self.workers_replaced}


@ray.remote(num_cpus=0)
def _concat(*parts):
    """An item's embedding from its units' embeddings (adapters order units for exactly this)."""
    return torch.cat(parts)
