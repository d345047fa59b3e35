"""Shard a batch of images over encoder workers, gather per-image embeddings in input order.

Flow of `submit`: geometry per image (adapter) -> cache lookup by content hash, and duplicates
inside the batch encoded once -> units of work and their costs (adapter: a whole image, or an
image's slices or views) -> partition over the ready workers (greedy plus an improvement pass,
`partition.py`) -> one `ray.put` per shard and one task per non-empty shard, returning one object
per unit -> an image cut into several units gets one small task that concatenates them (units of
one image may sit on different workers) -> wait for the small receipts only (each shard's measured
time feeds the `calibrated` cost model, `calibration.py`); a shard whose worker died is re-run on a
live worker while a replacement actor is started. Embeddings never pass through this process:
callers get `ObjectRef`s in input order.

A replacement gets no shard until it has loaded its weights (its first `ping` answered): until
then the balancer sees only the ready workers. `check_workers` pings every worker on its own
thread (never queued behind encode calls) and replaces the dead ones, so a service can repair
itself before any request meets a dead worker.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence

import ray
import torch
from ray.exceptions import ActorUnavailableError, RayActorError

from raypipe.encode.cache import EmbeddingCache
from raypipe.encode.calibration import CalibratedCosts
from raypipe.models.base import VisionAdapter, VisionItem, check_cost_model
from raypipe.encode.partition import partition
from raypipe.inputs.media import DecodedVisual

log = logging.getLogger(__name__)
WORKER_LOST = (RayActorError, ActorUnavailableError)


@dataclasses.dataclass(slots=True)
class EncodedVisual:
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
                 cache_bytes: int = 0,  # none unless given: the size's default is ModelConfig.cache_bytes
                 worker_factory: Callable[[], object] | None = None,
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
        self.pixel_bytes_received = 0  # image bytes handed to submit(): what callers shipped here
        self._loading: dict[int, ray.ObjectRef] = {}  # worker index -> first ping of a replacement
        # Fitted from every shard's measured time, whatever the cost model (stats show the fit);
        # only `calibrated` balances with it. Keyed by the workers' device kind, from their receipts.
        self.calibration = CalibratedCosts()
        self.device_kind = "unknown"
        self._lock = threading.Lock()

    def encode(self, images: Sequence[DecodedVisual]) -> list:
        """Per-image embedding tensors in input order (fetches them into this process)."""
        return ray.get([encoded.ref for encoded in self.submit(images)])

    def submit(self, images: Sequence[DecodedVisual]) -> list[EncodedVisual]:
        items = [self.adapter.make_item(image) for image in images]
        self.pixel_bytes_received += sum(image.pixels.nbytes for image in images)
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

        # Units of work: each item's units (an image; a MiniCPM-V overview and slices; Step3's crops
        # and global view). The balancer places atoms: single units where the adapter splits items,
        # else whole items.
        units = [self.adapter.units(item) for item in todo]
        atoms = ([[(t, u)] for t, item_units in enumerate(units) for u in range(len(item_units))]
                 if self.split_units else [[(t, u) for u in range(len(item_units))]
                                           for t, item_units in enumerate(units)])
        patches = {(t, u): self.adapter.cost(unit, "patches") for t, us in enumerate(units) for u, unit in enumerate(us)}
        prior = {(t, u): self.adapter.cost(unit, "attention") for t, us in enumerate(units) for u, unit in enumerate(us)}
        if self.cost_model == "calibrated":
            keys = list(patches)
            fitted = self.calibration.for_device(self.device_kind).unit_costs([patches[k] for k in keys],
                                                                               [prior[k] for k in keys])
            unit_cost = dict(zip(keys, fitted))
        else:
            unit_cost = patches if self.cost_model == "patches" else prior
        sizes = [sum(unit_cost[key] for key in atom) for atom in atoms]
        ready = self._wait_ready() if todo else list(range(len(self.workers)))
        with self._lock:  # concurrent calls (a Serve replica) see each other's work in flight
            workers = list(self.workers)
            # Greedy plus local search over the ready workers: never a worse makespan than vLLM's
            # greedy (see partition.py).
            ready_shards, ready_loads = partition(sizes, len(ready), [self.inflight_loads[i] for i in ready])
            loads = [0.0] * len(workers)
            shards: list[list[tuple[int, int]]] = [[] for _ in workers]
            for i, atom_shard, load in zip(ready, ready_shards, ready_loads):
                shards[i], loads[i] = [key for a in atom_shard for key in atoms[a]], load
            self.inflight_loads = [a + b for a, b in zip(self.inflight_loads, loads)]
        unit_refs: dict[tuple[int, int], ray.ObjectRef] = {}
        try:
            retried = self._run_shards(units, shards, workers, unit_refs, (patches, prior))
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
        return [EncodedVisual(refs[item.content_hash], item.num_tokens, item.grid, item.content_hash,
                             item.content_hash in cached_keys) for item in items]

    def _run_shards(self, units: list[list[VisionItem]], shards: list[list[tuple[int, int]]], workers: list,
                    refs: dict, unit_costs: tuple[dict, dict]) -> int:
        pending = {}  # receipt ref -> (worker index, shard, attempt)
        for w, shard in enumerate(shards):
            if shard:
                pending[self._launch(workers[w], units, shard, refs)] = (w, shard, 1)
        retried = 0
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            w, shard, attempt = pending.pop(ready[0])
            try:
                receipt = ray.get(ready[0])
            except WORKER_LOST as exc:
                if attempt >= self.max_shard_attempts:
                    raise
                log.warning("encoder worker %d lost (%s); re-running its %d units", w, type(exc).__name__, len(shard))
                retry_on = self._replace_and_pick(workers[w], w)
                retried += 1
                pending[self._launch(self.workers[retry_on], units, shard, refs)] = (retry_on, shard, attempt + 1)
                continue
            self._calibrate(receipt, shard, *unit_costs)
        return retried

    def _calibrate(self, receipt: dict, shard: list[tuple[int, int]], patches: dict, prior: dict) -> None:
        self.device_kind = receipt.get("device", self.device_kind)
        self.calibration.for_device(self.device_kind).observe(
            [patches[key] for key in shard], [prior[key] for key in shard], receipt["seconds"])

    def _launch(self, worker, units: list[list[VisionItem]], shard: list[tuple[int, int]], refs: dict) -> ray.ObjectRef:
        payload = ray.put([units[t][u] for t, u in shard])  # exactly this worker's shard, once
        out = worker.encode.options(num_returns=len(shard) + 1).remote(payload)
        for key, ref in zip(shard, out[:-1]):
            refs[key] = ref
        return out[-1]

    def _replace_and_pick(self, dead, dead_index: int) -> int:
        """Swap a replacement in for `dead` (if we can build one) and return a worker index to retry on."""
        with self._lock:
            self._replace(dead, dead_index)
            # Prefer a ready worker: the replacement still has to load weights.
            others = [i for i in self._ready_locked() if i != dead_index]
            return others[0] if others else dead_index

    def _replace(self, dead, index: int) -> None:
        """Start a replacement for `dead` at `index` unless that already happened (call under the lock)."""
        if self.workers[index] is dead and self.worker_factory is not None:
            log.warning("replacing encoder worker %d", index)
            self.workers[index] = self.worker_factory()
            self._loading[index] = self.workers[index].ping.remote()
            self.workers_replaced += 1

    def _ready_locked(self) -> list[int]:
        """Indices of workers that have loaded their weights (call under the lock)."""
        if self._loading:
            done, _ = ray.wait(list(self._loading.values()), num_returns=len(self._loading), timeout=0)
            for index in [i for i, ref in self._loading.items() if ref in done]:
                del self._loading[index]  # a replacement that died loading fails its first shard: retried
        return [i for i in range(len(self.workers)) if i not in self._loading]

    def _wait_ready(self) -> list[int]:
        """Ready worker indices, waiting for a replacement to load if none is ready."""
        while True:
            with self._lock:
                ready, loading = self._ready_locked(), list(self._loading.values())
            if ready:
                return ready
            ray.wait(loading, num_returns=1)

    def check_workers(self, timeout_s: float = 5.0) -> dict:
        """Ping every worker (on its health thread); replace the dead. Loading replacements are not alive yet."""
        with self._lock:
            workers, ready = list(self.workers), set(self._ready_locked())
        pings = {index: workers[index].ping.remote() for index in ready}
        answered, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=timeout_s)
        alive = 0
        for index, ref in pings.items():
            if ref not in answered:
                continue  # hung or overloaded host: not alive now, but not known dead either
            try:
                ray.get(ref)
                alive += 1
            except WORKER_LOST:
                with self._lock:
                    self._replace(workers[index], index)
        with self._lock:
            loading = len(self._loading)
        return {"workers": len(workers), "alive": alive, "loading": loading}

    def stats(self) -> dict:
        with self._lock:
            loads = list(self.total_loads)
        report = self.last_report
        return {"workers": len(self.workers), "cost_model": self.cost_model, "cache": self.cache.stats(),
                "worker_total_load": loads, "total_imbalance": imbalance(loads),
                "last_call_loads": report.loads if report else [], "last_call_imbalance":
                report.imbalance if report else 1.0, "workers_replaced": self.workers_replaced,
                "workers_loading": len(self._loading), "pixel_bytes_received": self.pixel_bytes_received,
                "cost_fit": self.calibration.stats()}


@ray.remote(num_cpus=0)
def _concat(*parts):
    """An item's embedding from its units' embeddings (adapters order units for exactly this)."""
    return torch.cat(parts)
