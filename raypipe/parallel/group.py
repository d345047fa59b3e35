"""Ranks 1..N-1 of a decode group: `RankWorker` actors in one placement group, joined to rank 0.

Placement: one bundle per device, `STRICT_PACK` (one node: the ranks talk over loopback or NVLink,
and rank 0's rendezvous store is reachable). Where rank 0 already runs in such a placement group
(a Serve `Decoder` replica whose deployment sets `placement_group_bundles`; Serve places the
replica in bundle 0 and lets it schedule into the others), ranks 1..N-1 take bundles 1..N-1.
Otherwise (an engine in a driver, a test) the group makes its own placement group for them and
removes it when it stops. A bundle is one GPU on CUDA; on CPU a sliver of a CPU (a whole one
would be held for the actor's life: see `runtime/`), each rank using `EngineConfig.num_threads`.

Start-up: every rank loads its shard first (errors surface here, not as a hung rendezvous), then
all join the process group at once. Stopping kills the actors: a rank that outlives its group
would only hold memory.
"""

from __future__ import annotations

import os
import uuid

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raypipe.parallel.collectives import Collectives, open_store
from raypipe.parallel.worker import RemoteRankWorker

CPU_BUNDLE_SHARE = 0.01  # per rank on CPU-only nodes: a fraction, so no rank holds a whole CPU


def rank_bundle(device_type: str) -> dict[str, float]:
    """One rank's placement-group bundle."""
    return {"GPU": 1} if device_type == "cuda" else {"CPU": CPU_BUNDLE_SHARE}


def group_bundles(tensor_parallel_size: int, gpus_per_rank: float) -> list[dict[str, float]]:
    """One bundle per rank: `gpus_per_rank` GPUs where rank 0's host asks for GPUs, else a CPU sliver."""
    return [{"GPU": gpus_per_rank} if gpus_per_rank else rank_bundle("cpu")] * tensor_parallel_size


def placement_options(tensor_parallel_size: int, gpus_per_rank: float) -> dict:
    """Serve deployment options for a replica that hosts a decode group of `tensor_parallel_size` ranks:
    one bundle per rank (the replica itself in bundle 0), packed on one node."""
    if tensor_parallel_size == 1:
        return {}
    return {"placement_group_bundles": group_bundles(tensor_parallel_size, gpus_per_rank),
            "placement_group_strategy": "STRICT_PACK"}


def engine_actor_placement(tensor_parallel_size: int, gpus_per_rank: float):
    """(actor options, placement group to remove when done) for an engine actor that hosts rank 0 in bundle 0
    of a new placement group (the group's ranks then take the other bundles); ({}, None) for one device."""
    if tensor_parallel_size == 1:
        return {}, None
    placement = placement_group(group_bundles(tensor_parallel_size, gpus_per_rank), strategy="STRICT_PACK")
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)}, placement


class RankGroup:
    def __init__(self, workers: list, placement, owns_placement: bool):
        self.workers, self.placement, self.owns_placement = workers, placement, owns_placement
        self.pid = os.getpid()

    @classmethod
    def start(cls, checkpoint: str, collectives: Collectives, runner_kwargs: dict, num_snapshots: int,
              num_threads: int | None) -> "RankGroup":
        world = collectives.world_size
        bundle = rank_bundle(collectives.device.type)
        current = ray.util.get_current_placement_group()
        if current is not None and len(current.bundle_specs) >= world:
            placement, first, owns = current, 1, False
        else:
            placement, first, owns = placement_group([bundle] * (world - 1), strategy="STRICT_PACK"), 0, True
            ray.get(placement.ready())
        workers = [RemoteRankWorker.options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=first + i),
        ).remote(checkpoint, rank, world, runner_kwargs, num_snapshots, num_threads) for i, rank in enumerate(range(1, world))]
        group = cls(workers, placement, owns)
        try:
            ray.get([w.loaded.remote() for w in workers])
            store, host, port = open_store()
            generation = uuid.uuid4().hex
            joined = [w.join.remote(host, port, generation) for w in workers]
            collectives.connect(store, host, port, generation)
            ray.get(joined)
        except BaseException:
            group.stop()
            raise
        return group

    def info(self) -> list[dict]:
        return ray.get([w.info.remote() for w in self.workers])

    def stop(self) -> None:
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        self.workers = []
        if self.owns_placement and self.placement is not None:
            remove_placement_group(self.placement)
            self.placement = None
