"""The OpenAI-compatible endpoint on a real local Serve (127.0.0.1), driven by the official `openai` client.

One Serve application for the whole module (tiny preset, 2 encoder workers, API key on, tight
limits so that each limit is cheap to hit); a `Pipeline` on the same Ray is the reference for
greedy outputs.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import re
import signal
import socket
import struct
import time
import zlib

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.conftest import random_images

KEY = "test-key"
MAX_MODEL_LEN = 2048
LIMITS = {"max_body_bytes": 1024 * 1024, "max_images_per_request": 4, "max_image_pixels": 1_000_000}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def png_bytes(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, "PNG")
    return out.getvalue()


def data_url(payload: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(payload).decode()}"


def image_url(h: int, w: int, seed: int = 0) -> str:
    return data_url(png_bytes(random_images([(h, w)], seed=seed)[0]))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims `width x height` with one tiny IDAT: what a decompression bomb looks like."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def user(*parts) -> list[dict]:
    content = [{"type": "text", "text": p} if not p.startswith("data:") and "://" not in p
               else {"type": "image_url", "image_url": {"url": p}} for p in parts]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def server(ray_local, tiny_ckpt):
    from ray import serve

    from deployments.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"api_key": KEY, "batch_window_s": 0.05, "limits": LIMITS,
                         "engine": {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 16}}),
              name="raypipe-test", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def pipe(ray_local, server):
    from raypipe import Pipeline
    from raypipe.decode.config import EngineConfig

    pipeline = Pipeline.from_pretrained("tiny", num_encoders=1, engine_config=EngineConfig(max_model_len=MAX_MODEL_LEN))
    yield pipeline
    pipeline.shutdown()


def metric(http: httpx.Client, name: str) -> float:
    text = http.get("/metrics").text
    match = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


# --- correct completions ----------------------------------------------------------------------

@pytest.mark.parametrize("images", [[(56, 84)], [(28, 28), (120, 64), (84, 196)]], ids=["one-image", "three-images"])
def test_greedy_matches_pipeline_generate(client, pipe, images):
    from raypipe import SamplingParams

    messages = user("Describe:", *[image_url(h, w, seed=i) for i, (h, w) in enumerate(images)], "briefly.")
    response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    [expected] = pipe.generate([messages], SamplingParams(max_tokens=20, temperature=0.0))

    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == ("length" if expected.finish_reason == "length" else "stop")
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)  # image tokens included
    assert response.usage.prompt_tokens > expected.num_image_tokens > 0
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens

    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == response.usage  # the usage chunk comes last


def test_text_only_finish_reasons_and_stop(client):
    messages = user("Say something.")
    full = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=24, temperature=0)
    short = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    assert full.choices[0].message.content.startswith(short.choices[0].message.content)
    text = full.choices[0].message.content
    stop = text[4:6]
    if len(text) >= 6 and "\ufffd" not in stop:  # a stop string inside the greedy text cuts it there
        stopped = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                                 stop=[stop])
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].message.content == text[:text.index(stop)]


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model="tiny", messages=user("Pick words."), max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    first, second = (client.chat.completions.create(**kwargs) for _ in range(2))
    assert first.choices[0].message.content == second.choices[0].message.content


def test_models_health_and_auth(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server}/health").status_code == 200  # open without a key
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        response = httpx.get(f"{server}/v1/models", headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="nope", max_retries=0).chat.completions.create(
            model="tiny", messages=user("hi"), max_tokens=2)


# --- malformed requests -------------------------------------------------------------------------

def _chat(**fields) -> dict:
    return {"model": "tiny", "messages": user("hi"), "max_tokens": 4, **fields}


def _with_image(url: str) -> dict:
    return _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "look"},
                                                        {"type": "image_url", "image_url": {"url": url}}]}])


BAD_REQUESTS = {
    # id: (body: dict | bytes, expected status, expected error code or None for "any")
    "invalid-json": (b'{"model": "tiny", "messages": [', 400, "invalid_json"),
    "empty-body": (b"", 400, "invalid_json"),
    "json-array": (b"[]", 400, None),
    "missing-model": ({"messages": user("hi")}, 400, "missing_field"),
    "missing-messages": ({"model": "tiny"}, 400, "missing_field"),
    "empty-messages": (_chat(messages=[]), 400, None),
    "messages-not-list": (_chat(messages="hi"), 400, "invalid_type"),
    "message-without-role": (_chat(messages=[{"content": "hi"}]), 400, "missing_field"),
    "unknown-role": (_chat(messages=[{"role": "wizard", "content": "hi"}]), 400, None),
    "content-wrong-type": (_chat(messages=[{"role": "user", "content": 5}]), 400, "invalid_type"),
    "unknown-part-type": (_chat(messages=[{"role": "user", "content": [{"type": "audio"}]}]), 400, None),
    "image-part-without-url": (_chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
                               400, "missing_field"),
    "max-tokens-string": (_chat(max_tokens="ten"), 400, "invalid_type"),
    "max-tokens-negative": (_chat(max_tokens=-5), 400, "invalid_value"),
    "max-tokens-zero": (_chat(max_tokens=0), 400, "invalid_value"),
    "max-tokens-huge": (_chat(max_tokens=10**9), 400, "context_length_exceeded"),
    "max-completion-tokens-too-many": (_chat(max_completion_tokens=MAX_MODEL_LEN), 400, "context_length_exceeded"),
    "temperature-negative": (_chat(temperature=-1), 400, None),
    "temperature-string": (_chat(temperature="hot"), 400, "invalid_type"),
    "top-p-zero": (_chat(top_p=0), 400, None),
    "top-p-above-one": (_chat(top_p=1.5), 400, None),
    "seed-negative": (_chat(seed=-1), 400, None),
    "stream-string": (_chat(stream="yes"), 400, "invalid_type"),
    "n-two": (_chat(n=2), 400, "unsupported_parameter"),
    "logprobs": (_chat(logprobs=True), 400, "unsupported_parameter"),
    "five-stop-strings": (_chat(stop=["a", "b", "c", "d", "e"]), 400, "invalid_value"),
    "unknown-model": (_chat(model="gpt-17"), 404, "model_not_found"),
    "over-long-prompt": (_chat(messages=user("x" * (MAX_MODEL_LEN + 100))), 400, "context_length_exceeded"),
    "bad-base64": (_with_image("data:image/png;base64,@@not-base64@@"), 400, "invalid_base64"),
    "data-url-not-base64": (_with_image("data:image/png,rawbytes"), 400, "invalid_image_url"),
    "non-image-bytes": (_with_image(data_url(b"just some text, not pixels" * 10)), 400, "not_an_image"),
    "truncated-png": (_with_image(data_url(png_bytes(random_images([(64, 64)])[0])[:200])), 400, None),
    "one-by-one-image": (_with_image(data_url(png_bytes(np.zeros((1, 1, 3), np.uint8)))), 400, "image_too_small"),
    "zero-size-image": (_with_image(data_url(png_header_only(0, 0))), 400, None),
    "thin-image": (_with_image(data_url(png_bytes(np.zeros((8, 300, 3), np.uint8)))), 400, "image_too_small"),
    "decompression-bomb": (_with_image(data_url(png_header_only(40_000, 40_000))), 400, "image_too_large"),
    "too-many-pixels": (_with_image(data_url(png_bytes(np.zeros((1000, 1200, 3), np.uint8)))), 400,
                        "image_too_large"),
    "too-many-images": (_chat(messages=user(*[image_url(28, 28, seed=i) for i in range(5)])), 400,
                        "too_many_images"),
    "http-url": (_with_image("http://example.com/cat.png"), 400, "url_not_allowed"),
    "https-url": (_with_image("https://example.com/cat.png"), 400, "url_not_allowed"),
    "file-url": (_with_image("file:///etc/passwd"), 400, "url_not_allowed"),
    "not-a-url": (_with_image("cat.png"), 400, "invalid_image_url"),
    "body-too-large": (_chat(messages=user("y" * (LIMITS["max_body_bytes"] + 10))), 413, "request_too_large"),
}


def test_malformed_requests_get_openai_errors(server, http, client):
    assert len(BAD_REQUESTS) >= 30
    failures = []
    for name, (body, status, code) in BAD_REQUESTS.items():
        if isinstance(body, dict):
            response = http.post("/v1/chat/completions", json=body)
        else:
            response = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        error = response.json().get("error", {}) if response.headers.get("content-type", "").startswith(
            "application/json") else {}
        ok = (response.status_code == status and isinstance(error.get("message"), str) and error["message"]
              and error.get("type") and (code is None or error.get("code") == code))
        if not ok:
            failures.append(f"{name}: {response.status_code} {response.text[:300]}")
    for path, method, status in (("/v1/nothing", "GET", 404), ("/v1/chat/completions", "GET", 405)):
        response = http.request(method, path)
        assert response.status_code == status and "error" in response.json()
    assert not failures, "\n".join(failures)
    # Nothing above hurt the server.
    assert httpx.get(f"{server}/health").json()["status"] == "ok"
    ok = client.chat.completions.create(model="tiny", messages=user("still there?", image_url(56, 56, seed=3)),
                                        max_tokens=4, temperature=0)
    assert ok.usage.completion_tokens >= 1
    assert metric(http, 'raypipe_request_errors_total{code="image_too_large"}') >= 2


# --- concurrency, batching, cancellation, failures ----------------------------------------------

async def _concurrent(server: str, n: int, seed: int, max_tokens: int = 16, on_started=None, images: int = 1):
    aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)
    calls = [aclient.chat.completions.create(
        model="tiny", messages=user(f"request {i}", *[image_url(28 + 28 * (i % 4), 56 + 14 * i, seed=seed + 100 * j + i)
                                                      for j in range(images)]),
        max_tokens=max_tokens, temperature=0) for i in range(n)]
    tasks = [asyncio.ensure_future(call) for call in calls]
    if on_started is not None:
        await asyncio.sleep(0.1)
        on_started()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    await aclient.close()
    return results


def test_concurrent_requests_are_batched(server, http):
    results = asyncio.run(_concurrent(server, n=10, seed=100))
    assert all(not isinstance(r, Exception) for r in results), results
    assert metric(http, "raypipe_encoder_batch_max_requests_per_batch") >= 2  # images encoded together
    assert metric(http, "raypipe_decode_max_batch") >= 2  # sequences decoded together
    assert metric(http, "raypipe_time_to_first_token_seconds_count") >= 10


def test_client_disconnect_aborts_request(server, http):
    aborted_before = metric(http, "raypipe_decode_requests_aborted")
    body = _chat(messages=user("Talk for a long time."), max_tokens=MAX_MODEL_LEN - 100, temperature=0, stream=True)
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if metric(http, "raypipe_decode_requests_aborted") > aborted_before \
                and metric(http, "raypipe_num_requests_running") == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the disconnected request was not aborted")


def _serve_encoder_worker_pids(exclude: set[int]) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if cmdline.startswith(b"ray::EncoderWorker") and int(entry) not in exclude:
                pids.append(int(entry))
    return pids


def test_killed_encoder_worker_fails_no_request(server, http, pipe):
    own = {info["pid"] for info in pipe.worker_info()}  # the reference pipeline's worker is not Serve's
    victims = _serve_encoder_worker_pids(own)
    assert len(victims) == 2
    results = asyncio.run(_concurrent(server, n=8, seed=200, on_started=lambda: os.kill(victims[0], signal.SIGKILL)))
    assert all(not isinstance(r, Exception) for r in results), results
    # If the first wave was encoded before the kill landed, this one (two images per request, so
    # every batch reaches both workers) meets the dead worker.
    results = asyncio.run(_concurrent(server, n=4, seed=300, images=2))
    assert all(not isinstance(r, Exception) for r in results), results
    assert metric(http, "raypipe_encoder_workers_replaced") >= 1
    assert httpx.get(f"{server}/health").status_code == 200
