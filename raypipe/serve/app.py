"""The Serve application: `Ingress` composed with `EncoderGroup`, `Decoder`, `ResponseStore` and `LoraRegistry`
through handles.

`build_app` is a Serve application builder, so the same graph starts from the CLI
(`raypipe serve`), from `serve run deployments/config.yaml` (its `args:` are `AppArgs`), or from
`serve run raypipe.serve.app:build_app model=tiny`. Replica counts, autoscaling and resources are
deployment options: they live in config.yaml's `deployments:` section only, not in code. One
option follows from the app's args instead: the Decoder's request router (`decoder_options`), which
is raypipe's prefix-affinity router when `routing` is on, because the Ingress must then key requests
for it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict
from ray.serve import Application

from raypipe.config import EngineConfig, ModelConfig, TokenBudgets, defaults
from raypipe.parallel.group import placement_options
from raypipe.serve.decoder import Decoder
from raypipe.serve.encoder_group import EncoderGroup
from raypipe.serve.ingress import Ingress
from raypipe.serve.kuberay import SERVE_CONFIG, load_serve_config
from raypipe.serve.limits import ServeLimits
from raypipe.serve.lora_registry import LoraRegistry
from raypipe.serve.prefix_affinity import PrefixRouting
from raypipe.serve.prefix_router import ROUTER_CLASS
from raypipe.serve.response_store import ResponseStore

IMPORT_PATH = "raypipe.serve.app:build_app"
MODEL = defaults(ModelConfig)  # the model and encoder fields' defaults: written in ModelConfig only
MODEL_FIELDS = ("model", "num_encoders", "encoder_gpus", "cost_model", "cache_bytes",
                "video_pruning_rate", "encoder_budgets")  # those AppArgs takes


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a typo in config.yaml's args fails the deploy

    model: str = MODEL["model"]  # preset, local checkpoint folder (on every node), s3:// URI or HF id (copied per node)
    served_model_name: str | None = None  # the `model` clients send; default: the model argument
    api_key: str | None = None  # also read from RAYPIPE_API_KEY in the ingress replicas
    num_encoders: int = MODEL["num_encoders"]  # encoder-worker actors per EncoderGroup replica
    encoder_gpus: float | None = MODEL["encoder_gpus"]  # per encoder worker; None: 1 if the cluster has or can start GPUs, else 0
    cost_model: Literal["patches", "attention", "calibrated"] = MODEL["cost_model"]
    cache_bytes: int = MODEL["cache_bytes"]  # embedding cache per EncoderGroup replica
    video_pruning_rate: float = MODEL["video_pruning_rate"]  # EVS default; requests override it in mm_processor_kwargs
    encoder_budgets: TokenBudgets = MODEL["encoder_budgets"]  # raypipe.encode.budgets.TokenBudgets fields (enabled: the switch)
    batch_window_s: float = 0.005  # how long the encoder group waits to gather concurrent requests' images
    max_batch_images: int = 64
    engine: dict = {}  # raypipe.decode.config.EngineConfig fields (max_num_seqs, max_model_len, ...)
    limits: dict = {}  # raypipe.serve.limits.ServeLimits fields (body size, images, pixels, default max_tokens)
    routing: dict = {}  # raypipe.serve.prefix_affinity.PrefixRouting fields: prefix-affinity routing to the Decoders
    resize_images: bool = True  # resize at the ingress to the tower's input size; False only to measure the saving

    def as_model_config(self) -> ModelConfig:
        """The model and encoder fields as the `ModelConfig` that `Pipeline` and batch take too."""
        return ModelConfig(**{name: getattr(self, name) for name in MODEL_FIELDS})


def deployment_options(config: dict) -> dict[str, dict]:
    """Deployment name -> its options (autoscaling, resources, ...) in a Serve config's one application."""
    [app] = config["applications"]
    return {d["name"]: {k: v for k, v in d.items() if k != "name"} for d in app.get("deployments", [])}


def build_app(args: AppArgs | dict | None = None) -> Application:
    """Serve's application builder (it must take one parameter): `compose` with config.yaml's options.

    Deployment options live in the packaged config.yaml only (the decorators set none), so
    `serve run raypipe.serve.app:build_app` and tests get the same replicas as
    `serve run deployments/config.yaml`, which applies its own options over these.
    """
    return compose(args, deployment_options(load_serve_config(SERVE_CONFIG)))


def compose(args: AppArgs | dict | None, options: dict[str, dict]) -> Application:
    """The five deployments bound into one application; `options` per deployment name (autoscaling, ...).

    A Decoder whose engine spans `tensor_parallel_size` devices also gets a placement group of that
    many bundles (one GPU each where its replicas take `num_gpus`), derived here from the engine args
    so the two cannot disagree."""
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})

    def deployment(d):
        return d.options(**options.get(d.name, {}))

    routing = PrefixRouting(**args.routing)
    options = {**options, Decoder.name: decoder_options(options.get(Decoder.name, {}), routing)}
    routed = (options[Decoder.name].get("request_router_config") or {}).get("request_router_class") == ROUTER_CLASS
    engine = EngineConfig(**args.engine)
    encoder = deployment(EncoderGroup).bind(args.as_model_config(), batch_window_s=args.batch_window_s,
                                            max_batch_images=args.max_batch_images, lora_modules=engine.lora_modules)
    decoder_opts = options[Decoder.name]
    gpus = decoder_opts.get("ray_actor_options", {}).get("num_gpus", 0)
    group = placement_options(engine.tensor_parallel_size, gpus)
    decoder_deployment = Decoder.options(**decoder_opts, **group)
    decoder = decoder_deployment.bind(model=args.model, engine=args.engine)
    limits = ServeLimits(**args.limits)
    store = deployment(ResponseStore).bind(limits.max_stored_responses, limits.max_stored_response_bytes)
    loras = deployment(LoraRegistry).bind()
    return deployment(Ingress).bind(encoder, decoder, store, loras, model=args.model, served_model_name=args.served_model_name,
                                    api_key=args.api_key, limits=args.limits, resize_images=args.resize_images,
                                    video_pruning_rate=args.video_pruning_rate,
                                    prefix_key_blocks=routing.max_key_blocks if routed else 0,
                                    block_size=engine.block_size, lora_names=tuple(engine.lora_modules),
                                    decoder_capacity=decoder_deployment.max_ongoing_requests)


def decoder_options(options: dict, routing: PrefixRouting) -> dict:
    """The Decoder's deployment options with `PrefixAffinityRouter` as its request router when routing is on
    (`routing.enabled`, or by default when the deployment may run more than one replica)."""
    scaling = options.get("autoscaling_config") or {}
    replicas = scaling.get("max_replicas", 1) if scaling else options.get("num_replicas", 1)
    on = routing.enabled if routing.enabled is not None else replicas == "auto" or replicas > 1
    if not on:
        return options
    if "request_router_config" in options:
        raise ValueError("the Decoder deployment sets request_router_config and prefix-affinity routing is on: "
                         "set the application's routing.enabled to false to use another router")
    return {**options, "request_router_config": {
        "request_router_class": ROUTER_CLASS,
        "request_router_kwargs": {"min_match_ratio": routing.min_match_ratio,
                                  "overload_threshold": routing.overload_threshold,
                                  "max_tracked_blocks": routing.max_tracked_blocks,
                                  "max_tracked_adapters": routing.max_tracked_adapters}}}
