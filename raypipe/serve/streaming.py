"""One request's stream of decoder deltas, turned into an OpenAI response body or SSE chunks.

SSE order (as OpenAI sends it): for chat a first chunk with the assistant role, one chunk per
non-empty text delta (or per delta with logprobs), a chunk with `finish_reason` and an empty delta,
with `include_usage` one more chunk with empty `choices` and the usage, then `data: [DONE]`. If the
client goes away, the decoder call is cancelled, which aborts the engine request and frees its
slot. If the decoder dies mid-stream, an error event (503, retryable) precedes `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from raypipe.serve.errors import ApiError
from raypipe.serve.metrics import ServeMetrics
from raypipe.serve.openai.bodies import chunk_body, completion_body, usage


def openai_finish_reason(reason: str) -> str:
    # The engine may say why it stopped more precisely (eos, stop string, stop token id): all are "stop".
    return "length" if reason == "length" else "stop"


class CompletionStream:
    """`kind` is "chat" or "text" (see `openai.bodies.completion_body`); `token_text(id)` renders logprob tokens."""

    def __init__(self, kind: str, request_id: str, model: str, fingerprint: str, deltas, prompt_tokens: int,
                 arrival: float, include_usage: bool, token_text=None):
        self.kind, self.request_id, self.model, self.fingerprint = kind, request_id, model, fingerprint
        self.deltas, self.token_text = deltas, token_text
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

    async def _pieces(self) -> AsyncIterator[tuple[str, list | None]]:
        """(text, OpenAI logprob entries or None) per delta that carries either."""
        delta = self._first
        while True:
            self.completion_tokens += len(delta.token_ids)
            if delta.finish_reason is not None:
                self.finish_reason = openai_finish_reason(delta.finish_reason)
            entries = self._logprob_entries(getattr(delta, "logprobs", None))
            if delta.text or entries:
                yield delta.text, entries
            if self.finish_reason is not None:
                return
            delta = await self.deltas.__anext__()

    def _logprob_entries(self, logprobs) -> list | None:
        if not logprobs or self.token_text is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}

        return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in logprobs]

    async def collect(self) -> dict:
        texts, entries = [], None
        async for text, piece_entries in self._pieces():
            texts.append(text)
            if piece_entries is not None:
                entries = (entries or []) + piece_entries
        logprobs = {"content": entries, "refusal": None} if entries is not None else None
        return completion_body(self.kind, self.request_id, self.model, self.fingerprint, self.created, "".join(texts),
                               self.finish_reason, self.prompt_tokens, self.completion_tokens, logprobs)

    def record(self, metrics: ServeMetrics, endpoint: str) -> None:
        metrics.record_success(endpoint, self.arrival, self.first_token_at, time.monotonic(), self.prompt_tokens,
                               self.completion_tokens)

    async def sse(self, metrics: ServeMetrics, endpoint: str) -> AsyncIterator[str]:
        def event(body: dict) -> str:
            return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

        def chunk(delta, finish=None, usage_value=None, entries=None) -> str:
            logprobs = {"content": entries, "refusal": None} if entries is not None else None
            return event(chunk_body(self.kind, self.request_id, self.model, self.fingerprint, self.created, delta,
                                    finish, logprobs=logprobs, with_usage_field=self.include_usage,
                                    usage_value=usage_value))

        key = "content" if self.kind == "chat" else "text"
        try:
            if self.kind == "chat":
                yield chunk({"role": "assistant", "content": ""})
            async for text, entries in self._pieces():
                yield chunk({key: text}, entries=entries)
            yield chunk({} if self.kind == "chat" else {"text": ""}, self.finish_reason)
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
