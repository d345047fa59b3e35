"""One request's streams of decoder deltas (one per choice), turned into an OpenAI response body or SSE chunks.

A completions request with several prompts has n choices per prompt, prompt i's at indices i*n to
i*n+n-1 (OpenAI's and vLLM's order); its usage counts every prompt once. With `echo`, a choice's text
begins with its prompt (completions) or with the assistant message it continues (chat), sent as the
choice's first content delta when streamed.

SSE order per choice (as OpenAI sends it): for chat a first chunk with the assistant role, one
chunk per non-empty text delta (or per delta with logprobs), a chunk with `finish_reason` and an
empty delta; with n > 1 the choices' chunks interleave as they come, each with its `index`. Then,
with `include_usage`, one chunk with empty `choices` and the usage of all choices, then
`data: [DONE]`. If the client goes away, the decoder calls are cancelled, which aborts the engine
requests and frees their slots. If a decoder dies mid-stream, an error event (503, retryable)
precedes `[DONE]`.

With tools (chat, `tool_choice` not "none"), each choice's text goes through
`openai.tools`: calls become `message.tool_calls` (finish reason "tool_calls"); streamed, text
that may be a call is held back and the calls go out when the choice ends, each as a chunk with
its id and function name, then one with its arguments (OpenAI's delta shape).

For a model that thinks (`thinking`: a reasoning parser and thinking not switched off), each choice's
text is first split by `models.reasoning`: the thinking block becomes `reasoning_content` (streamed as
`reasoning_content` deltas), and only the content after it is parsed for tool calls.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from raypipe.serve.errors import ApiError
from raypipe.serve.metrics import ServeMetrics
from raypipe.serve.openai.bodies import choice_body, chunk_body, completion_body, prompt_logprobs_body, usage
from raypipe.models.reasoning import ReasoningStream, split_reasoning
from raypipe.serve.openai.tools import ToolCallStream, parse_tool_calls


def openai_finish_reason(reason: str) -> str:
    # The engine may say why it stopped more precisely (eos, stop string, stop token id): all are "stop".
    return "length" if reason == "length" else "stop"


class _Choice:
    """One choice's decoder deltas, with its own token count and finish reason."""

    def __init__(self, index: int, deltas, prompt_tokens: int, echo: str):
        self.index, self.deltas = index, deltas
        self.prompt_tokens, self.echo = prompt_tokens, echo  # echo: the text its content begins with
        self.completion_tokens = 0
        self.cached_tokens = 0  # of the prompt, taken from the prefix cache (every delta says it)
        self.finish_reason: str | None = None
        self.first = None
        self.text_offset = 0  # completions' legacy logprobs: where the next token's text starts

    def echoed(self, text: str | None) -> str | None:
        return self.echo + (text or "") if self.echo else text

    def legacy_logprobs(self, entries: list[dict]) -> dict:
        """OpenAI's completions logprobs object for `entries` (chat-shaped entries of this choice's next tokens):
        each token's top candidates as token -> logprob, the sampled token first (vLLM's order)."""
        offsets = []
        for entry in entries:
            offsets.append(self.text_offset)
            self.text_offset += len(entry["token"])
        return {"tokens": [entry["token"] for entry in entries],
                "token_logprobs": [entry["logprob"] for entry in entries],
                "top_logprobs": [{entry["token"]: entry["logprob"],
                                  **{top["token"]: top["logprob"] for top in entry["top_logprobs"]
                                     if top["token"] != entry["token"]}} for entry in entries],
                "text_offset": offsets}


class CompletionStream:
    """`kind` is "chat" or "text" (see `openai.bodies`); `deltas` one decoder stream per choice, n per prompt;
    `prompt_tokens` each prompt's token count; `echo` (per prompt) the text its choices begin with;
    `token_text(id)` renders logprob tokens; `tool_names` (chat) the functions whose calls are parsed;
    `thinking` (chat) whether answers start inside a thinking block (`models.reasoning`); `legacy_functions`
    (chat) whether the tools came as `functions`, so a call is answered as a `function_call`; `continuous_usage`
    (with `include_usage`) whether every chunk carries the usage so far rather than null."""

    def __init__(self, kind: str, request_id: str, model: str, fingerprint: str, deltas: list,
                 prompt_tokens: list[int], arrival: float, include_usage: bool, token_text=None,
                 tool_names: set[str] | None = None, thinking: bool = False, legacy_functions: bool = False,
                 continuous_usage: bool = False, echo: list[str] | None = None):
        self.kind, self.request_id, self.model, self.fingerprint = kind, request_id, model, fingerprint
        self.n = len(deltas) // len(prompt_tokens)  # choices per prompt
        self.choices = [_Choice(index, stream, prompt_tokens[index // self.n], echo[index // self.n] if echo else "")
                        for index, stream in enumerate(deltas)]
        self.token_text, self.tool_names, self.thinking = token_text, tool_names, thinking and kind == "chat"
        self.legacy_functions = legacy_functions
        self.prompt_tokens, self.arrival, self.include_usage = sum(prompt_tokens), arrival, include_usage
        self.continuous_usage = continuous_usage  # vLLM's continuous_usage_stats: every chunk's usage, so far
        self.created = int(time.time())
        self.first_token_at: float | None = None

    @property
    def completion_tokens(self) -> int:
        return sum(choice.completion_tokens for choice in self.choices)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache. Each prompt is counted once in usage, and with n > 1
        each choice's sequence looked it up on its own: per prompt, the tokens every one of them took from the cache."""
        return sum(min(choice.cached_tokens for choice in self.choices[start: start + self.n])
                   for start in range(0, len(self.choices), self.n))

    async def start(self) -> None:
        """Wait for every choice's first delta (after prefill): errors before it can still become a 4xx response."""
        try:
            firsts = await asyncio.gather(*(_next_delta(choice.deltas) for choice in self.choices))
        except BaseException:
            self.cancel_unfinished()
            raise
        for choice, first in zip(self.choices, firsts):
            choice.first = first
        self.first_token_at = time.monotonic()

    def cancel_unfinished(self) -> None:
        for choice in self.choices:
            if choice.finish_reason is None:
                choice.deltas.cancel()  # stop the decoder's generator: it aborts the engine request

    async def _pieces(self, choice: _Choice) -> AsyncIterator[tuple[str, list | None]]:
        """(text, OpenAI logprob entries or None) per delta of `choice` that carries either."""
        delta = choice.first
        while True:
            choice.completion_tokens += len(delta.token_ids)
            choice.cached_tokens = delta.num_cached_tokens
            if delta.finish_reason is not None:
                choice.finish_reason = openai_finish_reason(delta.finish_reason)
            entries = self._logprob_entries(getattr(delta, "logprobs", None))
            if delta.text or entries:
                yield delta.text, entries
            if choice.finish_reason is not None:
                return
            delta = await _next_delta(choice.deltas)

    def _logprob_entries(self, logprobs) -> list | None:
        if not logprobs or self.token_text is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}

        return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in logprobs]

    def _logprobs_object(self, choice: _Choice, entries: list | None) -> dict | None:
        if entries is None:
            return None
        return {"content": entries, "refusal": None} if self.kind == "chat" else choice.legacy_logprobs(entries)

    @property
    def _parses_tools(self) -> bool:
        return self.kind == "chat" and bool(self.tool_names)

    async def collect(self) -> dict:
        try:
            choices = await asyncio.gather(*(self._collect(choice) for choice in self.choices))
        finally:
            self.cancel_unfinished()
        body = completion_body(self.kind, self.request_id, self.model, self.fingerprint, self.created, choices,
                               self.prompt_tokens, self.completion_tokens, self.cached_tokens)
        first = self.choices[0].first.prompt_logprobs
        if first is not None:  # where vLLM puts them: the chat response, each text choice (its own prompt's)
            if self.kind == "chat":
                body["prompt_logprobs"] = prompt_logprobs_body(first, self.token_text)
            else:
                for choice, shown in zip(self.choices, choices):
                    shown["prompt_logprobs"] = prompt_logprobs_body(choice.first.prompt_logprobs, self.token_text)
        return body

    async def _collect(self, choice: _Choice) -> dict:
        texts, entries = [], None
        async for text, piece_entries in self._pieces(choice):
            texts.append(text)
            if piece_entries is not None:
                entries = (entries or []) + piece_entries
        logprobs = self._logprobs_object(choice, entries)
        text = "".join(texts)
        reasoning = None
        if self.thinking:
            reasoning, text = split_reasoning(text, True)
        cut = choice.finish_reason == "length"
        parsed = parse_tool_calls(text, self.tool_names, cut) if self._parses_tools and text else None
        if parsed is not None:
            return choice_body(self.kind, choice.index, choice.echoed(parsed[0]), "length" if cut else "tool_calls",
                               logprobs, parsed[1], reasoning, self.legacy_functions)
        return choice_body(self.kind, choice.index, choice.echoed(text), choice.finish_reason, logprobs,
                           reasoning=reasoning)

    def record_routes(self, metrics: ServeMetrics) -> None:
        """Per choice (started already): the Decoder replica that runs it and what its prefix cache gave."""
        for choice in self.choices:
            metrics.record_route(choice.first.replica, choice.prompt_tokens, choice.first.num_cached_tokens)

    def record(self, metrics: ServeMetrics, endpoint: str) -> None:
        metrics.record_success(endpoint, self.arrival, self.first_token_at, time.monotonic(), self.prompt_tokens,
                               self.completion_tokens)

    async def choice_chunks(self, choice: _Choice) -> AsyncIterator[tuple[int, dict, str | None, list | None]]:
        """(choice index, delta, finish reason, logprob entries) per chunk of `choice`."""
        key = "content" if self.kind == "chat" else "text"
        if self.kind == "chat":
            yield choice.index, {"role": "assistant", "content": ""}, None, None
        if choice.echo:
            yield choice.index, {key: choice.echo}, None, None
        calls = ToolCallStream(self.tool_names) if self._parses_tools else None
        thoughts = ReasoningStream(True) if self.thinking else None
        async for text, entries in self._pieces(choice):
            if thoughts is not None:
                reasoning, text = thoughts.feed(text)
                if reasoning:
                    yield choice.index, {"reasoning_content": reasoning}, None, entries
                    entries = None
            text = calls.feed(text) if calls else text
            if text or entries:  # held-back text sends nothing yet
                yield choice.index, {key: text}, None, entries
        if thoughts is not None:
            reasoning, text = thoughts.finish()
            if reasoning:
                yield choice.index, {"reasoning_content": reasoning}, None, None
            text = calls.feed(text) if calls else text
            if text:
                yield choice.index, {key: text}, None, None
        finish = choice.finish_reason
        if calls is not None:
            rest, found = calls.finish(finish == "length")
            if rest:
                yield choice.index, {key: rest}, None, None
            if found and self.legacy_functions:  # OpenAI's delta shape for a legacy function call
                function = found[0]["function"]
                yield choice.index, {"function_call": {"name": function["name"], "arguments": ""}}, None, None
                yield choice.index, {"function_call": {"arguments": function["arguments"]}}, None, None
                found, finish = [], "length" if finish == "length" else "function_call"
            for k, call in enumerate(found):
                function = call["function"]
                yield choice.index, {"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                                     "function": {"name": function["name"], "arguments": ""}}]}, \
                    None, None
                yield choice.index, {"tool_calls": [{"index": k, "function": {"arguments": function["arguments"]}}]}, \
                    None, None
            finish = "tool_calls" if found and finish != "length" else finish
        yield choice.index, {} if self.kind == "chat" else {"text": ""}, finish, None

    async def sse(self, metrics: ServeMetrics, endpoint: str) -> AsyncIterator[str]:
        def event(body: dict) -> str:
            return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

        def chunk(delta, finish=None, index=0, usage_value=None, entries=None) -> str:
            logprobs = self._logprobs_object(self.choices[index], entries)
            return event(chunk_body(self.kind, self.request_id, self.model, self.fingerprint, self.created, delta,
                                    finish, index=index, logprobs=logprobs, with_usage_field=self.include_usage,
                                    usage_value=usage_value))

        # One choice is read directly: interleaving costs a task per chunk.
        pieces = (self.choice_chunks(self.choices[0]) if len(self.choices) == 1
                  else _interleave([self.choice_chunks(choice) for choice in self.choices]))
        try:
            async for index, delta, finish, entries in pieces:
                so_far = usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens) \
                    if self.continuous_usage else None
                yield chunk(delta, finish, index, usage_value=so_far, entries=entries)
            if self.include_usage:
                yield chunk(None, usage_value=usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens))
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
            await pieces.aclose()
            self.cancel_unfinished()


async def _next_delta(deltas):
    """The decoder stream's next delta; a refusal the Decoder handed over as a value is raised here."""
    delta = await deltas.__anext__()
    if isinstance(delta, Exception):
        raise delta
    return delta


async def _interleave(streams: list[AsyncIterator]) -> AsyncIterator:
    """Items of all `streams` as they come; each stream's own order is kept."""
    pending = {asyncio.ensure_future(stream.__anext__()): stream for stream in streams}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                stream = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(stream.__anext__())] = stream
                yield item
    finally:
        for task in pending:
            task.cancel()
