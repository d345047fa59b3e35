"""Serve's HTTP proxy answers in OpenAI's error shape when the replica it forwarded a request to fails.

What Ray Serve 2.60's proxy does by itself (`HTTPProxy.send_request_to_replica` in
ray/serve/_private/proxy.py, `get_http_response_status` / `send_http_response_on_exception` in
http_util.py): it catches the replica call's error, and
- before the replica started a response: for a dead replica (`ActorDiedError`, status 500) it sends
  nothing at all, so uvicorn answers `500 Internal Server Error` in plain text; for its own 408
  (timeout), 429 (back-pressure) and 503 (no replica) it sends a plain-text page;
- after the response started (an SSE stream): it stops sending, and the connection closes mid-body
  (the client sees an incomplete chunked read: no error event, no `[DONE]`).
No Serve option changes this, and Serve does not retry a request whose replica died. The proxy's
one hook is the environment variable `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`: a function
returning Starlette middlewares that wrap the proxy's ASGI app. `middlewares()` is that function;
`CONTROLLER_OPTIONS` (for `serve.start` and config.yaml's `controller_options`) puts the variable in
the Serve controller's environment, which the proxies it starts inherit.

The middleware watches each exchange and, when the proxy is done with it:
- no response and the client still connected: a 503 `replica_unavailable` body (retryable; OpenAI's
  clients retry 503s). The ingress turns every failure of its own into a response (FastAPI answers
  even an unhandled exception), so no response at all means the replica process failed;
- an event stream left unfinished: an error event (503 `replica_unavailable`), then `data: [DONE]`;
- a plain-text error page from Ray (408, 429, 503, or Starlette's bare 500): the same status and
  message in an OpenAI body.
It buffers only those error pages, and adds no hop. It runs in the proxy actor, so it imports nothing
from `raypipe` (torch). The proxy's own endpoints (`/-/healthz`, `/-/routes`) are left alone. If the
proxy itself dies, its connections drop: no server process is left to answer them.
"""

from __future__ import annotations

import json

from raypipe.serve.error_body import REPLICA_UNAVAILABLE, REPLICA_UNAVAILABLE_MESSAGE, error_body

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "raypipe.serve.proxy_errors:middlewares"
# An actor with its own environment gets a fresh worker process, not a prestarted one; on a busy
# machine the proxy then took longer than the controller's 5 s ready check, was killed, and
# `serve.start` failed. The controller now waits as long as `serve.start` itself does (60 s).
PROXY_READY_TIMEOUT = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}
CONTROLLER_OPTIONS = {"runtime_env": {"env_vars": {PROXY_CALLBACK_ENV: PROXY_CALLBACK, **PROXY_READY_TIMEOUT}}}

# Codes for Ray's plain-text error pages, by status.
_RAY_PAGE_CODES = {404: "not_found", 408: "request_timeout", 429: "overloaded", 500: "internal_error",
                   503: REPLICA_UNAVAILABLE}


def middlewares() -> list:
    """The proxy callback (see the module docstring)."""
    from starlette.middleware import Middleware

    return [Middleware(OpenAIErrorsMiddleware)]


class OpenAIErrorsMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"].startswith("/-/"):
            await self.app(scope, receive, send)
            return
        exchange = _Exchange(receive, send)
        await self.app(scope, exchange.receive, exchange.send)
        await exchange.finish()


class _Exchange:
    """One HTTP request through the proxy: whether the client left, and what was sent to it."""

    def __init__(self, receive, send):
        self._receive, self._send = receive, send
        self.client_gone = False
        self.started = False  # a response start reached the client
        self.finished = False  # ... and its last body message too
        self.event_stream = False
        self._page: dict | None = None  # a Ray plain-text error page being collected

    async def receive(self) -> dict:
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self.client_gone = True
        return message

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            content_type = _header(message.get("headers", []), b"content-type")
            if message["status"] >= 400 and content_type.startswith(b"text/plain"):
                self._page = {"status": message["status"], "headers": message.get("headers", []), "body": b""}
                return
            self.started = True
            self.event_stream = content_type.startswith(b"text/event-stream")
        elif message["type"] == "http.response.body":
            if self._page is not None and not self.started:
                self._page["body"] += message.get("body", b"")
                if not message.get("more_body", False):
                    await self._answer(self._page["status"], self._page["body"].decode("utf-8", "replace")[:500],
                                       _RAY_PAGE_CODES.get(self._page["status"], "http_error"), self._page["headers"])
                return
            self.finished = not message.get("more_body", False)
        await self._send(message)

    async def finish(self) -> None:
        """After the proxy returned: complete what it left unanswered or unfinished."""
        if self.client_gone or self.finished:
            return
        if not self.started:
            await self._answer(503, REPLICA_UNAVAILABLE_MESSAGE, REPLICA_UNAVAILABLE)
        elif self.event_stream:
            error = json.dumps(error_body(503, REPLICA_UNAVAILABLE_MESSAGE, REPLICA_UNAVAILABLE), separators=(",", ":"))
            await self._send({"type": "http.response.body", "body": f"data: {error}\n\ndata: [DONE]\n\n".encode(),
                              "more_body": False})
            self.finished = True
        # A started response of another kind cannot be amended: the connection closes, as without us.

    async def _answer(self, status: int, message: str, code: str, ray_headers: list | None = None) -> None:
        body = json.dumps(error_body(status, message.strip() or code, code), separators=(",", ":")).encode()
        kept = [(k, v) for k, v in ray_headers or [] if bytes(k).lower() not in (b"content-type", b"content-length")]
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *kept]
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})
        self.started = self.finished = True


def _header(headers, name: bytes) -> bytes:
    return next((bytes(v).lower() for k, v in headers if bytes(k).lower() == name), b"")
