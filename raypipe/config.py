"""One configuration object per concern, shared by the CLI, `Pipeline`, Serve's `AppArgs` and batch.

- `ModelConfig` (here): which checkpoint, how many vision-tower replicas and where they run, how the
  balancer weighs images, the embedding cache, dtypes.
- `EngineConfig` (`raypipe.decode.config`): the decode engine's limits.
- `ImageLimits` (`raypipe.inputs.images`): what an input image may be.
- `TokenBudgets` (`raypipe.encode.budgets`, inside `ModelConfig`): the encoder's forwards at fixed
  token budgets, with their one on/off switch.

Each front end builds these objects once and hands them down, instead of re-listing the same knobs
as keyword arguments at every layer. A default is written only in its dataclass: CLI flags and
Serve's `AppArgs` take theirs through `defaults()` (tests/test_defaults.py checks), and CLI flags use
the field names as their `dest`, so `model_config_from_args` needs no second list of names.
"""

from __future__ import annotations

import dataclasses
import os

from raypipe.decode.config import EngineConfig
from raypipe.encode.budgets import TokenBudgets
from raypipe.inputs.images import ImageLimits
from raypipe.models import evs
from raypipe.models.base import check_cost_model

__all__ = ["EngineConfig", "ImageLimits", "ModelConfig", "TokenBudgets", "defaults", "model_config_from_args"]


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str = "tiny"  # preset name (tiny, small, ...), local checkpoint folder, s3://bucket/prefix/ or HF id org/name[@rev]
    num_encoders: int = 2  # vision-tower replicas (the minimum when an autoscaling pool allows more)
    max_encoders: int | None = None  # upper bound of an autoscaling encoder pool (batch); None: fixed size
    encoder_gpus: float | None = None  # GPU share per encoder; None: 1 if the cluster has or can start GPUs, else 0
    cost_model: str = "patches"  # how the load balancer weighs images: patches or attention
    cache_bytes: int = 256 * 1024 * 1024  # content-hash embedding cache (per coordinator)
    dtype: str = "auto"  # encoder dtype: fp32 on CPU, bf16 on CUDA
    encoder_threads: int | None = None  # torch threads per CPU encoder; None: cores split evenly
    decode_gpus: float | None = None  # GPU share of the decode engine; None: like encoder_gpus
    video_pruning_rate: float = 0.0  # EVS: fraction of each video's tokens dropped (raypipe.models.evs); 0: off
    encoder_budgets: TokenBudgets = TokenBudgets()  # encoder forwards at fixed token budgets; .enabled: the switch

    def __post_init__(self):
        object.__setattr__(self, "model", os.fspath(self.model))
        if self.num_encoders < 1:
            raise ValueError(f"num_encoders must be >= 1, got {self.num_encoders}")
        if self.max_encoders is not None and self.max_encoders < self.num_encoders:
            raise ValueError(f"max_encoders ({self.max_encoders}) must be >= num_encoders ({self.num_encoders})")
        check_cost_model(self.cost_model)
        evs.check_rate(self.video_pruning_rate)
        if self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {self.cache_bytes}")

    @property
    def encoder_range(self) -> tuple[int, int]:
        """(min, max) replicas: equal for a fixed pool."""
        return self.num_encoders, self.max_encoders or self.num_encoders


def defaults(config_class) -> dict:
    """Field name -> default of a config dataclass: how front ends take a default instead of re-typing it."""
    missing = dataclasses.MISSING
    return {f.name: f.default if f.default is not missing else f.default_factory()
            for f in dataclasses.fields(config_class) if f.default is not missing or f.default_factory is not missing}


def model_config_from_args(args, **overrides) -> ModelConfig:
    """The `ModelConfig` named by parsed CLI arguments (flags whose dest is a field name)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelConfig) if hasattr(args, f.name)}
    return ModelConfig(**{**values, **overrides})
