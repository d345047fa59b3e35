"""`EncoderGroup` deployment: one coordinator over N encoder-worker actors, fed in micro-batches.

Each request's images arrive as one call; `@serve.batch` gathers the calls that arrive within a
short window (or while the previous batch is still encoding) into one `Coordinator.submit`, so the
load balancer spreads the images of many concurrent requests over the workers at once, instead of
sending each request's one or two images to whichever worker is first. The embeddings stay in the
object store: callers get `ObjectRef`s, which they hand on to the decoder.

A request served with a LoRA adapter that targets the vision tower has its images encoded with it
(`encode/tower_lora.py`): adapters configured at start are read here when the group starts; one loaded while
the app runs is read (from its `lora_path`, which must be readable here too) when `/v1/load_lora_adapter` checks
it, or on its first request at a replica that has not read it, and kept least recently used first.

Serve calls `check_health` every `health_check_period_s`; it pings the workers and replaces dead
ones, so the group repairs itself with no request in flight. Pings run on each worker's own health
thread: a busy worker is alive, not dead.
"""

from __future__ import annotations

import asyncio

import ray
from ray import serve

from raypipe.config import ModelConfig
from raypipe.errors import InvalidInput
from raypipe.inputs.media import DecodedVisual
from raypipe.models.registry import resolve_model, vision_adapter
from raypipe.pipeline import start_encoders, tower_loras
from raypipe.serve.lora_registry import LoraRef


@serve.deployment  # options (replicas, resources, health checks) live in deployments/config.yaml
class EncoderGroup:
    # No defaults for what `AppArgs` carries: `raypipe.serve.app.compose` always passes them.
    def __init__(self, config: ModelConfig, *, batch_window_s: float, max_batch_images: int,
                 lora_modules: dict[str, str]):
        self.checkpoint = resolve_model(config.model)
        self.coordinator = start_encoders(config, self.checkpoint, vision_adapter(self.checkpoint))
        self.pool = self.coordinator.pool
        self.tower_loras = tower_loras(lora_modules, self.checkpoint, self.coordinator)
        self.encode.set_max_batch_size(max_batch_images)
        self.encode.set_batch_wait_timeout_s(batch_window_s)
        self.batching = {"batches": 0, "requests": 0, "images": 0, "max_requests_per_batch": 0}

    # Two batches may encode at once: the coordinator balances the second against the first's
    # work still in flight, so a lone image lands on an idle worker instead of queueing.
    @serve.batch(batch_size_fn=lambda calls: sum(len(images) for images in calls), max_concurrent_batches=2)
    async def encode(self, calls: list[list[DecodedVisual]], loras: list[LoraRef | None]
                     ) -> list[list[ray.ObjectRef] | InvalidInput]:
        """Per call, one embedding `ObjectRef` per image (in order), its images encoded with the tower part of its
        LoRA adapter `loras[i]` if it has one; an adapter that cannot be read fails its own call only (handed over
        as a value). Batch size counts images, not calls."""
        towers = [await self._tower_part(lora) for lora in loras]
        kept = [i for i, tower in enumerate(towers) if not isinstance(tower, InvalidInput)]
        flat = [image for i in kept for image in calls[i]]
        # submit() blocks on ray.wait; a thread keeps this replica's event loop free to queue the next batch.
        encoded = await asyncio.to_thread(self.coordinator.submit, flat,
                                          [towers[i] for i in kept for _ in calls[i]])
        self._count_batch(calls)
        refs, start = list(towers), 0
        for i in kept:
            refs[i] = [item.ref for item in encoded[start:start + len(calls[i])]]
            start += len(calls[i])
        for images in calls:
            images.clear()  # drop the pixels now: the batching machinery may keep this list until the next batch
        return refs

    async def check_lora(self, name: str, path: str) -> str | None | InvalidInput:
        """Read adapter `name`'s tower part from `path` and check it against a worker's tower (`/v1/load_lora_adapter`):
        its fingerprint, None when it targets no tower module, or the refusal (as a value)."""
        try:
            return await asyncio.to_thread(self.tower_loras.load, name, path)
        except InvalidInput as refused:
            return refused

    async def _tower_part(self, lora: LoraRef | None):
        """The tower part (a `TowerLora`) of the adapter a call names, None, or the refusal (as a value)."""
        if lora is None or lora.fingerprint is None:  # the base model, or an adapter configured at start
            return lora and self.tower_loras.for_request(lora.name)
        try:
            return await asyncio.to_thread(self.tower_loras.for_request, lora.name, lora.path, lora.fingerprint)
        except InvalidInput as refused:
            return refused

    def _count_batch(self, calls: list) -> None:
        with_images = sum(1 for images in calls if images)
        self.batching["batches"] += 1
        self.batching["requests"] += with_images
        self.batching["images"] += sum(len(images) for images in calls)
        self.batching["max_requests_per_batch"] = max(self.batching["max_requests_per_batch"], with_images)

    async def ping(self, timeout_s: float = 2.0) -> dict:
        """How many workers are alive (answer a ping within `timeout_s`) and how many are loading (for /health)."""
        return await asyncio.to_thread(self.pool.check, timeout_s)

    async def check_health(self) -> None:
        # Never raises: a dead worker is replaced here, not a reason for Serve to restart this replica.
        await asyncio.to_thread(self.pool.check, 5.0)

    def worker_info(self) -> list[dict]:
        """Each worker's `info()` (pid, device, items encoded): which processes serve this group."""
        return self.pool.info()

    def stats(self) -> dict:
        return {**self.coordinator.stats(), "batching": dict(self.batching)}

    def __del__(self):
        if hasattr(self, "pool"):
            self.pool.shutdown()  # kills the worker actors (Ray itself belongs to Serve)
