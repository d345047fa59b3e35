"""`Pipeline`: the user-facing handle that builds encoder workers, coordinator and decode engine.

It holds no model weights itself: the vision towers live in `EncoderWorker` actors and the
language model in the `DecodeEngine` actor.
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Sequence

import ray

from raypipe.coordinator import Coordinator
from raypipe.encoder import RemoteEncoderWorker
from raypipe.models.registry import vision_adapter
from raypipe.models.presets import resolve_model
from raypipe.preprocess import ImageLimits, load_images


def connect_ray(address: str | None = None) -> None:
    """Join `address`, else the cluster named by RAY_ADDRESS or started with `ray start` on this
    machine, else start a local one.

    Not `address="auto"`: besides `ray start` clusters, "auto" also joins any Ray it finds in the
    process table, e.g. another program's private `ray.init()` cluster.
    """
    if ray.is_initialized():
        return
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=os.environ.get("RAYPIPE_RAY_LOGS") == "1")


def default_encoder_gpus() -> float:
    return 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0


class Pipeline:
    def __init__(self, checkpoint: pathlib.Path, coordinator: Coordinator, workers: list,
                 image_limits: ImageLimits, owns_ray: bool):
        self.checkpoint = checkpoint
        self.coordinator = coordinator
        self.image_limits = image_limits
        self._owns_ray = owns_ray
        self._closed = False

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike = "tiny", *, num_encoders: int = 2,
                        encoder_gpus: float | None = None, cost_model: str = "patches",
                        cache_bytes: int = 256 * 1024 * 1024, dtype: str = "auto",
                        encoder_threads: int | None = None, image_limits: ImageLimits | None = None,
                        ray_address: str | None = None) -> "Pipeline":
        """Start `num_encoders` vision-tower replicas for `model` (a preset name or a local folder).

        `encoder_gpus` is the GPU share each encoder actor requests (fractions pack several per GPU,
        0 runs on CPU); by default 1 when the cluster has GPUs, else 0. On CPU each encoder gets
        `encoder_threads` torch threads (default: the machine's cores split evenly).
        """
        if num_encoders < 1:
            raise ValueError(f"num_encoders must be >= 1, got {num_encoders}")
        checkpoint = resolve_model(model)  # writes a preset once, before any actor races to
        adapter = vision_adapter(checkpoint)
        owns_ray = not ray.is_initialized()
        connect_ray(ray_address)
        gpus = default_encoder_gpus() if encoder_gpus is None else encoder_gpus
        threads = encoder_threads or max(1, (os.cpu_count() or 1) // num_encoders)

        def start_worker():
            # num_cpus=0: a worker must not pin a whole CPU slot on small machines (see PLATFORM-NOTES).
            return RemoteEncoderWorker.options(num_cpus=0, num_gpus=gpus).remote(
                str(checkpoint), dtype=dtype, num_threads=threads)

        workers = [start_worker() for _ in range(num_encoders)]
        ray.get([w.info.remote() for w in workers])  # surface load errors here, not on first call
        coordinator = Coordinator(adapter, workers, cost_model=cost_model, cache_bytes=cache_bytes,
                                  worker_factory=start_worker)
        return cls(checkpoint, coordinator, workers, image_limits or ImageLimits(), owns_ray)

    def encode(self, images: Sequence) -> list:
        """One `(tokens_i, hidden)` tensor per image, in input order.

        Images may be PIL images, uint8 arrays, encoded bytes or data: URLs; a bad one raises
        `InvalidInput` naming its index before any work is sent.
        """
        return self.coordinator.encode(load_images(images, self.image_limits))

    def worker_info(self) -> list[dict]:
        return ray.get([w.info.remote() for w in self.coordinator.workers])

    def stats(self) -> dict:
        return {"encoder": self.coordinator.stats()}

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for worker in self.coordinator.workers:
            ray.kill(worker)
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
