"""`Pipeline`: the user-facing handle that builds encoder workers, coordinator and decode engine.

It holds no model weights itself: the vision towers live in `EncoderWorker` actors and the
language model in the `DecodeEngine` actor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pathlib
import threading
import uuid
from collections.abc import AsyncIterator, Sequence

import ray
from ray.exceptions import RayTaskError
from ray.util.placement_group import remove_placement_group

from raypipe.config import ModelConfig, defaults
from raypipe.decode.config import EngineConfig
from raypipe.decode.sequence import RequestDelta, RequestOutput
from raypipe.encode.coordinator import Coordinator
from raypipe.encode.pool import EncoderPool, WorkerOptions
from raypipe.encode.tower_lora import TowerLora, TowerLoras
from raypipe.errors import InvalidInput, RaypipeError
from raypipe.inputs.images import ImageLimits
from raypipe.inputs.sampling import SamplingParams
from raypipe.models.base import VisionAdapter
from raypipe.models.prompt import PreparedPrompt, VideoOptions, build_prompt, load_visuals
from raypipe.models.registry import family_of, language_adapter, model_for_actors, resolve_model, vision_adapter
from raypipe.runtime.ray_cluster import connect_ray, decode_threads, default_encoder_gpus


def tower_loras(lora_modules: dict[str, str], checkpoint: pathlib.Path, coordinator: Coordinator) -> TowerLoras:
    """The coordinator's tower adapters (Pipeline and Serve's EncoderGroup): those of `lora_modules` that target the
    vision tower read now and checked against an encoder's tower (a bad one stops the start, naming its module)."""

    def check(lora: TowerLora, where: str | None) -> None:
        worker = coordinator.pool.workers[0]
        _unwrap_ray(lambda: ray.get(worker.check_tower_lora.remote(lora, where)))

    loras = TowerLoras(family_of(checkpoint), check)
    loras.configure(lora_modules)
    return loras


def start_encoders(config: ModelConfig, checkpoint: pathlib.Path, adapter: VisionAdapter) -> Coordinator:
    """`config.num_encoders` encoder workers, loaded, and the coordinator over them (Pipeline and
    Serve's EncoderGroup)."""
    options = WorkerOptions.for_cluster(model_for_actors(config.model, checkpoint), config.num_encoders,
                                        gpus=config.encoder_gpus, dtype=config.dtype, threads=config.encoder_threads,
                                        budgets=config.encoder_budgets)
    return Coordinator(adapter, EncoderPool.start(options, config.num_encoders), cost_model=config.cost_model,
                       cache_bytes=config.cache_bytes)


class Pipeline:
    def __init__(self, checkpoint: pathlib.Path, coordinator: Coordinator, image_limits: ImageLimits, owns_ray: bool, engine_config: EngineConfig | None = None,
                 decode_gpus: float = 0.0, video: VideoOptions = VideoOptions()):
        self.checkpoint = checkpoint
        self.coordinator = coordinator
        self.image_limits = image_limits
        self.video = video  # video limits, sampling and EVS rate of every request
        self.engine_config = engine_config or EngineConfig()
        self.decode_gpus = decode_gpus
        self.actor_model = str(checkpoint)  # what actors load: an s3:// URI resolves on their own node
        self._engine = None  # DecodeEngine actor, started by the first generate()
        self._engine_ready = None  # its info() ref: resolves once the model is loaded
        self._placement = None  # the decode group's placement group (tensor_parallel_size > 1)
        self._engine_lock = threading.Lock()  # concurrent first calls must start one engine
        self._tokenizer = None
        # adapters of `engine_config.lora_modules` on the vision tower: their requests' images are encoded with them
        self.tower_loras = tower_loras(self.engine_config.lora_modules, checkpoint, coordinator)
        self._owns_ray = owns_ray
        self._closed = False

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike = defaults(ModelConfig)["model"], *,
                        engine_config: EngineConfig | None = None, image_limits: ImageLimits | None = None,
                        ray_address: str | None = None, **overrides) -> "Pipeline":
        """Start the vision-tower replicas for `model` (a preset name, local folder or s3:// URI).

        `overrides` are `ModelConfig` fields (num_encoders, cache_bytes, ...) and `EngineConfig` fields
        (num_scheduler_steps, max_num_seqs, ...; they replace `engine_config`'s). `dtype`, a field of
        both, is the encoders' one: give the engine's in `engine_config`. Each default is its
        dataclass's; see `from_config`.
        """
        model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
        engine_fields = {f.name for f in dataclasses.fields(EngineConfig)} - model_fields
        unknown = sorted(overrides.keys() - model_fields - engine_fields)
        if unknown:
            raise TypeError(f"from_pretrained() got unexpected keyword arguments: {', '.join(unknown)}")
        config = ModelConfig(model=model, **{k: v for k, v in overrides.items() if k in model_fields})
        engine_config = dataclasses.replace(engine_config or EngineConfig(),
                                            **{k: v for k, v in overrides.items() if k in engine_fields})
        return cls.from_config(config, engine_config=engine_config, image_limits=image_limits,
                               ray_address=ray_address)

    @classmethod
    def from_config(cls, config: ModelConfig, *, engine_config: EngineConfig | None = None,
                    image_limits: ImageLimits | None = None, ray_address: str | None = None) -> "Pipeline":
        """Start `config.num_encoders` vision-tower replicas for `config.model`.

        `encoder_gpus` is the GPU share each encoder actor requests (fractions pack several per GPU,
        0 runs on CPU); by default 1 when the cluster has GPUs, else 0. On CPU each encoder gets
        `encoder_threads` torch threads (default: the machine's cores split evenly).

        The decode engine (language model only) starts with the first `generate` call, in its own
        actor with `decode_gpus` (default like `encoder_gpus`) and `engine_config` (limits, dtype,
        threads, decode steps per round).
        """
        checkpoint = resolve_model(config.model)  # writes a preset once, before any actor races to
        adapter = vision_adapter(checkpoint)  # an unsupported family fails here, before any actor starts
        owns_ray = not ray.is_initialized()
        connect_ray(ray_address)
        coordinator = start_encoders(config, checkpoint, adapter)
        engine_config = engine_config or EngineConfig()
        if engine_config.num_threads is None:  # explicit, not Ray's implicit OMP_NUM_THREADS=1
            engine_config = dataclasses.replace(engine_config, num_threads=decode_threads(
                os.cpu_count() or 1, encoders_on_cpu=not coordinator.pool.options.num_gpus))
        pipeline = cls(checkpoint, coordinator, image_limits or ImageLimits(), owns_ray, engine_config,
                       default_encoder_gpus() if config.decode_gpus is None else config.decode_gpus,
                       VideoOptions(pruning_rate=config.video_pruning_rate))
        pipeline.actor_model = model_for_actors(config.model, checkpoint)
        return pipeline

    def encode(self, visuals: Sequence) -> list:
        """One `(tokens_i, hidden)` CPU tensor per image or video, in input order: the rows `generate`
        scatters at the item's placeholders.

        An image is a PIL image, uint8 array, encoded bytes or data: URL (or an `image` / `image_url`
        content part); a video is a content part `{"type": "video", "video": path / bytes / data: URL /
        list of frames}` (or `video_url`), sampled and resized with this pipeline's video options as
        `generate` reads it. A video's tensor holds all its tokens (Qwen2.5-VL: t·h·w / merge² rows;
        LLaVA-OneVision: each kept frame's pooled rows, then the newline row), before EVS pruning
        (`video_pruning_rate` prunes them in the decode engine). A bad item raises `InvalidInput` naming
        it (`images[1]`, `videos[0]`) before any work is sent.
        """
        return self.coordinator.encode(load_visuals(visuals, self.coordinator.adapter, self.image_limits,
                                                    video=self.video))

    def generate(self, requests: Sequence, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Generate for every request (messages list, `{"messages": ...}` or `{"prompt_token_ids", "images", "videos"}`).

        Messages may hold image and video parts (`{"type": "video", "video": path / bytes / frames}`);
        a video's frames are sampled and resized as it is decoded, and its temporal chunks are
        balanced over the encoders with the window's images. A request dict may hold
        `"mm_processor_kwargs": {"tile_every_image": True}` (LLaVA-OneVision: tiles for every image of a
        several-image prompt, not the base view alone).

        `sampling_params` is one for all or one per request, as is `lora`: the name of a LoRA adapter of
        `EngineConfig.lora_modules` (None: the base model). Every request is validated first: a bad
        one raises `InvalidInput` naming `requests[i]` and nothing runs. Requests go to the engine in
        windows of at most its capacity (`max_num_seqs + max_num_waiting`, so a long list is never
        refused as a full queue); the images and videos of a window are encoded as one balanced batch and the
        decode engine batches its requests together.
        """
        if _is_messages(requests):
            requests = [requests]
        params = _params_per_request(sampling_params, len(requests))
        loras = [lora] * len(requests) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(requests):
            raise InvalidInput(f"{len(loras)} LoRA adapter names for {len(requests)} requests", item="lora")
        prompts = [self._prepare(request, f"requests[{i}]") for i, request in enumerate(requests)]
        engine = self._engine_actor()
        ray.get(self._engine_ready)
        checks = [engine.check_request.remote(p.without_pixels(), sp, name) for p, sp, name in zip(prompts, params, loras)]
        for i, check in enumerate(checks):
            try:
                _unwrap_ray(lambda: ray.get(check))
            except InvalidInput as exc:
                raise _named(exc, f"requests[{i}]") from None
        window = self.engine_config.max_num_seqs + self.engine_config.max_num_waiting
        outputs = []
        for first in range(0, len(prompts), window):
            part = slice(first, first + window)
            outputs += self._generate_window(engine, prompts[part], params[part], loras[part])
        return outputs

    def _generate_window(self, engine, prompts: list[PreparedPrompt], params: list[SamplingParams],
                         loras: list[str | None]) -> list[RequestOutput]:
        towers = [self.tower_loras.for_request(name) for name in loras]  # each request's adapter on the tower
        encoded = self.coordinator.submit([image for p in prompts for image in p.visuals],
                                          [tower for p, tower in zip(prompts, towers) for _ in p.visuals])
        calls, start = [], 0
        for prompt, sp, name in zip(prompts, params, loras):
            refs = [e.ref for e in encoded[start: start + len(prompt.visuals)]]
            start += len(prompt.visuals)
            calls.append(engine.generate.remote(uuid.uuid4().hex, prompt.without_pixels(), refs, sp, name))
        return _unwrap_ray(lambda: ray.get(calls))

    async def generate_stream(self, request, sampling_params: SamplingParams | None = None,
                              lora: str | None = None) -> AsyncIterator[RequestDelta]:
        """Deltas of one request as the engine produces them (at least one per round), with LoRA adapter
        `lora` (None: the base model).

        Nothing here blocks the caller's event loop: prompt building (tokenizer, image decoding) runs
        in a thread and the engine's start-up is awaited. A full engine raises `QueueFull`.
        """
        params = sampling_params if sampling_params is not None else SamplingParams()
        prompt = await asyncio.to_thread(self._prepare, request, "request")
        engine = self._engine_actor()
        await self._engine_ready
        await _unwrap_async(engine.check_request.remote(prompt.without_pixels(), params, lora))
        encoded = await asyncio.to_thread(self.coordinator.submit, prompt.visuals,
                                          [self.tower_loras.for_request(lora)] * len(prompt.visuals))
        request_id = uuid.uuid4().hex
        stream = engine.generate_stream.options(num_returns="streaming").remote(
            request_id, prompt.without_pixels(), [e.ref for e in encoded], params, lora)
        finished = False
        try:
            async for ref in stream:
                delta = await _unwrap_async(ref)
                finished = delta.finish_reason is not None
                yield delta
        finally:
            if not finished:
                engine.abort.remote(request_id)

    def _prepare(self, request, where: str) -> PreparedPrompt:
        if self._tokenizer is None:
            self._tokenizer = language_adapter(self.checkpoint).tokenizer
        try:
            return build_prompt(request, self._tokenizer, self.coordinator.adapter, self.image_limits, video=self.video)
        except InvalidInput as exc:
            raise _named(exc, where) from None

    def _engine_actor(self):
        """The decode engine actor, created once (without waiting: await or get `_engine_ready`,
        which surfaces load errors)."""
        with self._engine_lock:
            if self._engine is None:
                self._start_engine()
            return self._engine

    def _start_engine(self) -> None:
        # Imported here, not at the top: Serve's EncoderGroup imports this module for `start_encoders`, and the
        # decode engine's imports would add ~6 s to every encoder replica's start.
        from raypipe.decode.actor import RemoteDecodeEngine
        from raypipe.parallel import runner_factory
        from raypipe.parallel.group import engine_actor_placement

        # num_cpus=0 like the encoders (see encode/pool.py); it picks its device itself. With
        # tensor_parallel_size N it is rank 0 of a decode group, in bundle 0 of N (raypipe/parallel/).
        options, self._placement = engine_actor_placement(self.engine_config.tensor_parallel_size, self.decode_gpus)
        self._engine = RemoteDecodeEngine.options(num_cpus=0, num_gpus=self.decode_gpus, **options).remote(
            self.actor_model, self.engine_config, runner_factory(self.engine_config))
        self._engine_ready = self._engine.info.remote()

    def engine_stats(self) -> dict:
        return ray.get(self._engine.stats.remote()) if self._engine is not None else {}

    def worker_info(self) -> list[dict]:
        return self.coordinator.pool.info()

    def stats(self) -> dict:
        return {"encoder": self.coordinator.stats(), "decode": self.engine_stats()}

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.coordinator.pool.shutdown()
        if self._engine is not None:
            ray.kill(self._engine)  # its group's ranks are its own actors: they go with it
        if self._placement is not None:
            remove_placement_group(self._placement)
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _is_messages(requests) -> bool:
    """A bare messages list (one request) rather than a list of requests."""
    return isinstance(requests, list) and bool(requests) and isinstance(requests[0], dict) and "role" in requests[0]


def _params_per_request(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * n
    params = list(sampling_params)
    if len(params) != n:
        raise InvalidInput(f"{len(params)} sampling params for {n} requests", item="sampling_params")
    return params


def _named(exc: InvalidInput, where: str) -> InvalidInput:
    return InvalidInput(exc.reason, item=f"{where}.{exc.item}" if exc.item else where, code=exc.code)


def _unwrap_ray(call):
    """Run `call`; our own errors raised inside an actor (`InvalidInput`, `CapacityError`, ...) come
    back as themselves, not as RayTaskError."""
    try:
        return call()
    except RayTaskError as exc:
        _raise_own_cause(exc)
        raise


async def _unwrap_async(ref):
    try:
        return await ref
    except RayTaskError as exc:
        _raise_own_cause(exc)
        raise


def _raise_own_cause(exc: RayTaskError) -> None:
    if isinstance(exc.cause, RaypipeError):
        raise exc.cause from None
