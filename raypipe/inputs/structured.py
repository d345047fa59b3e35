"""`StructuredOutput`: the one constraint a request puts on the shape of its output text.

The kinds are vLLM's `structured_outputs` fields (`json`, `json_object`, `regex`, `choice`,
`grammar`), which OpenAI's `response_format` and vLLM's older `guided_*` names map onto
(`raypipe.serve.openai.conversion`). This module only checks the request's shape; whether a
schema, regex or grammar compiles is decided by the grammar engine (`raypipe.decode.grammar`),
which needs the model's tokenizer, and is reported as an `InvalidInput` naming the problem.
Frozen and hashable by value, so equal constraints share one compiled grammar.
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

    def __post_init__(self):
        if isinstance(self.json, (dict, bool)):
            object.__setattr__(self, "json", _dumps(self.json))
        elif self.json is not None:
            if not isinstance(self.json, str):
                _fail("json", f"must be a JSON schema object, got {type(self.json).__name__}")
            try:
                object.__setattr__(self, "json", _dumps(json.loads(self.json)))
            except ValueError as exc:
                _fail("json", f"is not valid JSON: {exc}")
        if not isinstance(self.json_object, bool):
            _fail("json_object", "must be a boolean")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                _fail("choice", "must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _fail(name, "must be a non-empty string")
        used = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(used) != 1:
            _fail("", f"exactly one of {', '.join(KINDS)} must be set, got {used or 'none'}")

    @classmethod
    def of(cls, value) -> "StructuredOutput":
        """From a `StructuredOutput` or a mapping of its fields (vLLM's `structured_outputs` object)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict) or not set(value) <= set(KINDS):
            unknown = sorted(set(value) - set(KINDS)) if isinstance(value, dict) else type(value).__name__
            _fail("", f"expected an object with one of {', '.join(KINDS)}, got {unknown}")
        return cls(**value)

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))


def _dumps(schema) -> str:
    if not isinstance(schema, (dict, bool)):
        _fail("json", f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
    return json.dumps(schema, separators=(",", ":"))


def _fail(field: str, message: str):
    item = "sampling_params.structured" + (f".{field}" if field else "")
    raise InvalidInput(f"{item.rsplit('.', 1)[-1]} {message}", item=item, code="invalid_structured_output")
