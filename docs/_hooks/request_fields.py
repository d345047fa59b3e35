"""MkDocs hook: the Serving page's request-field tables, generated from the endpoint's pydantic models.

The page holds a marker, `<!-- request-fields -->`; at build time it becomes one table per request
body (`ChatCompletionRequest`, `CompletionRequest`) with every field those models accept, nested
objects as `parent.child` rows, each with its type, its bounds and the comment written beside it in
`raypipe/serve/openai/schemas.py`. The table is read from the code on every build, so it cannot drift
from what the endpoint accepts (tests/test_docs.py builds the site and checks every field is there).
"""

from __future__ import annotations

import inspect
import io
import re
import tokenize
import typing

MARKER = "<!-- request-fields -->"
BODIES = {"POST /v1/chat/completions": "ChatCompletionRequest", "POST /v1/completions": "CompletionRequest",
          "POST /v1/responses": "responses.ResponsesRequest",
          "POST /tokenize (a text prompt)": "TokenizeCompletionRequest", "POST /detokenize": "DetokenizeRequest"}


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())


def render() -> str:
    from raypipe.serve.openai import responses, schemas

    sections = []
    for route, name in BODIES.items():
        module, _, name = name.rpartition(".")
        model = getattr(responses if module == "responses" else schemas, name)
        rows = ["| field | type | bounds | notes |", "|---|---|---|---|"]
        rows += [f"| `{path}` | {_type(field.annotation)} | {_bounds(field)} | {_escape(note)} |"
                 for path, field, note in request_fields(model)]
        sections.append(f"### `{route}` ({name})\n\n" + "\n".join(rows))
    return "\n\n".join(sections)


def request_fields(model, prefix: str = "", seen: tuple = ()):
    """(dotted path, pydantic field, source comment) of every field `model` accepts, nested models included."""
    comments = _field_comments(model)
    for name, field in model.model_fields.items():
        key = field.alias or name
        path = f"{prefix}{key}"
        yield path, field, comments.get(name, "")
        for nested, many in _nested_models(field.annotation):
            if nested not in seen:
                yield from request_fields(nested, f"{path}{'[]' if many else ''}.", seen + (model,))


def _nested_models(annotation, many: bool = False):
    """The pydantic models inside a field's type, with whether they sit inside a list."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, many
        return
    origin = typing.get_origin(annotation)
    for arg in typing.get_args(annotation):
        yield from _nested_models(arg, many or origin is list)


def _field_comments(model) -> dict[str, str]:
    """Field name -> the comment on its line (or the comment lines right above it) in the model's class body."""
    comments: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if "model_fields" not in vars(cls) and cls is not model and not hasattr(cls, "__annotations__"):
            continue
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        above: list[str] = []
        lines = source.splitlines()
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type != tokenize.COMMENT:
                continue
            line = lines[token.start[0] - 1]
            match = re.match(r"\s+(\w+)\s*:", line)
            text = token.string.lstrip("#").strip()
            if match and token.start[1] > line.index(":"):
                comments[match[1]] = " ".join(above + [text])
                above = []
            elif line.strip().startswith("#"):
                above.append(text)
                following = lines[token.start[0]] if token.start[0] < len(lines) else ""
                field = re.match(r"\s+(\w+)\s*:", following)
                if field and "#" not in following:
                    comments[field[1]] = " ".join(above)
                    above = []
    return comments


def _type(annotation) -> str:
    text = re.sub(r"\b[\w.]+\.(\w+)", r"\1", str(annotation).replace("typing.", ""))
    text = re.sub(r"Annotated\[(.*?), FieldInfo\(.*?\)\]", r"\1", text)  # discriminated unions: the union
    text = re.sub(r"Annotated\[(\w+), Tag\(tag='[^']*'\)\]", r"\1", text)  # ... tagged by a function: the members
    text = re.sub(r"Annotated\[Union\[(.*?)\], Discriminator\(.*?\)\]", lambda m: m[1].replace(", ", " | "), text)
    text = text.replace("NoneType", "null").replace("<class '", "").replace("'>", "")
    return _escape(text)


def _bounds(field) -> str:
    names = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "min length", "max_length": "max length",
             "pattern": "pattern"}
    found = []
    for item in field.metadata:
        for attr, label in names.items():
            value = getattr(item, attr, None)
            if value is not None:
                found.append(f"{label} {value}")
    if field.is_required():
        found.insert(0, "required")
    return _escape(", ".join(found))


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
