"""The Serve application: `Ingress` composed with `EncoderGroup` and `Decoder` through handles.

`build_app` is a Serve application builder, so the same graph starts from the CLI
(`raypipe serve`), from `serve run deployments/config.yaml` (its `args:` are `AppArgs`), or from
`serve run raypipe.serve.app:build_app model=tiny`. Replica counts, autoscaling and resources are
deployment options: set them in config.yaml's `deployments:` section, not here.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import BaseModel, ConfigDict
from ray.serve import Application

from raypipe.serve.decoder import Decoder
from raypipe.serve.encoder_group import EncoderGroup
from raypipe.serve.ingress import Ingress
from raypipe.config import ModelConfig


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a typo in config.yaml's args fails the deploy

    model: str = "tiny"  # preset name, local HF checkpoint folder (on every node), or s3:// URI (copied per node)
    served_model_name: str | None = None  # the `model` clients send; default: the model argument
    api_key: str | None = None  # also read from RAYPIPE_API_KEY in the ingress replicas
    num_encoders: int = 2  # encoder-worker actors per EncoderGroup replica
    encoder_gpus: float | None = None  # GPU share per encoder worker; None: 1 if the cluster has or can start GPUs, else 0
    cost_model: Literal["patches", "attention", "calibrated"] = "patches"
    cache_bytes: int = 256 * 1024 * 1024  # embedding cache per EncoderGroup replica
    batch_window_s: float = 0.005  # how long the encoder group waits to gather concurrent requests' images
    max_batch_images: int = 64
    engine: dict = {}  # raypipe.decode.config.EngineConfig fields (max_num_seqs, max_model_len, ...)
    limits: dict = {}  # raypipe.serve.limits.ServeLimits fields (body size, images, pixels, default max_tokens)
    resize_images: bool = True  # resize at the ingress to the tower's input size; False only to measure the saving

    def as_model_config(self) -> ModelConfig:
        """The model and encoder fields as the `ModelConfig` that `Pipeline` and batch take too."""
        return ModelConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ModelConfig)
                              if f.name in type(self).model_fields})


def build_app(args: AppArgs | dict | None = None) -> Application:
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    encoder = EncoderGroup.bind(args.as_model_config(), batch_window_s=args.batch_window_s,
                                max_batch_images=args.max_batch_images)
    decoder = Decoder.bind(model=args.model, engine=args.engine)
    return Ingress.bind(encoder, decoder, model=args.model, served_model_name=args.served_model_name,
                        api_key=args.api_key, limits=args.limits, resize_images=args.resize_images)
