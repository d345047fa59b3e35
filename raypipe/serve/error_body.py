"""The OpenAI error body `{"error": {"message", "type", "param", "code"}}`, with no dependencies.

Both the ingress (`raypipe.serve.errors`) and Serve's HTTP proxy (`raypipe.serve.proxy_errors`, which
runs in the proxy actor and must not import torch through `raypipe`) answer in this one shape.
"""

from __future__ import annotations

TYPE_BY_STATUS = {401: "authentication_error", 404: "invalid_request_error", 408: "timeout",
                  413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
                  500: "internal_error"}

# A process serving the request went away (Serve restarts it): the same request may succeed on retry.
REPLICA_UNAVAILABLE = "replica_unavailable"
REPLICA_UNAVAILABLE_MESSAGE = "a serving replica stopped or is unreachable; retry the request"


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict:
    kind = TYPE_BY_STATUS.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
