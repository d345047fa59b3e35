"""The JSON this server sends back in OpenAI's shapes: completions, stream chunks, usage, ids, model cards.

`kind` is "chat" (chat.completion) or "text" (text_completion); the two differ only in the object
names and in how a choice carries its text.
"""

from __future__ import annotations

import uuid

_OBJECT = {"chat": ("chat.completion", "chat.completion.chunk"), "text": ("text_completion", "text_completion")}


def completion_id(prefix: str = "chatcmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """`cached_tokens`: prompt tokens served from the prefix cache (OpenAI's and vLLM's field)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def models_body(models: list[dict]) -> dict:
    return {"object": "list", "data": models}


def model_card(model: str, max_model_len: int, created: int, parent: str | None = None) -> dict:
    """A model's card; a LoRA adapter's names its base model as `parent` (vLLM's convention)."""
    return {"id": model, "object": "model", "created": created, "owned_by": "raypipe", "max_model_len": max_model_len,
            "parent": parent}


def choice_body(kind: str, index: int, text: str | None, finish_reason: str, logprobs: dict | None = None,
                tool_calls: list[dict] | None = None, reasoning: str | None = None, legacy: bool = False) -> dict:
    """One choice of a completion; with `tool_calls` (chat), `text` is the content before them, None if none;
    `reasoning` (chat, a model that thinks): its thinking, as vLLM's `reasoning_content`; `legacy`: the request
    named `functions`, so the first call is answered as OpenAI answers those, a `function_call`."""
    if kind == "chat":
        message = {"role": "assistant", "content": text}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if tool_calls and legacy:
            message["function_call"] = tool_calls[0]["function"]
            finish_reason = "length" if finish_reason == "length" else "function_call"
        elif tool_calls:
            message["tool_calls"] = tool_calls
        choice = {"index": index, "message": message}
    else:
        choice = {"index": index, "text": text}
    return {**choice, "logprobs": logprobs, "finish_reason": finish_reason}


def prompt_logprobs_body(entries: list, token_text) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token its id (a string key, as JSON
    writes vLLM's int keys) and its top candidates' ids -> `{"logprob", "rank", "decoded_token"}`."""
    body: list[dict | None] = []
    for entry in entries:
        if entry is None:
            body.append(None)
            continue
        ranked = {str(token): {"logprob": logprob, "rank": rank, "decoded_token": token_text(token)}
                  for rank, (token, logprob) in enumerate(entry.top, start=1)}
        ranked[str(entry.token_id)] = {"logprob": entry.logprob, "rank": entry.rank,
                                       "decoded_token": token_text(entry.token_id)}
        body.append(ranked)
    return body


def completion_body(kind: str, request_id: str, model: str, fingerprint: str, created: int, choices: list[dict],
                    prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"id": request_id, "object": _OBJECT[kind][0], "created": created, "model": model,
            "system_fingerprint": fingerprint, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def chunk_body(kind: str, request_id: str, model: str, fingerprint: str, created: int, delta: dict | None,
               finish_reason: str | None = None, *, index: int = 0, logprobs: dict | None = None,
               with_usage_field: bool = False, usage_value: dict | None = None) -> dict:
    """One stream chunk of choice `index`. `delta=None` makes the usage-only chunk (no choices); for "text",
    `delta` is `{"text": ...}`."""
    body = {"id": request_id, "object": _OBJECT[kind][1], "created": created, "model": model,
            "system_fingerprint": fingerprint}
    if delta is None:
        body["choices"] = []
    elif kind == "chat":
        body["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    else:
        body["choices"] = [{"index": index, "text": delta.get("text", ""), "logprobs": logprobs,
                            "finish_reason": finish_reason}]
    if with_usage_field:  # with include_usage, every chunk carries `usage` (null until the last)
        body["usage"] = usage_value
    return body
