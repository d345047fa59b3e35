"""One request's stream of decoder deltas, turned into an OpenAI response body or SSE chunks.

SSE order (as OpenAI sends it): a first chunk with the assistant role, one chunk per non-empty
text delta, a chunk with `finish_reason` and an empty delta, with `include_usage` one more chunk
with empty `choices` and the usage, then `data: [DONE]`. If the client goes away, the decoder
call is cancelled, which aborts the engine request and frees its slot.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from deployments.errors import ApiError
from deployments.metrics import ServeMetrics
from deployments.protocol import chunk_body, completion_body, usage


def openai_finish_reason(reason: str) -> str:
    # The engine may say why it stopped more precisely (eos, stop string, stop token id): all are "stop".
    return "length" if reason == "length" else "stop"


class ChatStream:
    def __init__(self, request_id: str, model: str, deltas, prompt_tokens: int, arrival: float,
                 include_usage: bool):
        self.request_id, self.model, self.deltas = request_id, model, deltas
        self.prompt_tokens, self.arrival, self.include_usage = prompt_tokens, arrival, include_usage
        self.created = int(time.time())
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.first_token_at: float | None = None
        self._first = None

    async def start(self) -> None:
        """Wait for the first delta (after prefill): errors before it can still become a 4xx response."""
        self._first = await self.deltas.__anext__()
        self.first_token_at = time.monotonic()

    async def _texts(self) -> AsyncIterator[str]:
        delta = self._first
        while True:
            self.completion_tokens += len(delta.token_ids)
            if delta.finish_reason is not None:
                self.finish_reason = openai_finish_reason(delta.finish_reason)
            if delta.text:
                yield delta.text
            if self.finish_reason is not None:
                return
            delta = await self.deltas.__anext__()

    async def collect(self) -> dict:
        text = "".join([piece async for piece in self._texts()])
        return completion_body(self.request_id, self.model, text, self.finish_reason, self.prompt_tokens,
                               self.completion_tokens)

    def record(self, metrics: ServeMetrics, endpoint: str) -> None:
        metrics.record_success(endpoint, self.arrival, self.first_token_at, time.monotonic(), self.prompt_tokens,
                               self.completion_tokens)

    async def sse(self, metrics: ServeMetrics, endpoint: str) -> AsyncIterator[str]:
        def event(body: dict) -> str:
            return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

        def chunk(delta, finish=None, usage_value=None) -> str:
            return event(chunk_body(self.request_id, self.model, self.created, delta, finish,
                                    with_usage_field=self.include_usage, usage_value=usage_value))

        try:
            yield chunk({"role": "assistant", "content": ""})
            async for text in self._texts():
                yield chunk({"content": text})
            yield chunk({}, self.finish_reason)
            if self.include_usage:
                yield chunk(None, usage_value=usage(self.prompt_tokens, self.completion_tokens))
            yield "data: [DONE]\n\n"
            self.record(metrics, endpoint)
        except asyncio.CancelledError:  # the client disconnected
            metrics.record_error(endpoint, 499, "client_disconnected")
            raise
        except Exception as exc:  # noqa: BLE001 - the status line is sent already: report in-band
            error = ApiError.from_exception(exc)
            metrics.record_error(endpoint, error.status, error.code)
            yield event(error.body())
            yield "data: [DONE]\n\n"
        finally:
            if self.finish_reason is None:
                self.deltas.cancel()  # stop the decoder's generator: it aborts the engine request
