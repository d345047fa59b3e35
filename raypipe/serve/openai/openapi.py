"""The request models' JSON schemas in the app's OpenAPI document (`/openapi.json`, `/docs`).

The routes read the raw body themselves (`parsing.parse_request`: limits, OpenAI's error shapes), so
FastAPI sees no body parameter and would publish empty schemas. Each route names its model here
(`request_body`) and `install_schemas` puts the models' shared definitions under
`components/schemas`, where the references point.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def request_body(model: type[BaseModel]) -> dict:
    """A route's `openapi_extra`: its JSON body is `model`."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def install_schemas(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Serve `models` (and every model they use) under `components/schemas` of `app`'s OpenAPI document."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template=_REF)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi
