"""`Decoder` deployment: one `LLMEngine` in the replica process, streaming deltas per request.

All concurrent requests routed to a replica share its engine, which batches them into the same
decode rounds, so `max_ongoing_requests` should be at least the engine's `max_num_seqs`. Image
embeddings arrive as `ObjectRef`s straight from the encoder workers and are resolved here.
A request's first delta names the replica (the ingress counts requests and prefix-cache hits per
replica from it); a request the engine refuses ends with the refusal as its last item (not raised:
Serve would log a client's 400 as a replica error with a traceback), and `prefix_hashes` is for the request router (`prefix_router.py`), not used here.

LoRA adapters loaded while the app runs reach a replica as `LoraRef`s with each request (`lora_registry.py`):
a replica that does not serve that name with that fingerprint yet reads it into its engine's adapter pool
first (`LLMEngine.load_lora`; a name it served with other weights is unloaded first, letting its running
requests finish). `load_lora` is the check behind `/v1/load_lora_adapter`: this replica reads the adapter
once, so a bad one is refused before the registry has it.

With `engine.tensor_parallel_size` N > 1 the replica is rank 0 of a decode group (raypipe/parallel/)
and its placement group holds the other ranks (`compose` sets its bundles). When a rank dies, the
requests in flight fail with a retryable 503 (`GroupFailed`) and the next request restarts the group
whole: a new engine with new ranks, started while that request waits.
"""

from __future__ import annotations

import asyncio
import os

from ray import serve

from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.decode.resume import Resume
from raypipe.errors import CapacityError, InvalidInput
from raypipe.inputs.sampling import SamplingParams
from raypipe.models.prompt import PreparedPrompt
from raypipe.models.registry import resolve_model
from raypipe.parallel import runner_factory
from raypipe.serve.lora_registry import LoraRef


@serve.deployment  # options (replicas, resources, max_ongoing_requests) live in deployments/config.yaml
class Decoder:
    def __init__(self, model: str, engine: dict):  # from `AppArgs` (raypipe.serve.app.compose)
        self.checkpoint, self.config = resolve_model(model), EngineConfig(**engine)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.loaded: dict[str, str] = {}  # runtime adapters this replica's engine serves: name -> fingerprint
        self.engine = self._start()
        self.group_restarts = 0
        self._restart = asyncio.Lock()
        self._loading = asyncio.Lock()

    def _start(self) -> LLMEngine:
        self.loaded = {}  # a new engine serves only the adapters configured at start
        return LLMEngine(self.checkpoint, self.config, runner_factory=runner_factory(self.config))

    async def _live_engine(self) -> LLMEngine:
        """The engine, restarted whole first if its decode group failed (requests wait for the new one)."""
        async with self._restart:
            if self.engine.runner.failed is not None:
                await asyncio.to_thread(self.engine.shutdown)
                self.engine = await asyncio.to_thread(self._start)
                self.group_restarts += 1
            return self.engine

    async def generate(self, request_id: str, prompt: PreparedPrompt, visual_embeds: list, params: SamplingParams,
                       lora: LoraRef | None = None, cache_salt: str | None = None, prefix_hashes: tuple[bytes, ...] = (),
                       resume: Resume | None = None):
        # When the caller goes away Serve cancels this generator; the engine's generate() then
        # aborts the request, which frees its KV-cache row at the next round boundary. `resume`: the
        # request's output so far, from a replica that died (raypipe/serve/resume.py).
        replica = self.replica
        engine = await self._live_engine()
        try:
            if lora is not None and lora.fingerprint is not None and self.loaded.get(lora.name) != lora.fingerprint:
                await self._load(engine, lora.name, lora.path, lora.fingerprint)
            async for delta in engine.generate(request_id, prompt, visual_embeds, params, lora and lora.name,
                                               cache_salt=cache_salt, resume=resume):
                delta.replica, replica = replica, None
                yield delta
        except (InvalidInput, CapacityError) as refused:
            # The caller's fault or a retryable refusal: handed over as a value (the ingress raises it), because
            # an exception leaving a replica's method is logged by Serve at ERROR with its traceback.
            yield refused

    async def load_lora(self, name: str, path: str) -> str | InvalidInput:
        """Read and check adapter `name` at `path` into this replica's engine; its fingerprint, or the refusal (a
        value, as `generate` hands refusals over)."""
        try:
            return await self._load(await self._live_engine(), name, path)
        except InvalidInput as refused:
            return refused

    async def _load(self, engine: LLMEngine, name: str, path: str, fingerprint: str | None = None) -> str:
        """Serve `name` from `path` (registered with `fingerprint`), replacing what this replica served under it."""
        async with self._loading:  # one load at a time: concurrent first requests for a new adapter read it once
            if fingerprint is not None and self.loaded.get(name) == fingerprint:
                return fingerprint
            if name in self.loaded:
                engine.unload_lora(name)
                del self.loaded[name]
            read = await asyncio.to_thread(engine.load_lora, name, path)
            self.loaded[name] = fingerprint or read
            return read

    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    def pid(self) -> int:
        """The replica's process id (operators and tests locate the process that holds the engine)."""
        return os.getpid()

    def stats(self) -> dict:
        return {**self.engine.stats(), "group_restarts": self.group_restarts}

    def group_info(self) -> list[dict]:
        """Per rank of the decode group (pid, device, weight bytes); one entry without a group."""
        runner = self.engine.runner
        return runner.info() if hasattr(runner, "info") else [{"rank": 0, "pid": os.getpid()}]

    def __del__(self):
        if hasattr(self, "engine"):
            self.engine.shutdown()
