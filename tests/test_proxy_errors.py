"""The proxy middleware (raypipe/serve/proxy_errors.py) against the ASGI messages Ray Serve 2.60's proxy sends.

Each fake proxy app below replays what `HTTPProxy.send_request_to_replica` sends in one case (read
from ray/serve/_private/proxy.py and http_util.py); tests/test_serve_api.py kills a real ingress.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from raypipe.serve.proxy_errors import PROXY_CALLBACK, OpenAIErrorsMiddleware, middlewares


def exchange(proxy_app, path="/v1/chat/completions", client_leaves=False) -> list[dict]:
    """Run one request through the middleware around `proxy_app`; the messages the client got."""
    sent: list[dict] = []

    async def receive():
        if client_leaves:
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)  # the client keeps the connection open

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path, "method": "POST", "headers": []}
    asyncio.run(OpenAIErrorsMiddleware(proxy_app)(scope, receive, send))
    return sent


def body_of(sent: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def start(status: int, content_type: bytes, *extra) -> dict:
    return {"type": "http.response.start", "status": status, "headers": [[b"content-type", content_type], *extra]}


async def dead_replica(scope, receive, send):
    """The replica died before answering: the proxy logs a 500 and sends nothing."""


def test_no_response_becomes_a_retryable_503_json():
    sent = exchange(dead_replica)
    assert sent[0]["status"] == 503 and dict(sent[0]["headers"])[b"content-type"] == b"application/json"
    error = json.loads(body_of(sent))["error"]
    assert error["code"] == "replica_unavailable" and error["type"] == "service_unavailable" and error["message"]
    assert sent[-1]["more_body"] is False


def test_client_that_left_gets_nothing_more():
    async def proxy(scope, receive, send):
        await receive()  # the proxy reads the disconnect, cancels the replica call, sends nothing

    assert exchange(proxy, client_leaves=True) == []


def test_cut_event_stream_ends_with_error_event_then_done():
    streamed = b'data: {"choices":[]}\n\n'

    async def proxy(scope, receive, send):
        await send(start(200, b"text/event-stream; charset=utf-8"))
        await send({"type": "http.response.body", "body": streamed, "more_body": True})

    sent = exchange(proxy)
    assert sent[0]["status"] == 200 and sent[-1]["more_body"] is False
    events = [e.removeprefix("data: ") for e in body_of(sent).decode().split("\n\n") if e]
    assert events[0] == streamed.decode().strip().removeprefix("data: ")
    assert json.loads(events[1])["error"]["code"] == "replica_unavailable" and events[2] == "[DONE]"


def test_finished_responses_pass_through_untouched():
    messages = [start(200, b"text/event-stream"), {"type": "http.response.body", "body": b"data: [DONE]\n\n",
                                                   "more_body": True},
                {"type": "http.response.body", "body": b"", "more_body": False}]

    async def proxy(scope, receive, send):
        for message in messages:
            await send(message)

    assert exchange(proxy) == messages
    error_json = [start(400, b"application/json"), {"type": "http.response.body", "body": b'{"error":{}}'}]

    async def app_error(scope, receive, send):
        for message in error_json:
            await send(message)

    assert exchange(app_error) == error_json  # the app's own errors are already OpenAI bodies


@pytest.mark.parametrize("status,text,code", [(429, b"Request dropped due to backpressure", "overloaded"),
                                               (408, b"Request abc timed out after 600s.", "request_timeout"),
                                               (503, b"No replicas are available yet.", "replica_unavailable")])
def test_ray_plain_text_pages_become_openai_bodies(status, text, code):
    async def proxy(scope, receive, send):
        await send(start(status, b"text/plain; charset=utf-8", [b"retry-after", b"2"]))
        await send({"type": "http.response.body", "body": text})

    sent = exchange(proxy)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    headers = {bytes(k): bytes(v) for k, v in sent[0]["headers"]}
    assert sent[0]["status"] == status and headers[b"content-type"] == b"application/json"
    assert headers[b"retry-after"] == b"2" and int(headers[b"content-length"]) == len(body_of(sent))
    error = json.loads(body_of(sent))["error"]
    assert error["message"] == text.decode() and error["code"] == code and error["type"] and error["param"] is None


def test_proxy_own_endpoints_are_left_alone():
    assert exchange(dead_replica, path="/-/healthz") == []


def test_callback_is_what_ray_loads():
    from ray.serve._private.http_util import validate_http_proxy_callback_return
    from ray.serve._private.utils import call_function_from_import_path

    [middleware] = validate_http_proxy_callback_return(call_function_from_import_path(PROXY_CALLBACK))
    assert middleware.cls is OpenAIErrorsMiddleware and middlewares()[0].cls is OpenAIErrorsMiddleware


def test_config_yaml_sets_what_raypipe_serve_sets():
    from raypipe.serve.kuberay import load_serve_config
    from raypipe.serve.proxy_errors import CONTROLLER_OPTIONS

    assert load_serve_config()["controller_options"] == CONTROLLER_OPTIONS
