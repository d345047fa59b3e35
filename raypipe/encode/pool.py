"""`EncoderPool`: the encoder worker actors' lifecycle, apart from how work is balanced over them.

Pipeline, the Serve `EncoderGroup` and the batch job all run the same `EncoderWorker`; how one is
built (model, GPU share, dtype, torch threads) is one `WorkerOptions`, so the three agree on it.
The pool starts N actors and waits for their weights, answers which workers are ready, replaces
the dead ones, and kills them all at shutdown. The coordinator only asks it for ready workers and,
when a shard's worker died, for a worker to retry on.

A replacement is not ready until its first `ping` answered (weights loaded): until then it gets no
shard. `check` pings every ready worker on its own health thread (never queued behind encode calls)
and replaces the dead ones, so a service can repair itself before any request meets a dead worker.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Sequence

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from raypipe.encode.budgets import TokenBudgets
from raypipe.encode.worker import EncoderWorker, RemoteEncoderWorker
from raypipe.runtime.ray_cluster import default_encoder_gpus

log = logging.getLogger(__name__)
WORKER_LOST = (RayActorError, ActorUnavailableError)


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerOptions:
    """How to build one encoder worker."""

    # Values come from `ModelConfig` (raypipe/config.py), where their defaults live.
    model: str  # a preset name, s3:// URI or absolute folder: what every node can resolve itself
    dtype: str
    num_threads: int | None  # torch threads on CPU
    num_gpus: float = 0.0  # GPU share of an actor (fractions pack several per GPU); batch's stage asks Ray Data
    budgets: TokenBudgets = TokenBudgets()  # `ModelConfig.encoder_budgets`

    @classmethod
    def for_cluster(cls, model: str, num_workers: int, *, gpus: float | None, dtype: str,
                    threads: int | None, budgets: TokenBudgets) -> "WorkerOptions":
        """Defaults from the cluster: a whole GPU each where GPUs exist (else CPU), and on CPU the
        machine's cores split evenly over `num_workers`."""
        return cls(model, dtype, threads or max(1, (os.cpu_count() or 1) // num_workers),
                   default_encoder_gpus() if gpus is None else gpus, budgets)

    def build(self) -> EncoderWorker:
        """A worker in this process (the batch job's actors, whose lifecycle Ray Data owns)."""
        return EncoderWorker(self.model, dtype=self.dtype, num_threads=self.num_threads, budgets=self.budgets)

    def start(self):
        """A worker actor (loading starts now; its first answered call means it is loaded)."""
        # num_cpus=0: an actor with num_cpus=1 holds that CPU for its life, so on a 2-core machine a
        # third such actor would wait forever: workers ask for none and set their torch threads.
        return RemoteEncoderWorker.options(num_cpus=0, num_gpus=self.num_gpus).remote(
            self.model, dtype=self.dtype, num_threads=self.num_threads, budgets=self.budgets)


class EncoderPool:
    """Worker actors by index; with `options`, a dead one is replaced by a new actor built from them."""

    def __init__(self, workers: Sequence, options: WorkerOptions | None = None):
        if not workers:
            raise ValueError("an encoder pool needs at least one worker")
        self._workers = list(workers)
        self.options = options
        self._loading: dict[int, ray.ObjectRef] = {}  # worker index -> first ping of a replacement
        self.replaced = 0
        self._lock = threading.Lock()

    @classmethod
    def start(cls, options: WorkerOptions, count: int) -> "EncoderPool":
        """`count` workers, returned once all have loaded (a load error surfaces here, not on first use)."""
        workers = [options.start() for _ in range(count)]
        ray.get([w.info.remote() for w in workers])
        return cls(workers, options)

    @property
    def workers(self) -> list:
        """The current actors by index (a copy: replacements swap in behind it)."""
        with self._lock:
            return list(self._workers)

    def __len__(self) -> int:
        return len(self._workers)

    @property
    def loading(self) -> int:
        """Replacements still loading their weights."""
        with self._lock:
            return len(self._loading)

    def wait_ready(self) -> list[int]:
        """Ready worker indices, waiting for a replacement to load if none is ready."""
        while True:
            with self._lock:
                ready, loading = self._ready_locked(), list(self._loading.values())
            if ready:
                return ready
            ray.wait(loading, num_returns=1)

    def retry_target(self, dead, dead_index: int) -> int:
        """Swap a replacement in for `dead` (if we can build one) and return a worker index to retry on."""
        with self._lock:
            self._replace_locked(dead, dead_index)
            # Prefer a ready worker: the replacement still has to load weights.
            others = [i for i in self._ready_locked() if i != dead_index]
            return others[0] if others else dead_index

    def worker(self, index: int):
        with self._lock:
            return self._workers[index]

    def check(self, timeout_s: float = 5.0) -> dict:
        """Ping every ready worker (on its health thread); replace the dead. Loading replacements are not alive yet."""
        with self._lock:
            workers, ready = list(self._workers), self._ready_locked()
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
                    self._replace_locked(workers[index], index)
        return {"workers": len(workers), "alive": alive, "loading": self.loading}

    def info(self) -> list[dict]:
        """Each worker's `info()` (pid, device, items encoded)."""
        return ray.get([w.info.remote() for w in self.workers])

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)

    def _replace_locked(self, dead, index: int) -> None:
        """Start a replacement for `dead` at `index` unless that already happened."""
        if self._workers[index] is dead and self.options is not None:
            log.warning("replacing encoder worker %d", index)
            self._workers[index] = self.options.start()
            self._loading[index] = self._workers[index].ping.remote()
            self.replaced += 1

    def _ready_locked(self) -> list[int]:
        """Indices of workers that have loaded their weights (does not wait)."""
        if self._loading:
            done, _ = ray.wait(list(self._loading.values()), num_returns=len(self._loading), timeout=0)
            for index in [i for i, ref in self._loading.items() if ref in done]:
                del self._loading[index]  # a replacement that died loading fails its first shard: retried
        return [i for i in range(len(self._workers)) if i not in self._loading]
