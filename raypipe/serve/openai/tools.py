"""Function tools in Qwen2.5's format: the constraint that forces calls, and the parser that finds them.

Qwen2.5 (and Hermes-style models) write a call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
several calls one per line. `tool_choice` "required" or a named function constrains generation to
exactly that (a Lark grammar whose call bodies are the tools' JSON schemas, through the same
`StructuredOutput` machinery as `response_format`); "auto" leaves the model free and parses what it
wrote. The parse is all or nothing, as vLLM's Hermes parser is for a finished text: text before
the first `<tool_call>` is content, and the rest must be well-formed calls of known functions with
object arguments, else the whole text stays content (a model that half-wrote a call has not called).
An answer cut by `max_tokens` inside a call (`cut`) keeps the calls it finished: the unfinished one
is dropped, not returned as `<tool_call>` text beside them.
"""

from __future__ import annotations

import json
import re
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# Qwen2.5's own separators (json.dumps defaults), so constrained calls look like the model's.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_BLOCK = re.compile(r"\s*<tool_call>(.*?)</tool_call>", re.S)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_grammar(functions: dict[str, dict], parallel: bool) -> str:
    """Lark grammar (llguidance's dialect) for one call, or one or more when `parallel`, of `functions`
    (name -> JSON schema of its arguments)."""
    # Each arguments schema moves whole under the call body's `$defs` and is referenced from there, its
    # own `#...` references rebased onto it: nested in place, `#/$defs/x` would name the body's root.
    defs = {f"tool{i}": _rebase(schema, f"#/$defs/tool{i}") for i, schema in enumerate(functions.values())}
    bodies = [{"type": "object", "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/tool{i}"}},
               "required": ["name", "arguments"], "additionalProperties": False}
              for i, name in enumerate(functions)]
    body = {**(bodies[0] if len(bodies) == 1 else {"anyOf": bodies}), "$defs": defs}
    repeat = ' ("\\n" call)*' if parallel else ""
    return (f"start: call{repeat}\n"
            f"call: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}\n"
            f"body: %json {json.dumps({**body, 'x-guidance': _JSON_OPTIONS})}")


# Keywords whose values are data, not schemas: a "$ref" key inside them is no reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _rebase(schema, base: str):
    """`schema` with every local reference (`#`, `#/...`) made relative to `base` instead of its root."""
    if isinstance(schema, list):
        return [_rebase(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return {key: (base + value[1:] if key == "$ref" and isinstance(value, str) and value.startswith("#")
                  else value if key in _DATA_KEYWORDS else _rebase(value, base))
            for key, value in schema.items()}


def parse_tool_calls(text: str, names: set[str], cut: bool = False) -> tuple[str | None, list[dict]] | None:
    """(content or None, OpenAI `tool_calls`) when `text` calls tools well-formed, else None (all content);
    `cut`: the text stopped at `max_tokens`, so an unfinished last call after finished ones is dropped."""
    start = text.find(OPEN)
    if start < 0:
        return None
    calls, end = [], start
    for match in _BLOCK.finditer(text, start):
        if match.start() != end:
            return None
        call = _call(match.group(1), names)
        if call is None:
            return None
        calls.append(call)
        end = match.end()
    rest = text[end:].strip()
    if not calls or rest and not (cut and _unfinished_call(rest)):
        return None
    return (text[:start] or None), calls


def _unfinished_call(rest: str) -> bool:
    """Whether `rest` is the start of a call that never closed (or of its opening tag)."""
    return (rest.startswith(OPEN) or OPEN.startswith(rest)) and CLOSE not in rest


def _call(body: str, names: set[str]) -> dict | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or set(value) != {"name", "arguments"} or value["name"] not in names \
            or not isinstance(value["arguments"], dict):
        return None
    return {"id": call_id(), "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(value["arguments"], ensure_ascii=False)}}


class ToolCallStream:
    """Streamed text split into content to send now and calls found at the end.

    Content goes out as it comes until a `<tool_call>` may be starting; from there on the text is
    held, and at the end parsed by `parse_tool_calls` (so the stream says what the body would):
    calls, or the held text as content after all.
    """

    def __init__(self, names: set[str]):
        self.names, self.text, self.sent = names, "", 0

    def feed(self, piece: str) -> str:
        self.text += piece
        start = self.text.find(OPEN, self.sent)
        if start < 0:  # hold back a tail that could be the start of `<tool_call>`
            start = next((i for i in range(max(self.sent, len(self.text) - len(OPEN) + 1), len(self.text))
                          if OPEN.startswith(self.text[i:])), len(self.text))
        out, self.sent = self.text[self.sent:start], max(self.sent, start)
        return out

    def finish(self, cut: bool = False) -> tuple[str, list[dict]]:
        """(content not sent yet, calls); `cut` as for `parse_tool_calls`."""
        parsed = parse_tool_calls(self.text, self.names, cut)
        if parsed is None:
            return self.text[self.sent:], []
        return "", parsed[1]
