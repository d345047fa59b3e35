"""`StructuredOutput`: the one constraint a request puts on the shape of its output text.

The kinds are vLLM's `structured_outputs` fields (`json`, `json_object`, `regex`, `choice`,
`grammar`), which OpenAI's `response_format` and vLLM's older `guided_*` names map onto
(`raypipe.serve.openai.conversion`). This module only checks the request's shape; whether a
schema, regex or grammar compiles is decided by the grammar engine (`raypipe.decode.grammar`),
which needs the model's tokenizer, and is reported as an `InvalidInput` naming the problem.
With `thinking_end` set, the constraint applies to the answer after a thinking block the model
writes freely first (`grammar_worker.after_thinking`). Frozen and hashable by value, so equal
constraints share one compiled grammar; `source` (the request
field the constraint came from, named in errors) takes no part in equality.

A JSON number with an integral value is read as an integer (`"maxItems": 1e9` is 1000000000): JSON
Schema counts 1.0 and 1e9 as integers, while llguidance refuses a float where it wants a count.
"""

from __future__ import annotations

import dataclasses
import json

from raypipe.errors import InvalidInput

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True, slots=True)
class StructuredOutput:
    json: str | None = None  # a JSON schema, serialized (property order is kept: it is the output's order)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # exactly one of these strings
    grammar: str | None = None  # a Lark grammar (llguidance's dialect)
    # The request field errors name ("guided_json", "response_format.json_schema.schema"); None: the
    # engine API's `sampling_params.structured.<kind>`.
    source: str | None = dataclasses.field(default=None, compare=False)
    # Constraints embedded in this one, each with its own `source` (a tool-call grammar's argument schemas):
    # when this one is refused, the first of them refused on its own is named instead.
    parts: tuple["StructuredOutput", ...] = dataclasses.field(default=(), compare=False)
    # The token that closes a free thinking block before the constrained answer (`</think>`, set by the chat
    # endpoint for a model that thinks, `raypipe.models.reasoning`); None: constrained from the first token.
    thinking_end: str | None = None

    def __post_init__(self):
        if self.json is not None:
            object.__setattr__(self, "json", self._normalized_schema())
        if not isinstance(self.json_object, bool):
            self._fail("json_object", "must be a boolean")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                self._fail("choice", "must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                self._fail(name, "must be a non-empty string")
        used = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(used) != 1:
            self._fail("", f"exactly one of {', '.join(KINDS)} must be set, got {used or 'none'}")

    @classmethod
    def of(cls, value) -> "StructuredOutput":
        """From a `StructuredOutput` or a mapping of its fields (vLLM's `structured_outputs` object)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict) or not set(value) <= set(KINDS):
            unknown = sorted(set(value) - set(KINDS)) if isinstance(value, dict) else type(value).__name__
            raise InvalidInput(f"expected an object with one of {', '.join(KINDS)}, got {unknown}",
                               item="sampling_params.structured", code="invalid_structured_output")
        return cls(**value)

    def _normalized_schema(self) -> str:
        """`json` as compact JSON text with integral numbers as integers."""
        if not isinstance(self.json, (str, dict, bool)):
            self._fail("json", f"must be a JSON schema (an object or a boolean), got {type(self.json).__name__}")
        try:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            try:
                schema = json.loads(text, parse_float=_number)
            except ValueError as exc:
                self._fail("json", f"is not valid JSON: {exc}")
            if not isinstance(schema, (dict, bool)):
                self._fail("json", f"must be a JSON schema (an object or a boolean), got {type(schema).__name__}")
            return json.dumps(schema, separators=(",", ":"))
        except RecursionError:
            raise InvalidInput("the schema nests too deep to read", item=self.source or "sampling_params.structured.json",
                               code="grammar_too_complex") from None

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def field(self) -> str:
        """The request field an error about this constraint names."""
        return self.source or f"sampling_params.structured.{self.kind}"

    def _fail(self, field: str, message: str):
        item = self.source or "sampling_params.structured" + (f".{field}" if field else "")
        raise InvalidInput(message, item=item, code="invalid_structured_output")


def _number(text: str) -> int | float:
    """A JSON number with a fraction or exponent: an int when its value is integral (and exactly so)."""
    value = float(text)
    return int(value) if value.is_integer() and abs(value) < 2**53 else value
