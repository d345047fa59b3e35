"""One choice's decoder stream that outlives the Decoder replica running it.

When that replica dies mid-stream (its process killed, its node gone), the ingress still holds what the
stream delivered: the output token ids and how many characters of their text went out. It calls the
deployment again with them (`Resume`); Serve's router picks a live replica (with the prompt's
prefix-affinity key, so one holding the prompt's blocks is preferred), whose engine recomputes prompt and
output and continues from there (decode/resume.py). The client sees one stream, with the tokens one replica
gives (greedy and seeded alike). A replica lost before the first token is the same call sent again.

A resumed call the router sends to a replica that is dead too (it has not noticed yet) fails the same way:
each attempt waits a moment first, at most `MAX_RESUMES` per choice; then the error reaches the client as
before (a 503 it may retry). A refusal, an engine failure or a full queue is no replica death: never resumed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from raypipe.decode.resume import Resume
from raypipe.decode.sequence import RequestDelta
from raypipe.serve.errors import replica_lost

MAX_RESUMES = 3
RESUME_PAUSES_S = (0.25, 1.0, 3.0)  # before each attempt: time for Serve to learn the replica died


class ResumableStream:
    """`start(resume)` makes the decoder call (a streaming response); `resume` None: from the start."""

    def __init__(self, start: Callable[[Resume | None], object], on_resume: Callable[[], None] = lambda: None):
        self._start, self._on_resume = start, on_resume
        self._stream = start(None)
        self._ids: list[int] = []
        self._sent_chars = 0
        self._cached_tokens: int | None = None  # the first replica's: a resume's hit covers output tokens too
        self.resumes = 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        while True:
            try:
                item = await self._stream.__anext__()
            except StopAsyncIteration:
                raise
            except Exception as exc:  # noqa: BLE001 - only a lost replica is resumed; the rest is raised as it is
                if not replica_lost(exc) or self.resumes >= MAX_RESUMES:
                    raise
                await asyncio.sleep(RESUME_PAUSES_S[self.resumes])
                self.resumes += 1
                self._on_resume()
                self._stream = self._start(Resume(tuple(self._ids), self._sent_chars) if self._ids else None)
                continue
            if isinstance(item, RequestDelta):
                self._ids += item.token_ids
                self._sent_chars += len(item.text)
                if self._cached_tokens is None:
                    self._cached_tokens = item.num_cached_tokens
                item.num_cached_tokens = self._cached_tokens
            return item

    def cancel(self) -> None:
        self._stream.cancel()
