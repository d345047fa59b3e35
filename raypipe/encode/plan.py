"""Planning a batch before any worker sees it: which images need encoding, cut into which units,
at what cost, and which worker gets each unit.

`plan` reads the cache and the adapter's geometry only (no task runs); `place` is the partition
over the ready workers. Units are named by `UnitId` (which todo item, which of its units), never
by a string, so nothing is ever parsed back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import ray

from raypipe.encode.cache import EmbeddingCache
from raypipe.encode.partition import partition
from raypipe.encode.tower_lora import TowerLora
from raypipe.models.base import VisionAdapter, VisionItem


@dataclasses.dataclass(frozen=True, slots=True)
class UnitId:
    """The `index`-th unit of `Plan.todo[item]`."""

    item: int
    index: int


@dataclasses.dataclass(slots=True)
class Plan:
    items: list[VisionItem]  # one per input image
    hits: dict[str, ray.ObjectRef]  # cached embeddings, by content hash
    todo: list[VisionItem]  # unique cache misses, in order of first occurrence
    todo_loras: list[TowerLora | None]  # the tower adapter each todo item is encoded with
    todo_inputs: list[list[int]]  # the input indices each todo item serves
    units: list[list[VisionItem]]  # each todo item's units, in concatenation order
    atoms: list[list[UnitId]]  # what the balancer places: single units, or an item's units together
    patches: dict[UnitId, float]  # cost under the `patches` model
    prior: dict[UnitId, float]  # cost under the `attention` model (also the calibration's prior)

    def unit(self, uid: UnitId) -> VisionItem:
        return self.units[uid.item][uid.index]

    def unit_ids(self, item: int) -> list[UnitId]:
        return [UnitId(item, index) for index in range(len(self.units[item]))]


def plan(items: list[VisionItem], adapter: VisionAdapter, cache: EmbeddingCache, *, split_units: bool,
         loras: Sequence[TowerLora | None] = ()) -> Plan:
    """Cache lookup by content hash (duplicates inside the batch encoded once), then units and their costs.
    `loras[i]`: the tower adapter of item i (none given: the base tower's), already in its content hash
    (`tower_lora.cache_key`)."""
    loras = list(loras) or [None] * len(items)
    hits: dict[str, ray.ObjectRef] = {}
    todo: list[VisionItem] = []
    todo_loras: list[TowerLora | None] = []
    todo_index: dict[str, int] = {}
    todo_inputs: list[list[int]] = []
    for index, item in enumerate(items):
        key = item.content_hash
        if key in todo_index:
            todo_inputs[todo_index[key]].append(index)
        elif key not in hits:
            hit = cache.get(key)
            if hit is not None:
                hits[key] = hit
            else:
                todo_index[key] = len(todo)
                todo.append(item)
                todo_loras.append(loras[index])
                todo_inputs.append([index])
    # Units: an image; a MiniCPM-V overview and slices; Step3's crops and global view.
    units = [adapter.units(item) for item in todo]
    ids = [[UnitId(t, u) for u in range(len(item_units))] for t, item_units in enumerate(units)]
    atoms = [[uid] for item_ids in ids for uid in item_ids] if split_units else ids
    flat = [uid for item_ids in ids for uid in item_ids]
    return Plan(items, hits, todo, todo_loras, todo_inputs, units, atoms,
                patches={uid: adapter.cost(units[uid.item][uid.index], "patches") for uid in flat},
                prior={uid: adapter.cost(units[uid.item][uid.index], "attention") for uid in flat})


def place(plan: Plan, unit_cost: dict[UnitId, float], ready: Sequence[int], inflight: Sequence[float]
          ) -> tuple[list[list[UnitId]], list[float]]:
    """`(shards, loads)` per worker index: the atoms partitioned over the `ready` workers, counting
    the work each already has in flight; the others get nothing.

    Greedy plus local search: never a worse makespan than vLLM's greedy (see partition.py).
    """
    sizes = [sum(unit_cost[uid] for uid in atom) for atom in plan.atoms]
    ready_shards, ready_loads = partition(sizes, len(ready), [inflight[i] for i in ready])
    shards: list[list[UnitId]] = [[] for _ in inflight]
    loads = [0.0] * len(inflight)
    for i, atom_shard, load in zip(ready, ready_shards, ready_loads):
        shards[i], loads[i] = [uid for a in atom_shard for uid in plan.atoms[a]], load
    return shards, loads
