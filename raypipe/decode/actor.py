"""`DecodeEngine`: the Ray actor that hosts one `LLMEngine` (its own GPU when there is one).

An async actor, so many requests wait on the engine at once. Image embeddings arrive as
`ObjectRef`s nested in a list (Ray resolves only top-level ref arguments), and the engine fetches
them itself: they never pass through the caller. Streaming uses an async-generator method called
with `.options(num_returns="streaming")`; one item is yielded per delta.
"""

from __future__ import annotations

import os

import ray

from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine


class DecodeEngine:
    def __init__(self, checkpoint: str, config: EngineConfig, runner_factory=None):
        self.engine = LLMEngine(checkpoint, config, runner_factory)  # runner_factory: see LLMEngine

    def info(self) -> dict:
        config = self.engine.config
        return {"pid": os.getpid(), "device": str(self.engine.device), "max_model_len": config.max_model_len,
                "max_num_seqs": config.max_num_seqs, "max_num_waiting": config.max_num_waiting,
                "num_scheduler_steps": config.num_scheduler_steps, "threads": self.engine.num_threads}

    def check_request(self, prompt, params, lora: str | None = None) -> None:
        self.engine.check_request(prompt, params, lora)

    async def generate(self, request_id: str, prompt, visual_refs: list, params, lora: str | None = None):
        """The whole `RequestOutput` of one request (with LoRA adapter `lora`, None: the base model)."""
        return await self.engine.generate_output(request_id, prompt, visual_refs, params, lora)

    async def generate_stream(self, request_id: str, prompt, visual_refs: list, params, lora: str | None = None):
        """Yields `RequestDelta`s; call with `.options(num_returns="streaming")`."""
        async for delta in self.engine.generate(request_id, prompt, visual_refs, params, lora):
            yield delta

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def stats(self) -> dict:
        return self.engine.stats()


RemoteDecodeEngine = ray.remote(DecodeEngine)
