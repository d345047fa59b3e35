"""JSON schemas the structured-output tests and `raypipe bench structured` run: bounded in size so a random-weight
model finishes them."""

SCHEMAS = {
    "flat": {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
             "required": ["id", "ok"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"enum": [1, 2, 3]}},
             "required": ["color", "size"], "additionalProperties": False},
    "bounded_numbers": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 65},
        "score": {"type": "integer", "exclusiveMinimum": -5, "maximum": 5}},
        "required": ["age", "score"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
                "required": ["code"], "additionalProperties": False},
    "short_string": {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 6}},
                     "required": ["name"], "additionalProperties": False},
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
              "maxItems": 4},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                  "admin": {"type": "boolean"}},
                 "required": ["id", "admin"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "optional_fields": {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"},
                                                         "c": {"enum": ["x", "y"]}},
                        "required": ["a"], "additionalProperties": False},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"k": {"enum": ["p", "q"]}, "v": {"type": "integer", "minimum": 0,
                                                                        "maximum": 3}},
        "required": ["k", "v"], "additionalProperties": False}},
    "any_of": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, {"enum": ["none", "all"]}]},
    "const_and_tuple": {"type": "object", "properties": {
        "version": {"const": 2}, "point": {"type": "array", "prefixItems": [{"type": "integer", "maximum": 9,
                                                                              "minimum": 0},
                                                                             {"type": "boolean"}],
                                           "items": False, "minItems": 2}},
        "required": ["version", "point"], "additionalProperties": False},
}

BAD_SCHEMAS = {
    "unknown type": ({"type": "objectx"}, "objectx"),
    "bad pattern": ({"type": "string", "pattern": "[a-"}, "unclosed character class"),
    "minimum above maximum": ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
}
