"""Static limits on a structured-output constraint, checked before any compile (microseconds to a few ms).

They refuse what is certain to be refused or to hurt later, without starting a compile: a
constraint's size in bytes, a JSON schema's nesting depth (llguidance's own JSON reader stops at
128 levels), the depth of its `$ref` chains (llguidance 1.9.1 segfaults from ~1,000), and the rules
of a Lark grammar (it segfaults from ~3,000 chained ones). The values live in `EngineConfig`
(`grammar_max_*`). The isolated compile (`raypipe.decode.grammar_pool`) is still the backstop for
everything these do not catch. Every walk is iterative: a schema nested 10,000 deep must not
overflow Python's own stack either.
"""

from __future__ import annotations

import json
import re

from raypipe.errors import InvalidInput
from raypipe.inputs.structured import StructuredOutput

# A Lark rule or terminal definition: `name:` / `?name:` / `NAME.2:` at the start of a line.
_LARK_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z_0-9]*(\.-?\d+)?[ \t]*:", re.MULTILINE)
_DEFINITION_KEYS = ("$defs", "definitions")  # reached through `$ref`s, not by nesting


def check_limits(structured: StructuredOutput, *, max_bytes: int, max_depth: int, max_ref_depth: int,
                 max_rules: int) -> None:
    """`InvalidInput` (code "grammar_too_complex", naming the limit) if `structured` exceeds one."""
    text = structured.json or structured.regex or structured.grammar or "".join(structured.choice or ())
    size = len(text.encode())
    if size > max_bytes:
        _refuse(structured, f"is {size} bytes; the limit is {max_bytes} (EngineConfig.grammar_max_bytes)")
    if structured.kind == "json":
        schema = json.loads(structured.json)
        depth = nesting_depth(schema)
        if depth > max_depth:
            _refuse(structured, f"nests {depth} levels deep; the limit is {max_depth} (EngineConfig.grammar_max_depth)")
        refs = ref_depth(schema)
        if refs > max_ref_depth:
            _refuse(structured, f"has a chain of {refs} nested $refs; the limit is {max_ref_depth} "
                                "(EngineConfig.grammar_max_ref_depth)")
    elif structured.kind == "grammar":
        rules = len(_LARK_DEFINITION.findall(structured.grammar))
        if rules > max_rules:
            _refuse(structured, f"defines {rules} rules; the limit is {max_rules} (EngineConfig.grammar_max_rules)")


def nesting_depth(value) -> int:
    """Levels of JSON arrays and objects (a scalar is 0, `{}` is 1)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def ref_depth(schema) -> int:
    """The longest chain of `$ref`s followed depth-first from the root, each target entered once.

    A chain `a -> b -> c` is 3; a recursive schema counts each definition once, so recursion alone
    is not refused. Only local references (`#/...`) are followed: llguidance resolves no others."""
    deepest, seen, stack = 0, set(), [(schema, 0)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        for ref in _refs(node):
            target = _resolve(schema, ref)
            if target is not None and id(target) not in seen:
                seen.add(id(target))
                stack.append((target, depth + 1))
    return deepest


def _refs(node) -> list[str]:
    """The `$ref` strings inside `node`, not looking into its definition tables."""
    found, stack = [], [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("$ref"), str):
                found.append(item["$ref"])
            stack.extend(value for key, value in item.items() if key not in _DEFINITION_KEYS)
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _resolve(schema, ref: str):
    if not ref.startswith("#"):
        return None
    node = schema
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _refuse(structured: StructuredOutput, why: str):
    raise InvalidInput(f"the constraint {why}", item=structured.field, code="grammar_too_complex")
