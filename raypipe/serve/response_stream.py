"""A chat completion's stream told as an OpenAI Responses API response: its output items, its events, its body.

The chat stream's chunks (`CompletionStream.choice_chunks`: thinking, text, tool calls, the finish reason)
are translated one by one, streamed or not, so a streamed response and a whole one hold the same items:
- thinking becomes a `reasoning` item (its text as `reasoning_text` content; no summary is made);
- text becomes a `message` item with one `output_text` part (with `logprobs` when `include` asks);
- each tool call becomes a `function_call` item (`call_id` is the id a `function_call_output` answers).

Streamed, each item is announced (`response.output_item.added`), filled (`...delta`) and closed (`...done`,
`response.output_item.done`), between `response.created` / `response.in_progress` and
`response.completed` (`response.incomplete` when `max_output_tokens` cut it), each event with its
`sequence_number`, as OpenAI sends them. A failure after the stream started is an `error` event.
`usage.output_tokens_details.reasoning_tokens` is 0: the engine does not count thinking tokens apart.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from raypipe.serve.errors import ApiError
from raypipe.serve.metrics import ServeMetrics
from raypipe.serve.openai.responses import ResponsesRequest
from raypipe.serve.streaming import CompletionStream


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseTurn:
    """One `/v1/responses` request's answer, from the chat `stream` made for it; `on_done(output_message)` gets
    the answer as a chat assistant message once it is complete (the store keeps the conversation)."""

    def __init__(self, request: ResponsesRequest, response_id: str, model: str, stream: CompletionStream,
                 on_done: Callable[[dict], object]):
        self.request, self.id, self.model, self.stream, self.on_done = request, response_id, model, stream, on_done
        self.created = int(time.time())
        self.output: list[dict] = []
        self._open: dict | None = None  # the item being filled
        self._text: list[str] = []  # its text so far
        self._logprobs: list[dict] = []
        self._sequence = 0
        self.status, self.incomplete = "in_progress", None

    # --- the whole response -------------------------------------------------------------------

    async def collect(self) -> dict:
        async for _ in self._events():
            pass
        return self.body()

    async def sse(self, metrics: ServeMetrics, endpoint: str) -> AsyncIterator[str]:
        try:
            async for event in self._events():
                yield f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"
            self.record(metrics, endpoint)
        except Exception as exc:  # noqa: BLE001 - the status line is sent already: report in-band
            error = ApiError.from_exception(exc)
            metrics.record_error(endpoint, error.status, error.code)
            event = self._event("error", code=error.code, message=error.message, param=error.param)
            yield f"event: error\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"

    def record(self, metrics: ServeMetrics, endpoint: str) -> None:
        self.stream.record(metrics, endpoint)

    def body(self) -> dict:
        r, stream = self.request, self.stream
        form = r.text.format.model_dump(by_alias=True, exclude_none=True) if r.text and r.text.format else \
            {"type": "text"}
        usage = None
        if self.status != "in_progress":
            usage = {"input_tokens": stream.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": stream.cached_tokens},
                     "output_tokens": stream.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": stream.prompt_tokens + stream.completion_tokens}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": self.status,
                "background": False, "error": None, "incomplete_details": self.incomplete,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
                "max_tool_calls": r.max_tool_calls, "model": self.model, "output": list(self.output),
                "parallel_tool_calls": r.parallel_tool_calls is not False,
                "previous_response_id": r.previous_response_id,
                "reasoning": {"effort": r.reasoning.effort if r.reasoning else None, "summary": None},
                "service_tier": "default", "store": r.stored,
                "temperature": r.temperature if r.temperature is not None else 1.0,
                "text": {"format": form}, "tool_choice": _choice_body(r.tool_choice),
                "tools": [tool.model_dump(exclude_none=True) for tool in r.tools or ()],
                "top_logprobs": r.top_logprobs or 0, "top_p": r.top_p if r.top_p is not None else 1.0,
                "truncation": r.truncation or "disabled", "usage": usage, "user": r.user,
                "metadata": r.metadata or {}}

    # --- chat chunks to items and events ----------------------------------------------------------

    async def _events(self) -> AsyncIterator[dict]:
        try:
            async for event in self._translated():
                yield event
        finally:  # a client gone mid-stream, or a failure: stop the decoder call (it frees its row)
            self.stream.cancel_unfinished()

    async def _translated(self) -> AsyncIterator[dict]:
        yield self._event("response.created", response=self.body())
        yield self._event("response.in_progress", response=self.body())
        finish = None
        async for _, delta, finish_reason, entries in self.stream.choice_chunks(self.stream.choices[0]):
            finish = finish_reason or finish
            for event in self._feed(delta, entries or []):
                yield event
        for event in self._close():
            yield event
        if finish == "length":
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.status = "completed"
        self.on_done(self._answer())
        yield self._event(f"response.{self.status}", response=self.body())

    def _feed(self, delta: dict, entries: list[dict]) -> list[dict]:
        events = []
        if delta.get("reasoning_content"):
            events += self._ensure("reasoning")
            events.append(self._text_delta("response.reasoning_text.delta", delta["reasoning_content"]))
        if delta.get("content"):
            events += self._ensure("message")
            events.append(self._text_delta("response.output_text.delta", delta["content"], entries))
        for call in delta.get("tool_calls") or ():
            if "id" in call:  # a call's first chunk: its id and name
                events += self._close()
                events += self._open_item({"type": "function_call", "id": new_id("fc"), "call_id": call["id"],
                                           "name": call["function"]["name"], "arguments": "",
                                           "status": "in_progress"})
            else:
                events.append(self._text_delta("response.function_call_arguments.delta",
                                               call["function"]["arguments"]))
        return events

    def _ensure(self, kind: str) -> list[dict]:
        if self._open is not None and self._open["type"] == kind:
            return []
        events = self._close()
        if kind == "reasoning":
            return events + self._open_item({"type": "reasoning", "id": new_id("rs"), "summary": [], "content": []})
        events += self._open_item({"type": "message", "id": new_id("msg"), "status": "in_progress",
                                   "role": "assistant", "content": []})
        return events + [self._event("response.content_part.added", item_id=self._open["id"],
                                     output_index=len(self.output), content_index=0, part=self._part(""))]

    def _open_item(self, item: dict) -> list[dict]:
        self._open, self._text, self._logprobs = item, [], []
        return [self._event("response.output_item.added", output_index=len(self.output), item=dict(item))]

    def _text_delta(self, kind: str, text: str, entries: list[dict] | None = None) -> dict:
        self._text.append(text)
        fields = {"item_id": self._open["id"], "output_index": len(self.output), "delta": text}
        if kind != "response.function_call_arguments.delta":
            fields["content_index"] = 0
        if kind == "response.output_text.delta":
            self._logprobs += entries or []
            fields["logprobs"] = entries or []
        return self._event(kind, **fields)

    def _close(self) -> list[dict]:
        item = self._open
        if item is None:
            return []
        self._open, text, index = None, "".join(self._text), len(self.output)
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            events = [self._event("response.reasoning_text.done", **where, content_index=0, text=text)]
        elif item["type"] == "message":
            part = self._part(text, self._logprobs)
            item.update(status="completed", content=[part])
            events = [self._event("response.output_text.done", **where, content_index=0, text=text,
                                  logprobs=part["logprobs"]),
                      self._event("response.content_part.done", **where, content_index=0, part=part)]
        else:
            item.update(arguments=text, status="completed")
            events = [self._event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=text)]
        self.output.append(item)
        return events + [self._event("response.output_item.done", output_index=index, item=item)]

    def _part(self, text: str, logprobs: list[dict] | None = None) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs or [])}

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _answer(self) -> dict:
        """The output as one chat assistant message (how the next turn's conversation holds it)."""
        message: dict = {"role": "assistant", "content": None}
        for item in self.output:
            if item["type"] == "reasoning":
                message["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message":
                message["content"] = (message["content"] or "") + item["content"][0]["text"]
            else:
                message.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})
        return message


def _choice_body(choice) -> str | dict:
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()
