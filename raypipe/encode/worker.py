"""`EncoderWorker`: one vision-tower replica on one device, encoding the shards it is sent.

A worker neither balances nor reorders; it returns one Ray object per item (exact size, no
padding) plus a small receipt, so the coordinator can detect failures without fetching embeddings.

On a CPU the workers share cores with the decode engine, and they yield to it (`CPU_NICE`): a
decode step advances every running request, an encode only the one request waiting for it. Under
`raypipe bench serve` load this gave ~10% more requests/s and a shorter time to first token.

A shard runs in forwards of fixed token budgets where the tower supports them and budgets are on
(`budgets.py`, `budget_forwards.py`: metadata prepared outside the forward, compiled forwards or CUDA
graphs per budget). Otherwise it is encoded eagerly in forwards of at most `MAX_PATCHES_PER_FORWARD`
patches each, so activation memory follows that bound, not the shard's size (units themselves are
bounded: images by the processor's pixel limit, video chunks by their size).

Units of a request served with a LoRA adapter on the tower arrive with it (`tower_lora.py`): they run in
eager forwards of their own, the adapter applied for those forwards only.

An item encoded as several units (slices, crops, tiles, video chunks) is joined here too (`join`),
on a thread of its own: the process has torch loaded already (a task would start a fresh worker
process when Ray has none idle, seconds of imports on a request's path), and a join never waits
behind the next shard's encode.
"""

from __future__ import annotations

import os
import threading
import time

import ray
import torch

from raypipe.encode.budget_forwards import BudgetedForwards
from raypipe.encode.budgets import TokenBudgets
from raypipe.encode.tower_lora import TowerAdapters, TowerLora
from raypipe.models import packed_linear
from raypipe.models.base import VisionItem
from raypipe.models.registry import vision_adapter
from raypipe.runtime.device import pick_device, resolve_dtype

JOIN_THREADS = 2  # joins run at once per worker (each is a copy of its item's rows: milliseconds)
CPU_NICE = 10  # added to a CPU worker's niceness (lower scheduling priority; never needs privileges)
MAX_PATCHES_PER_FORWARD = 65536  # ~16 of Qwen2.5-VL's largest images, or 64 448x448 frame groups


def yield_cpu(num_threads: int | None) -> None:
    """Set up a CPU encoder's process: it yields to the decode engine (`CPU_NICE`) and runs `num_threads` torch
    threads (None: torch's default)."""
    os.nice(CPU_NICE)
    if num_threads:
        torch.set_num_threads(num_threads)


def load_tower(adapter, device: torch.device, dtype: torch.dtype):
    """`adapter`'s vision tower as an encoder runs it (its linears computed in fp32 where that is faster on this CPU,
    `packed_linear.fp32_where_faster`), and what was done to its linears."""
    tower = adapter.load_tower(device, dtype)
    return tower, packed_linear.fp32_where_faster(tower.lora_root, device, dtype)


class EncoderWorker:
    def __init__(self, checkpoint: str, *, dtype: str = "auto", num_threads: int | None = None,
                 budgets: TokenBudgets = TokenBudgets()):
        self.device = pick_device()
        if self.device.type == "cpu":
            yield_cpu(num_threads)
        self.dtype = resolve_dtype(dtype, self.device)
        self.adapter = vision_adapter(checkpoint)
        self.tower, self.linears = load_tower(self.adapter, self.device, self.dtype)
        self.budgeted = BudgetedForwards.for_tower(self.tower, budgets)  # None: eager forwards
        self.tower_loras: TowerAdapters | None = None  # made when a unit first brings a tower adapter
        self.items_encoded = 0
        self.items_joined = 0
        self._join_count_lock = threading.Lock()  # joins run on JOIN_THREADS threads
        # The coordinator's cost calibration is kept per device kind.
        self.device_kind = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"

    # Its own thread ("health" group), so a liveness probe never queues behind encode calls.
    @ray.method(concurrency_group="health")
    def ping(self) -> int:
        return os.getpid()

    def info(self) -> dict:
        return {"pid": os.getpid(), "device": str(self.device), "dtype": str(self.dtype),
                "threads": torch.get_num_threads(), "linears": self.linears, "node": ray.get_runtime_context().get_node_id(),
                "items_encoded": self.items_encoded, "items_joined": self.items_joined,
                "tower_loras_fetched": self.tower_loras.fetched if self.tower_loras else 0,
                "budgets": self.budgeted.stats if self.budgeted else None}

    def encode(self, items: list[VisionItem], loras: list[TowerLora | None] | None = None):
        """Returns `(*embeddings, receipt)`: call with `num_returns=len(items) + 1`. `loras[i]`: the tower adapter
        item i is encoded with (None: the base tower); the items of each adapter run in forwards of their own."""
        start = time.perf_counter()
        loras = loras or [None] * len(items)
        embeddings: list[torch.Tensor | None] = [None] * len(items)
        by_adapter: dict[str | None, list[int]] = {}  # fingerprint -> its items, in order of first use
        for i, lora in enumerate(loras):
            by_adapter.setdefault(lora and lora.fingerprint, []).append(i)
        for picked in by_adapter.values():
            for i, embedding in zip(picked, self._encode([items[i] for i in picked], loras[picked[0]])):
                embeddings[i] = embedding
        self.items_encoded += len(items)
        receipt = {"pid": os.getpid(), "items": len(items), "seconds": time.perf_counter() - start,
                   "device": self.device_kind}
        return (*embeddings, receipt)

    def _encode(self, items: list[VisionItem], lora: TowerLora | None) -> list[torch.Tensor]:
        if lora is None:
            return self.budgeted.encode(items) if self.budgeted else self._eager(items)
        with self._tower_adapters().applied(lora):  # eager: budgeted forwards compiled / captured the base weights
            return self._eager(items)

    def _eager(self, items: list[VisionItem]) -> list[torch.Tensor]:
        return [e for group in self._forward_groups(items) for e in self.tower.encode(group)]

    def check_tower_lora(self, lora: TowerLora, where: str | None = None) -> None:
        """Fetch `lora` and check it against this tower (`InvalidInput` naming `where` and the module that does not
        fit)."""
        self._tower_adapters().factors(lora, where)

    def _tower_adapters(self) -> TowerAdapters:
        if self.tower_loras is None:  # only families with `lora_tower_prefixes` get here: their towers have a root
            self.tower_loras = TowerAdapters(self.tower.lora_root, self.device, self.dtype)
        return self.tower_loras

    @ray.method(concurrency_group="join", num_returns=2)
    def join(self, item: VisionItem, *parts: torch.Tensor):
        """`(item's embedding, receipt)` from its units' embeddings (`VisionAdapter.join_units`); Ray
        resolves the unit refs into this process, so only the units held by other workers move."""
        joined = self.adapter.join_units(item, list(parts))
        with self._join_count_lock:
            self.items_joined += 1
        return joined, {"pid": os.getpid()}

    def _forward_groups(self, items: list[VisionItem]) -> list[list[VisionItem]]:
        """Eager forwards: consecutive runs of `items` of at most `MAX_PATCHES_PER_FORWARD` patches (one item at least)."""
        groups: list[list[VisionItem]] = []
        patches = 0.0
        for item in items:
            size = self.adapter.cost(item, "patches")
            if not groups or patches + size > MAX_PATCHES_PER_FORWARD:
                groups.append([])
                patches = 0.0
            groups[-1].append(item)
            patches += size
        return groups

    def encode_timed(self, items: list[VisionItem], repeats: int = 3) -> list[float]:
        """Median seconds to encode each item alone (benchmarks measure real per-item cost).

        Round robin over the items, `repeats` times: a slow phase of a shared machine then slows
        every item alike instead of inflating whichever item it happened to hit."""
        samples: list[list[float]] = [[] for _ in items]
        for _ in range(repeats):
            for item, item_samples in zip(items, samples):
                start = time.perf_counter()
                self.tower.encode([item])
                item_samples.append(time.perf_counter() - start)
        return [sorted(s)[len(s) // 2] for s in samples]


# encode() and info() keep the default group (one at a time); ping() and join() have threads of their own.
RemoteEncoderWorker = ray.remote(concurrency_groups={"health": 1, "join": JOIN_THREADS})(EncoderWorker)
