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


def _qwen2_5_vl_language(path):
    from raypipe.models.qwen2_5_vl_language import Qwen2_5_VLLanguageAdapter

    return Qwen2_5_VLLanguageAdapter(path)


def _minicpmv4_6_vision(path):
    from raypipe.models.minicpmv4_6_vision import MiniCPMV4_6VisionAdapter

    return MiniCPMV4_6VisionAdapter(path)


def _minicpmv4_6_language(path):
    from raypipe.models.minicpmv4_6_language import MiniCPMV4_6LanguageAdapter

    return MiniCPMV4_6LanguageAdapter(path)


def _step3_vision(path):
    from raypipe.models.step3_vision import Step3VisionAdapter

    return Step3VisionAdapter(path)


def _step3_language(path):
    from raypipe.models.step3_language import Step3LanguageAdapter

    return Step3LanguageAdapter(path)


VISION_ADAPTERS = {"qwen2_5_vl": _qwen2_5_vl_vision, "minicpmv4_6": _minicpmv4_6_vision, "step3p7": _step3_vision}
LANGUAGE_ADAPTERS = {"qwen2_5_vl": _qwen2_5_vl_language, "minicpmv4_6": _minicpmv4_6_language,
                     "step3p7": _step3_language}


def vision_adapter(model: str | os.PathLike) -> VisionAdapter:
    """The vision adapter for a preset name or a local checkpoint folder."""
    return _pick(VISION_ADAPTERS, model)


def language_adapter(model: str | os.PathLike):
    """The language-side adapter (tokenizer, positions, language model loader) for a checkpoint."""
    return _pick(LANGUAGE_ADAPTERS, model)


def _pick(adapters: dict, model: str | os.PathLike):
    path = resolve_model(model)
    kind = read_config(path).get("model_type", "")
    if kind not in adapters:
        raise InvalidInput(f"model_type {kind!r} is not supported yet (supported: {sorted(adapters)})",
                           item="model", code="unsupported_model")
    return adapters[kind](path)
