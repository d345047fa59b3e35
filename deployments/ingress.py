"""`Ingress` deployment: the OpenAI-compatible HTTP front door.

Per chat request: authorize -> bounded body -> schema -> model name -> (thread) decode images and
apply the chat template -> limits -> encoder group (image embeddings as `ObjectRef`s, never
fetched here) -> decoder stream -> JSON body or SSE chunks. The first generated delta is awaited
before a streaming response starts, so failures up to and including prefill still get a proper 4xx.
"""

# No `from __future__ import annotations` here: FastAPI must see `Request` as a class, not a string.
import asyncio
import hmac
import os
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.errors import ApiError, install_handlers
from deployments.limits import ServeLimits
from deployments.metrics import ServeMetrics
from deployments.protocol import ChatCompletionRequest, completion_id, models_body, parse_request
from deployments.streaming import ChatStream
from raypipe.errors import InvalidInput
from raypipe.models.presets import resolve_model
from raypipe.models.registry import vision_adapter
from raypipe.prompt import build_prompt
from raypipe.sampling import SamplingParams

app = FastAPI(title="raypipe", docs_url=None, redoc_url=None)
install_handlers(app)

CHAT = "/v1/chat/completions"


# Serve's default of 5 ongoing requests per replica would cap the decode batch at 5.
@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=128)
@serve.ingress(app)
class Ingress:
    def __init__(self, encoder: DeploymentHandle, decoder: DeploymentHandle, model: str = "tiny",
                 served_model_name: str | None = None, api_key: str | None = None, limits: dict | None = None,
                 health_timeout_s: float = 10.0):
        from transformers import AutoTokenizer

        checkpoint = resolve_model(model)
        self.encoder, self.decoder = encoder, decoder
        self.model_names = {served_model_name or str(model), str(model)}
        self.served_model_name = served_model_name or str(model)
        self.api_key = api_key or os.environ.get("RAYPIPE_API_KEY") or None
        self.limits = ServeLimits(**(limits or {}))
        self.image_limits = self.limits.image_limits
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        self.vision_adapter = vision_adapter(checkpoint)
        self.health_timeout_s = health_timeout_s
        self.metrics = ServeMetrics()
        self.created = int(time.time())
        self._max_model_len: int | None = None

    # --- routes -------------------------------------------------------------------------------

    @app.post(CHAT)
    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        try:
            self._authorize(request)
            chat = parse_request(await self._read_body(request))
            if chat.model not in self.model_names:
                raise InvalidInput(f"model {chat.model!r} does not exist; this server serves "
                                   f"{self.served_model_name!r}", item="model", code="model_not_found")
            prompt, params = await self._prepare(chat)
            image_refs = await self.encoder.encode.remote(prompt.images) if prompt.images else []
            request_id = completion_id()
            # The decoder needs token ids and geometry, not pixels: don't ship the images twice.
            deltas = self.decoder.options(stream=True).generate.remote(
                request_id, prompt.without_pixels(), image_refs, params)
            stream = ChatStream(request_id, self.served_model_name, deltas, prompt.num_prompt_tokens,
                                arrival, chat.include_usage)
            await stream.start()
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
            return self._error(CHAT, exc)
        if chat.stream:
            return StreamingResponse(stream.sse(self.metrics, CHAT), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            body = await stream.collect()
        except Exception as exc:  # noqa: BLE001
            return self._error(CHAT, exc)
        stream.record(self.metrics, CHAT)
        return JSONResponse(body)

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
            body = models_body(self.served_model_name, await self._model_len(), self.created)
        except Exception as exc:  # noqa: BLE001
            return self._error("/v1/models", exc)
        self.metrics.requests.labels("/v1/models", "200").inc()
        return JSONResponse(body)

    @app.get("/health")
    async def health(self) -> Response:
        """200 only when at least one encoder worker and the decoder answer; no auth (load balancers)."""
        try:
            encoder, decoder = await asyncio.wait_for(
                asyncio.gather(self.encoder.ping.remote(), self.decoder.stats.remote()), self.health_timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure to answer means not ready
            return JSONResponse({"status": "unavailable", "reason": f"{type(exc).__name__}: {exc}"[:500]},
                                status_code=503)
        ready = encoder["alive"] >= 1
        return JSONResponse({"status": "ok" if ready else "unavailable", "encoder_workers": encoder,
                             "decoder": {k: decoder.get(k) for k in ("running", "waiting")}},
                            status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics(self) -> Response:
        encoder, decoder = await asyncio.gather(self._stats(self.encoder), self._stats(self.decoder))
        return Response(self.metrics.render(encoder, decoder), media_type="text/plain; version=0.0.4")

    # --- steps ----------------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise InvalidInput("missing or invalid API key (send 'Authorization: Bearer <key>')",
                               code="invalid_api_key")

    async def _read_body(self, request: Request) -> bytes:
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:  # refuse before reading it
            raise InvalidInput(f"request body is {declared} bytes; the limit is {limit}", code="request_too_large")
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > limit:
                raise InvalidInput(f"request body exceeds the {limit}-byte limit", code="request_too_large")
        return bytes(body)

    async def _prepare(self, chat: ChatCompletionRequest):
        self.limits.check_image_count(len(chat.image_urls()))
        # Image decoding and the chat template are CPU work: keep the event loop serving other requests.
        prompt = await asyncio.to_thread(build_prompt, chat.messages_for_template(), self.tokenizer,
                                         self.vision_adapter, self.image_limits)
        max_tokens = self.limits.max_tokens_for(chat.requested_max_tokens, prompt.num_prompt_tokens,
                                                await self._model_len())
        params = SamplingParams(max_tokens=max_tokens,
                                temperature=1.0 if chat.temperature is None else chat.temperature,
                                top_p=1.0 if chat.top_p is None else chat.top_p, seed=chat.seed,
                                stop=chat.stop_list())
        return prompt, params

    async def _model_len(self) -> int:
        if self._max_model_len is None:
            self._max_model_len = await self.decoder.max_model_len.remote()
        return self._max_model_len

    async def _stats(self, handle: DeploymentHandle) -> dict | None:
        try:
            return await asyncio.wait_for(handle.stats.remote(), self.health_timeout_s)
        except Exception:  # noqa: BLE001 - a missing deployment shows as raypipe_deployment_up 0
            return None

    def _error(self, endpoint: str, exc: Exception) -> JSONResponse:
        error = ApiError.from_exception(exc)
        self.metrics.record_error(endpoint, error.status, error.code)
        return error.response()
