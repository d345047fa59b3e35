"""The decode group's process group: one gloo (CPU) or NCCL (CUDA) group, made without the global default.

`torch.distributed.init_process_group` sets one process-wide default group, so a process could
host one decode group in its life; a Serve replica that restarts its group, a test module or a
benchmark that starts a TP=1 and a TP=2 engine side by side need more. So each group is its own
`ProcessGroupGloo` / `ProcessGroupNCCL` over a `TCPStore` that rank 0 opens on a free port, and
collectives are called on that object. Rank 0 sends what every rank must run (`broadcast_object`:
a round's plan, pickled once per round) and each decode step's sampled ids (`broadcast_ids`); the
row-parallel layers sum their partial outputs (`all_reduce`). Time spent inside collectives is
counted (`seconds`) for the benchmark's "share of a step in collectives".
"""

from __future__ import annotations

import datetime
import pickle
import time

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0  # a rank that stops answering fails the group after this (a dead one: at once)


# Every rank is on rank 0's node (one STRICT_PACK placement group), so the rendezvous store and gloo's
# pairs stay on loopback: nothing of the group listens on a routable address.
LOOPBACK = "127.0.0.1"


def open_store(timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[dist.TCPStore, str, int]:
    """Rank 0's rendezvous store on a free loopback port: (store, host, port)."""
    store = dist.TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return store, LOOPBACK, store.port


class Collectives:
    """One rank's side of the group (`connect` first); every call is a collective all ranks make in the same order."""

    def __init__(self, rank: int, world_size: int, device: torch.device):
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.group = None
        self.seconds = 0.0  # spent in collectives, this rank

    def connect(self, store: dist.Store | None, host: str, port: int, generation: int,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        store = dist.PrefixStore(f"raypipe-decode-group-{generation}", store)
        if self.device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(store, self.rank, self.world_size)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
            self.group = dist.ProcessGroupGloo(store, self.rank, self.world_size, options)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        self.group.allreduce([tensor]).wait()
        self.seconds += time.perf_counter() - start
        return tensor

    def broadcast_object(self, obj=None):
        """Rank 0's `obj` on every rank (pickled: a length, then the bytes)."""
        start = time.perf_counter()
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.long)
        else:
            size = torch.zeros(1, dtype=torch.long)
        self._broadcast(size)
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(data)
        self.seconds += time.perf_counter() - start
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def broadcast_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Rank 0's `ids` (long, same shape on every rank) into `ids` on every rank."""
        start = time.perf_counter()
        self._broadcast(ids)
        self.seconds += time.perf_counter() - start
        return ids

    def _broadcast(self, tensor: torch.Tensor) -> None:
        if self.device.type == "cuda":  # NCCL moves device tensors only
            moved = tensor.to(self.device)
            self.group.broadcast(moved, 0).wait()
            tensor.copy_(moved)
        else:
            self.group.broadcast(tensor, 0).wait()
