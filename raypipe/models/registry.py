"""Pick the adapter for a checkpoint from its `config.json` `model_type`."""

from __future__ import annotations

import os

from raypipe.errors import InvalidInput
from raypipe.models.base import VisionAdapter
from raypipe.models.checkpoint import read_config
from raypipe.models.presets import resolve_model


def _qwen2_5_vl_vision(path):
    from raypipe.models.qwen2_5_vl_vision import Qwen2_5_VLVisionAdapter

    return Qwen2_5_VLVisionAdapter(path)


VISION_ADAPTERS = {"qwen2_5_vl": _qwen2_5_vl_vision}


def model_type(model: str | os.PathLike) -> str:
    return read_config(resolve_model(model)).get("model_type", "")


def vision_adapter(model: str | os.PathLike) -> VisionAdapter:
    """The vision adapter for a preset name or a local checkpoint folder."""
    path = resolve_model(model)
    kind = read_config(path).get("model_type", "")
    if kind not in VISION_ADAPTERS:
        raise InvalidInput(f"model_type {kind!r} is not supported yet (supported: {sorted(VISION_ADAPTERS)})",
                           item="model", code="unsupported_model")
    return VISION_ADAPTERS[kind](path)
