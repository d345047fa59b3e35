"""`Ingress` deployment: the OpenAI-compatible HTTP front door.

Per chat request: authorize -> bounded body -> schema -> model name -> (thread) decode images and
videos (only the frames sampling keeps), resized to what the vision tower consumes, and apply the
chat template (text too long for the context is refused before tokenizing) -> limits -> encoder
group (image embeddings as `ObjectRef`s, never fetched here) -> one decoder stream per choice (`n`)
-> JSON body or SSE chunks. The first generated delta is awaited before a streaming response
starts, so failures up to and including prefill still get a proper 4xx. `/v1/completions` is the
same without images or chat template, for each of its prompts. With prefix-affinity routing on,
each decoder call also carries the prompt's first block hashes (`prefix_hashes`), which the
Decoder's request router reads (`prefix_router.py`).
"""

# No `from __future__ import annotations` here: FastAPI must see `Request` as a class, not a string.
import asyncio
import dataclasses
import hashlib
import hmac
import importlib.metadata
import itertools
import json
import os
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from raypipe.decode.prefix_hash import prompt_block_hashes
from raypipe.errors import InvalidInput
from raypipe.inputs.sampling import SamplingParams
from raypipe.inputs.video import VideoSampling
from raypipe.models import reasoning
from raypipe.models.prompt import VideoOptions, build_prompt, check_text_chars, max_chars_per_token, plain_text_ids
from raypipe.models.registry import family_of, language_adapter, resolve_model, vision_adapter
from raypipe.serve.errors import ApiError, install_handlers
from raypipe.serve.limits import ServeLimits
from raypipe.serve.metrics import ServeMetrics
from raypipe.serve.openai.bad_words import bad_words_token_ids
from raypipe.serve.openai.bodies import completion_id, model_card, models_body
from raypipe.serve.openai.conversion import sampling_params
from raypipe.serve.openai.openapi import install_schemas, request_body
from raypipe.serve.openai.parsing import parse_request
from raypipe.serve.openai.prompt_tokens import special_tokens_around, truncate, truncation_length
from raypipe.serve.openai.responses import ResponsesRequest, as_responses_error, chat_request, input_messages
from raypipe.serve.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UnloadLoraAdapterRequest,
)
from raypipe.serve.lora_registry import LoraRef
from raypipe.serve.prefix_router import HASHES_KWARG
from raypipe.serve.response_stream import ResponseTurn, new_id
from raypipe.serve.resume import ResumableStream
from raypipe.serve.streaming import CompletionStream

app = FastAPI(title="raypipe", redoc_url=None)
install_handlers(app)
install_schemas(app, [ChatCompletionRequest, CompletionRequest, ResponsesRequest, TokenizeChatRequest,
                      TokenizeCompletionRequest, DetokenizeRequest, LoadLoraAdapterRequest, UnloadLoraAdapterRequest])

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
LOAD_LORA = "/v1/load_lora_adapter"
UNLOAD_LORA = "/v1/unload_lora_adapter"


def response_id(request, engine_id: str) -> str:
    """The response's `id`: the client's `request_id` (vLLM's field) after the kind's prefix, else the engine's id
    (the engine's own ids stay unique whatever clients send)."""
    if request.request_id is None:
        return engine_id
    return f"{engine_id.partition('-')[0]}-{request.request_id}"


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


def _tokenize_model(body: bytes):
    """`/tokenize` takes chat messages or a text prompt, told apart as vLLM does: by `messages`."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # `parse_request` reports it
        return TokenizeCompletionRequest
    return TokenizeChatRequest if isinstance(data, dict) and "messages" in data else TokenizeCompletionRequest


@serve.deployment  # options (replicas, resources, max_ongoing_requests) live in deployments/config.yaml
@serve.ingress(app)
class Ingress:
    # No defaults for what `AppArgs` carries: `raypipe.serve.app.compose` always passes them.
    def __init__(self, encoder: DeploymentHandle, decoder: DeploymentHandle, store: DeploymentHandle,
                 loras: DeploymentHandle, *, model: str,
                 served_model_name: str | None, api_key: str | None, limits: dict, resize_images: bool,
                 video_pruning_rate: float, prefix_key_blocks: int, block_size: int, lora_names: tuple[str, ...],
                 decoder_capacity: int, health_timeout_s: float = 5.0):
        checkpoint = resolve_model(model)
        self.encoder, self.decoder, self.store = encoder, decoder, store  # store: /v1/responses conversations
        self.loras = loras  # LoraRegistry: the adapters loaded while the app runs
        self.model_names = {served_model_name or str(model), str(model)}
        self.served_model_name = served_model_name or str(model)
        self.lora_names = lora_names  # the engine's LoRA adapters at start: a request's `model` may name one
        self.decoder_capacity = decoder_capacity  # a Decoder replica's max_ongoing_requests: bounds n's fan-out
        self.api_key = api_key or os.environ.get("RAYPIPE_API_KEY") or None
        self.limits = ServeLimits(**limits)
        self.image_limits = self.limits.image_limits
        self.video_options = VideoOptions(self.limits.video_limits, pruning_rate=video_pruning_rate)
        self.language = language_adapter(checkpoint)  # config and tokenizer only: placeholder runs for the keys
        self.tokenizer = self.language.tokenizer
        self.special_tokens = special_tokens_around(self.tokenizer)  # (before, after) a text: `add_special_tokens`
        self.prefix_key_blocks, self.block_size = prefix_key_blocks, block_size  # 0 blocks: routing off
        self.chars_per_token = max_chars_per_token(self.tokenizer)
        self.vision_adapter = vision_adapter(checkpoint)
        self.family = family_of(checkpoint)
        if self.family.reasoning and self.family.reasoning not in reasoning.PARSERS:
            raise ValueError(f"no reasoning parser {self.family.reasoning!r} (known: {reasoning.PARSERS})")
        # Names this deployment's model and weights: same checkpoint, same fingerprint.
        self.fingerprint = "fp_" + hashlib.sha256((checkpoint / "config.json").read_bytes()).hexdigest()[:12]
        self.health_timeout_s = health_timeout_s
        self.resize_images = resize_images
        self.metrics = ServeMetrics()
        self.created = int(time.time())
        self._max_model_len: int | None = None

    # --- routes -------------------------------------------------------------------------------

    @app.post(CHAT, openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        try:
            self._authorize(request)
            chat = parse_request(await self._read_body(request), ChatCompletionRequest)
            stream = await self._chat_stream(chat, arrival)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
            return self._error(CHAT, exc)
        return await self._respond(CHAT, stream, bool(chat.stream))

    @app.post(RESPONSES, openapi_extra=request_body(ResponsesRequest))
    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API over the chat path (`openai/responses.py`, `response_stream.py`); a stored
        response's conversation continues with `previous_response_id` (`response_store.py`)."""
        arrival = time.monotonic()
        try:
            self._authorize(request)
            asked = parse_request(await self._read_body(request), ResponsesRequest)
            history = await self._stored_conversation(asked.previous_response_id)
            try:
                stream = await self._chat_stream(chat_request(asked, history), arrival)
            except InvalidInput as exc:  # about the chat request written for it: name what the client sent
                raise as_responses_error(exc) from None
        except Exception as exc:  # noqa: BLE001
            return self._error(RESPONSES, exc)
        conversation = history + input_messages(asked)
        turn = ResponseTurn(asked, new_id("resp"), stream.model, stream,
                            lambda answer: self._store(turn.id, asked, conversation + [answer]))
        return await self._respond(RESPONSES, turn, bool(asked.stream))

    async def _chat_stream(self, chat: ChatCompletionRequest, arrival: float) -> CompletionStream:
        """A checked chat request's decoder streams, started (its first deltas in: a failure so far is a 4xx)."""
        lora = await self._resolve_model(chat.model)
        self.limits.check_fan_out(1, chat.n or 1, self.decoder_capacity)
        template_kwargs = chat.template_kwargs(bool(self.family.reasoning))
        thinking = self.family.thinks(template_kwargs)
        prompt, params = await self._prepare(chat, template_kwargs)
        params = dataclasses.replace(params, structured=reasoning.constrain_answer(params.structured, thinking))
        visual_refs = await self.encoder.encode.remote(prompt.visuals, lora) if prompt.visuals else []
        if isinstance(visual_refs, InvalidInput):  # its adapter's tower part could not be read
            raise visual_refs
        request_id = completion_id()
        # The decoder needs token ids and geometry, not pixels: don't ship the images twice.
        deltas = self._generate(request_id, prompt.without_pixels(), visual_refs, params, chat.n,
                                self._prefix_key(prompt.prompt_token_ids, prompt.visual_layouts, lora,
                                                 chat.cache_salt), lora, chat.cache_salt)
        stream = CompletionStream("chat", response_id(chat, request_id), self._model_name(lora),
                                  self.fingerprint, deltas, [prompt.num_prompt_tokens], arrival, chat.include_usage,
                                  self._logprob_token_text(chat), chat.tool_names(), thinking,
                                  chat.legacy_functions, continuous_usage=chat.continuous_usage,
                                  echo=[chat.echoed_text()])
        await stream.start()
        stream.record_routes(self.metrics)
        return stream

    async def _stored_conversation(self, response_id: str | None) -> list[dict]:
        if response_id is None:
            return []
        conversation = await self.store.get.remote(response_id)
        if conversation is None:
            raise InvalidInput(f"Previous response with id {response_id!r} not found (never stored, stored with "
                               "store: false, or no longer kept)", item="previous_response_id",
                               code="previous_response_not_found")
        return json.loads(conversation)

    def _store(self, response_id: str, asked: ResponsesRequest, conversation: list[dict]) -> None:
        if asked.stored:  # sent without waiting: the response does not wait for the store
            self.store.put.remote(response_id, json.dumps(conversation))

    @app.post(COMPLETIONS, openapi_extra=request_body(CompletionRequest))
    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        try:
            self._authorize(request)
            completion = parse_request(await self._read_body(request), CompletionRequest)
            lora = await self._resolve_model(completion.model)
            prompts, echoes, params = await self._prepare_completion(completion)
            request_id = completion_id("cmpl")
            salt = completion.cache_salt
            deltas = [stream for p, prompt in enumerate(prompts) for stream in self._generate(
                request_id if len(prompts) == 1 else f"{request_id}-{p}", prompt, [], params, completion.n,
                self._prefix_key(prompt, [], lora, salt), lora, salt)]
            stream = CompletionStream("text", response_id(completion, request_id), self._model_name(lora),
                                      self.fingerprint, deltas, [len(prompt) for prompt in prompts], arrival,
                                      completion.include_usage, self._logprob_token_text(completion),
                                      continuous_usage=completion.continuous_usage, echo=echoes)
            await stream.start()
            stream.record_routes(self.metrics)
        except Exception as exc:  # noqa: BLE001
            return self._error(COMPLETIONS, exc)
        return await self._respond(COMPLETIONS, stream, bool(completion.stream))

    def _prefix_key(self, ids: list[int], layouts, lora: LoraRef | None, cache_salt: str | None) -> dict:
        """The decoder call's keyword argument the request router reads (none with routing off)."""
        if not self.prefix_key_blocks:
            return {}
        try:
            hashes = prompt_block_hashes(ids, layouts, self.language, self.block_size, self.prefix_key_blocks,
                                         lora and lora.routing_key, cache_salt)
        except StopIteration:  # fewer placeholder runs than visual items: the engine refuses it with a 400
            return {}
        return {HASHES_KWARG: tuple(hashes)}

    def _generate(self, request_id: str, prompt, visual_refs: list, params: SamplingParams, n: int | None,
                  key: dict, lora: LoraRef | None, cache_salt: str | None) -> list:
        """One decoder stream per choice, resumed elsewhere if its replica dies (`serve.resume`): n independent sequences (the prefix cache shares the prompt's blocks
        once they are cached; choices admitted in the same round each compute it); choice i of a seeded request samples with seed + i, so it
        equals a request of its own with that seed."""
        n = n or 1

        def choice(i: int) -> ResumableStream:
            choice_id = request_id if n == 1 else f"{request_id}-{i}"
            choice_params = params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
            attempts = itertools.count()
            return ResumableStream(
                lambda resume: self.decoder.options(stream=True).generate.remote(
                    choice_id if resume is None else f"{choice_id}-resume{next(attempts)}", prompt, visual_refs,
                    choice_params, lora=lora, cache_salt=cache_salt, **key, resume=resume),
                self.metrics.resumed_choices.inc)

        return [choice(i) for i in range(n)]

    async def _respond(self, endpoint: str, stream: CompletionStream | ResponseTurn, streaming: bool) -> Response:
        if streaming:
            return StreamingResponse(stream.sse(self.metrics, endpoint), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            body = await stream.collect()
        except Exception as exc:  # noqa: BLE001
            return self._error(endpoint, exc)
        stream.record(self.metrics, endpoint)
        return JSONResponse(body)

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
            model_len = await self._model_len()
            loaded = [ref.name for ref in await self.loras.all.remote()]
            body = models_body([model_card(self.served_model_name, model_len, self.created)]
                               + [model_card(name, model_len, self.created, self.served_model_name)
                                  for name in [*self.lora_names, *loaded]])
        except Exception as exc:  # noqa: BLE001
            return self._error("/v1/models", exc)
        self.metrics.requests.labels("/v1/models", "200").inc()
        return JSONResponse(body)

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> Response:
        try:
            self._authorize(request)
            lora = await self._resolve_model(model_id)
            body = model_card(self._model_name(lora), await self._model_len(), self.created,
                              self.served_model_name if lora else None)
        except Exception as exc:  # noqa: BLE001
            return self._error("/v1/models/{id}", exc)
        self.metrics.requests.labels("/v1/models/{id}", "200").inc()
        return JSONResponse(body)

    @app.post(LOAD_LORA, openapi_extra=request_body(LoadLoraAdapterRequest))
    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's route and answers: one Decoder replica reads and checks the adapter (a bad one is a 400 naming the
        field, a path with no adapter a 404), then the registry makes it every replica's (`lora_registry.py`)."""
        return await self._adapter_route(LOAD_LORA, request, LoadLoraAdapterRequest, self._load_lora)

    @app.post(UNLOAD_LORA, openapi_extra=request_body(UnloadLoraAdapterRequest))
    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's route: new requests naming it are 404s from now on; those already running finish with it."""
        return await self._adapter_route(UNLOAD_LORA, request, UnloadLoraAdapterRequest, self._unload_lora)

    async def _adapter_route(self, endpoint: str, request: Request, model, act) -> Response:
        """An adapter route's answer: vLLM's plain-text success message, or the error body."""
        try:
            self._authorize(request)
            message = await act(parse_request(await self._read_body(request), model))
        except Exception as exc:  # noqa: BLE001
            return self._error(endpoint, exc)
        self.metrics.requests.labels(endpoint, "200").inc()
        return PlainTextResponse(message)

    async def _load_lora(self, asked: LoadLoraAdapterRequest) -> str:
        name = asked.lora_name
        if name in self.model_names or name in self.lora_names or await self.loras.get.remote(name) is not None:
            raise InvalidInput(f"The lora adapter {name!r} has already been loaded"
                               + (" (it names the base model)" if name in self.model_names else ""),
                               item="lora_name", code="lora_already_loaded")
        tower = await self.encoder.check_lora.remote(name, asked.lora_path)  # its vision-tower part, if any
        fingerprint = await self.decoder.load_lora.remote(name, asked.lora_path)
        for refused in (tower, fingerprint):
            if isinstance(refused, Exception):  # a replica's refusal, handed over as a value
                raise refused
        if tower is not None and tower != fingerprint:
            raise InvalidInput(f"the files at {asked.lora_path} changed while the adapter {name!r} was loaded; load it "
                               "again", item="lora_path", code="invalid_lora_adapter")
        if not await self.loras.add.remote(LoraRef(name, asked.lora_path, fingerprint)):
            raise InvalidInput(f"The lora adapter {name!r} has already been loaded", item="lora_name",
                               code="lora_already_loaded")
        return f"Success: LoRA adapter '{name}' added successfully."

    async def _unload_lora(self, asked: UnloadLoraAdapterRequest) -> str:
        name = asked.lora_name
        if name in self.lora_names:
            raise InvalidInput(f"The lora adapter {name!r} was configured at start (engine.lora_modules) and cannot "
                               "be unloaded", item="lora_name", code="lora_not_unloadable")
        if not await self.loras.remove.remote(name):
            raise InvalidInput(f"The lora adapter {name!r} cannot be found.", item="lora_name", code="lora_not_found")
        return f"Success: LoRA adapter '{name}' removed successfully."

    @app.post("/tokenize", openapi_extra=request_body(TokenizeChatRequest))
    async def tokenize(self, request: Request) -> Response:
        """vLLM's tokenizer endpoint: a text prompt as `/v1/completions` tokenizes it, or chat messages as
        `/v1/chat/completions` renders them (images and videos decoded, checked and counted as the chat route
        does): the tokens a request will cost, before it is sent."""
        try:
            self._authorize(request)
            body = await self._read_body(request)
            asked = parse_request(body, _tokenize_model(body))
            if asked.model is not None:
                await self._resolve_model(asked.model)
            if isinstance(asked, TokenizeChatRequest):
                ids = (await self._build_prompt(asked, asked.template_kwargs(bool(self.family.reasoning)))
                       ).prompt_token_ids
            else:
                ids = await self._text_ids(asked.prompt, asked.special_tokens)
            strs = self.tokenizer.convert_ids_to_tokens(list(ids)) if asked.return_token_strs else None
            body = {"count": len(ids), "max_model_len": await self._model_len(), "tokens": list(ids),
                    "token_strs": strs}
        except Exception as exc:  # noqa: BLE001
            return self._error("/tokenize", exc)
        self.metrics.requests.labels("/tokenize", "200").inc()
        return JSONResponse(body)

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(self, request: Request) -> Response:
        try:
            self._authorize(request)
            asked = parse_request(await self._read_body(request), DetokenizeRequest)
            if asked.model is not None:
                await self._resolve_model(asked.model)
            vocab = len(self.tokenizer)
            for i, token in enumerate(asked.tokens):
                if not 0 <= token < vocab:
                    raise InvalidInput(f"token id {token} is outside the vocabulary (size {vocab})",
                                       item=f"tokens[{i}]", code="invalid_value")
            body = {"prompt": self.tokenizer.decode(asked.tokens)}
        except Exception as exc:  # noqa: BLE001
            return self._error("/detokenize", exc)
        self.metrics.requests.labels("/detokenize", "200").inc()
        return JSONResponse(body)

    @app.get("/version")
    async def version(self) -> Response:
        """raypipe's version (vLLM's route; no auth, like /health)."""
        return JSONResponse({"version": importlib.metadata.version("raypipe")})

    @app.get("/health")
    async def health(self) -> Response:
        """200 while at least one encoder worker and the decoder are alive (busy is alive); no auth (load balancers).

        Both probes are awaited with `return_exceptions`, so a probe that fails after a client gave
        up (or after the timeout) is still collected rather than logged as "never retrieved".
        """
        probes = asyncio.gather(self.encoder.ping.remote(), self.decoder.stats.remote(), return_exceptions=True)
        try:
            encoder, decoder = await asyncio.wait_for(probes, self.health_timeout_s)
        except asyncio.TimeoutError:
            encoder = decoder = TimeoutError(f"no answer within {self.health_timeout_s:g} s")
        failed = next((r for r in (encoder, decoder) if isinstance(r, BaseException)), None)
        if failed is not None:
            return JSONResponse({"status": "unavailable", "reason": f"{type(failed).__name__}: {failed}"[:500]},
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

    async def _resolve_model(self, model: str) -> LoraRef | None:
        """The LoRA adapter `model` names (configured at start, or loaded since: asked of the registry), None for the
        base model; any other name is a 404 naming it."""
        if model in self.model_names:
            return None
        if model in self.lora_names:
            return LoraRef(model)
        loaded = await self.loras.get.remote(model)
        if loaded is not None:
            return loaded
        raise InvalidInput(f"model {model!r} does not exist; this server serves {self.served_model_name!r}"
                           + (f" and the LoRA adapters {list(self.lora_names)}" if self.lora_names else "")
                           + " (and those loaded with /v1/load_lora_adapter: GET /v1/models lists them)",
                           item="model", code="model_not_found")

    def _model_name(self, lora: LoraRef | None) -> str:
        return lora.name if lora is not None else self.served_model_name

    async def _prepare(self, chat: ChatCompletionRequest, template_kwargs: dict | None):
        prompt = await self._build_prompt(chat, template_kwargs)
        model_len = await self._model_len()
        max_tokens = self.limits.max_tokens_for(chat.requested_max_tokens, prompt.num_prompt_tokens, model_len)
        return prompt, sampling_params(chat, max_tokens, self._bad_words(chat))

    async def _build_prompt(self, chat: ChatCompletionRequest, template_kwargs: dict | None):
        self.limits.check_visual_count("image", len(chat.image_urls()))
        self.limits.check_visual_count("video", len(chat.video_urls()))
        model_len = await self._model_len()
        # Image/video decoding and the chat template are CPU work: keep the event loop serving other requests.
        prompt = await asyncio.to_thread(build_prompt, chat.messages_for_template(), self.tokenizer,
                                         self.vision_adapter, self.image_limits, video=self._video_options(chat),
                                         max_text_chars=model_len * self.chars_per_token,
                                         max_video_tokens=model_len, resize_images=self.resize_images,
                                         tools=chat.template_tools(), tile_every_image=chat.tile_every_image(),
                                         chat_template_kwargs=template_kwargs, template=chat.template_options())
        ids = truncate(self._with_special_tokens(prompt.prompt_token_ids, chat.special_tokens),
                       truncation_length(chat.truncate_prompt_tokens, model_len),
                       self.language.placeholder_token_ids.values())
        return dataclasses.replace(prompt, prompt_token_ids=ids)

    async def _prepare_completion(self, completion: CompletionRequest
                                  ) -> tuple[list[list[int]], list[str] | None, SamplingParams]:
        """Each prompt's token ids, with `echo` the text each choice of it begins with, and the sampling
        parameters (one `max_tokens` for all: the request's, checked against the longest prompt)."""
        prompts = completion.prompts()
        self.limits.check_prompt_count(len(prompts))
        self.limits.check_fan_out(len(prompts), completion.n or 1, self.decoder_capacity)
        model_len = await self._model_len()
        keep = truncation_length(completion.truncate_prompt_tokens, model_len)
        kept_prompts, echoes = [], []
        for prompt in prompts:
            ids = await self._text_ids(prompt, completion.special_tokens) if isinstance(prompt, str) else list(prompt)
            kept = truncate(ids, keep)
            kept_prompts.append(kept)
            if completion.echo:  # vLLM echoes a text prompt as sent, token ids (or what truncation kept) as text
                echoes.append(prompt if isinstance(prompt, str) and len(kept) == len(ids)
                              else self.tokenizer.decode(kept))
        max_tokens = self.limits.max_tokens_for(completion.requested_max_tokens, max(map(len, kept_prompts)),
                                                model_len)
        return kept_prompts, echoes or None, sampling_params(completion, max_tokens, self._bad_words(completion))

    async def _text_ids(self, text: str, special_tokens: bool) -> list[int]:
        """A plain-text prompt's ids (text hopelessly long for the context refused before tokenizing it)."""
        check_text_chars(len(text), await self._model_len() * self.chars_per_token)
        return self._with_special_tokens(await asyncio.to_thread(plain_text_ids, self.tokenizer, text), special_tokens)

    def _with_special_tokens(self, ids: list[int], add: bool) -> list[int]:
        before, after = self.special_tokens
        return before + list(ids) + after if add else list(ids)

    def _bad_words(self, request) -> list[list[int]] | None:
        return bad_words_token_ids(self.tokenizer, request.bad_words, self.chars_per_token)

    def _video_options(self, chat: ChatCompletionRequest) -> VideoOptions:
        """The deployment's video options with the request's `mm_processor_kwargs` over them."""
        if chat.mm_processor_kwargs is None:
            return self.video_options
        kwargs = chat.mm_processor_kwargs.model_dump(exclude_none=True, exclude={"tile_every_image"})
        rate = kwargs.pop("video_pruning_rate", self.video_options.pruning_rate)
        return VideoOptions(self.video_options.limits, VideoSampling(**kwargs), rate)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _logprob_token_text(self, request):
        """How logprob entries name their tokens: the token's text, or vLLM's `token_id:<id>` when asked."""
        return _token_id_text if request.return_tokens_as_token_ids else self._token_text

    async def _model_len(self) -> int:
        if self._max_model_len is None:
            self._max_model_len = await self.decoder.max_model_len.remote()
        return self._max_model_len

    async def _stats(self, handle: DeploymentHandle) -> dict | None:
        try:
            return await asyncio.wait_for(handle.stats.remote(), self.health_timeout_s)
        except Exception:  # noqa: BLE001 - a missing deployment shows as raypipe_deployment_up 0
            return None

    def pid(self) -> int:
        """The replica's process id (operators and tests locate the process that serves HTTP)."""
        return os.getpid()

    def _error(self, endpoint: str, exc: Exception) -> JSONResponse:
        error = ApiError.from_exception(exc)
        self.metrics.record_error(endpoint, error.status, error.code)
        return error.response()
