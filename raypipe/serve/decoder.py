"""`Decoder` deployment: one `LLMEngine` in the replica process, streaming deltas per request.

All concurrent requests routed to a replica share its engine, which batches them into the same
decode rounds, so `max_ongoing_requests` should be at least the engine's `max_num_seqs`. Image
embeddings arrive as `ObjectRef`s straight from the encoder workers and are resolved here.
A request's first delta names the replica (the ingress counts requests and prefix-cache hits per
replica from it), and `prefix_hashes` is for the request router (`prefix_router.py`), not used here.
"""

from __future__ import annotations

import os

from ray import serve

from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.inputs.sampling import SamplingParams
from raypipe.models.prompt import PreparedPrompt
from raypipe.models.registry import resolve_model


@serve.deployment  # options (replicas, resources, max_ongoing_requests) live in deployments/config.yaml
class Decoder:
    def __init__(self, model: str, engine: dict):  # from `AppArgs` (raypipe.serve.app.compose)
        self.engine = LLMEngine(resolve_model(model), EngineConfig(**engine))
        self.replica = serve.get_replica_context().replica_id.unique_id

    async def generate(self, request_id: str, prompt: PreparedPrompt, visual_embeds: list, params: SamplingParams,
                       prefix_hashes: tuple[bytes, ...] = ()):
        # When the caller goes away Serve cancels this generator; the engine's generate() then
        # aborts the request, which frees its KV-cache row at the next round boundary.
        replica = self.replica
        async for delta in self.engine.generate(request_id, prompt, visual_embeds, params):
            delta.replica, replica = replica, None
            yield delta

    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    def pid(self) -> int:
        """The replica's process id (operators and tests locate the process that holds the engine)."""
        return os.getpid()

    def stats(self) -> dict:
        return self.engine.stats()

    def __del__(self):
        if hasattr(self, "engine"):
            self.engine.shutdown()
