"""Shard a batch of images over encoder workers, gather per-image embeddings in input order.

`submit` is four steps: `plan` (cache lookup by content hash, duplicates inside the batch encoded
once, units of work and their costs; `plan.py`) -> `place` over the ready workers (greedy plus an
improvement pass, `partition.py`) -> `dispatch` (one task per shard, a shard whose worker died
re-run on a live one; `dispatch.py`) -> `assemble` (an image's units joined on the worker holding
most of them, the cache filled; `assemble.py`). Each shard's measured time feeds the `calibrated` cost model
(`calibration.py`). Embeddings never pass through this process: callers get `ObjectRef`s in
input order.

The workers themselves (starting, readiness, replacement, health checks) belong to the
`EncoderPool`; the coordinator places work only on the workers it reports ready.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import ray

from raypipe.encode.assemble import EncodedVisual, assemble
from raypipe.encode.cache import EmbeddingCache
from raypipe.encode.calibration import CalibratedCosts
from raypipe.encode.dispatch import dispatch
from raypipe.encode.plan import Plan, UnitId, place, plan
from raypipe.encode.pool import EncoderPool
from raypipe.encode.tower_lora import TowerLora, cache_key
from raypipe.inputs.media import DecodedVisual
from raypipe.models.base import VisionAdapter, check_cost_model


@dataclasses.dataclass(slots=True)
class EncodeReport:
    """What the last `submit` did: which input indices each worker got, and their loads."""

    assignment: list[list[int]]
    loads: list[float]
    cache_hits: int
    retried_shards: int
    retried_joins: int  # items of several units whose join was re-run (its worker died)

    @property
    def imbalance(self) -> float:
        return imbalance(self.loads)


def imbalance(loads: Sequence[float]) -> float:
    """Max worker load over mean worker load: 1.0 is perfectly even (and the value for no load)."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean else 1.0


class Coordinator:
    def __init__(self, adapter: VisionAdapter, pool: EncoderPool, *, cost_model: str = "patches",
                 cache_bytes: int = 0,  # none unless given: the size's default is ModelConfig.cache_bytes
                 max_shard_attempts: int = 3, split_units: bool | None = None):
        check_cost_model(cost_model)  # at start-up, not on the first batch
        self.adapter = adapter
        # Balance units (slices) rather than whole items; the adapter's measured default unless given.
        self.split_units = adapter.split_units if split_units is None else split_units
        self.pool = pool
        self.cost_model = cost_model
        self.cache = EmbeddingCache(cache_bytes)
        self.max_shard_attempts = max_shard_attempts
        self.last_report: EncodeReport | None = None
        self.total_loads = [0.0] * len(pool)
        self.inflight_loads = [0.0] * len(pool)
        self.pixel_bytes_received = 0  # image bytes handed to submit(): what callers shipped here
        # Fitted from every shard's measured time, whatever the cost model (stats show the fit);
        # only `calibrated` balances with it. Keyed by the workers' device kind, from their receipts.
        self.calibration = CalibratedCosts()
        self.device_kind = "unknown"
        self._lock = threading.Lock()  # the load counters: concurrent calls (a Serve replica)

    @property
    def workers(self) -> list:
        return self.pool.workers

    @property
    def workers_replaced(self) -> int:
        return self.pool.replaced

    def check_workers(self, timeout_s: float = 5.0) -> dict:
        """The pool's health check: ping every ready worker, replace the dead."""
        return self.pool.check(timeout_s)

    def encode(self, images: Sequence[DecodedVisual]) -> list:
        """Per-image embedding tensors in input order (fetches them into this process)."""
        return ray.get([encoded.ref for encoded in self.submit(images)])

    def submit(self, images: Sequence[DecodedVisual], loras: Sequence[TowerLora | None] = ()) -> list[EncodedVisual]:
        """`loras[i]`: the LoRA adapter image i is encoded with, where its request's adapter targets the tower
        (none given: the base tower for all); an item's content hash then names the adapter too."""
        loras = list(loras) or [None] * len(images)
        items = [self.adapter.make_item(image) for image in images]
        items = [item if lora is None else dataclasses.replace(item, content_hash=cache_key(item.content_hash, lora))
                 for item, lora in zip(items, loras)]
        self.pixel_bytes_received += sum(image.pixels.nbytes for image in images)
        work = plan(items, self.adapter, self.cache, split_units=self.split_units, loras=loras)
        unit_cost = self._unit_costs(work)
        ready = self.pool.wait_ready() if work.todo else list(range(len(self.pool)))
        with self._lock:  # concurrent calls see each other's work in flight
            workers = self.pool.workers
            shards, loads = place(work, unit_cost, ready, self.inflight_loads)
            self.inflight_loads = [a + b for a, b in zip(self.inflight_loads, loads)]
        try:
            unit_refs, holders, retried = dispatch(
                work, shards, workers, self.pool, max_attempts=self.max_shard_attempts,
                on_receipt=lambda receipt, shard: self._calibrate(work, receipt, shard))
        finally:
            with self._lock:
                self.inflight_loads = [a - b for a, b in zip(self.inflight_loads, loads)]
        encoded, retried_joins = assemble(work, unit_refs, holders, workers, self.pool, self.cache, self.adapter,
                           max_attempts=self.max_shard_attempts)
        with self._lock:
            self.total_loads = [a + b for a, b in zip(self.total_loads, loads)]
        self.last_report = _report(work, shards, loads, retried, retried_joins)
        return encoded

    def _unit_costs(self, work: Plan) -> dict[UnitId, float]:
        """Each unit's cost under the coordinator's cost model."""
        if self.cost_model == "calibrated":
            keys = list(work.patches)
            fitted = self.calibration.for_device(self.device_kind).unit_costs(
                [work.patches[k] for k in keys], [work.prior[k] for k in keys])
            return dict(zip(keys, fitted))
        return work.patches if self.cost_model == "patches" else work.prior

    def _calibrate(self, work: Plan, receipt: dict, shard: list[UnitId]) -> None:
        self.device_kind = receipt.get("device", self.device_kind)
        self.calibration.for_device(self.device_kind).observe(
            [work.patches[uid] for uid in shard], [work.prior[uid] for uid in shard], receipt["seconds"])

    def stats(self) -> dict:
        with self._lock:
            loads = list(self.total_loads)
        report = self.last_report
        return {"workers": len(self.pool), "cost_model": self.cost_model, "cache": self.cache.stats(),
                "worker_total_load": loads, "total_imbalance": imbalance(loads),
                "last_call_loads": report.loads if report else [], "last_call_imbalance":
                report.imbalance if report else 1.0, "workers_replaced": self.pool.replaced,
                "workers_loading": self.pool.loading, "pixel_bytes_received": self.pixel_bytes_received,
                "cost_fit": self.calibration.stats()}


def _report(work: Plan, shards: list[list[UnitId]], loads: list[float], retried: int, retried_joins: int
            ) -> EncodeReport:
    return EncodeReport(
        assignment=[list(dict.fromkeys(i for uid in shard for i in work.todo_inputs[uid.item])) for shard in shards],
        loads=list(loads), cache_hits=sum(1 for item in work.items if item.content_hash in work.hits),
        retried_shards=retried, retried_joins=retried_joins)
