"""Model families by name: each family package declares one `ModelFamily` record, read here.

A checkpoint is a preset name (written on first use), an `s3://` URI (copied to this node's cache
once, see `raypipe.models.remote`) or a local folder; its `config.json` `model_type` picks the family.
Adding a family: its package under `raypipe/models/` and one entry in `FAMILIES`.
"""

from __future__ import annotations

import os
import pathlib

from raypipe.errors import InvalidInput
from raypipe.models import llava_onevision, minicpmv4_6, qwen2_5_vl, qwen3_5, qwen3_vl, step3
from raypipe.models.base import LanguageAdapter, VisionAdapter
from raypipe.models.checkpoint import read_config
from raypipe.models.family import ModelFamily
from raypipe.models.presets import PRESET_VERSION, default_cache_dir, write_once

FAMILIES: tuple[ModelFamily, ...] = (qwen2_5_vl.FAMILY, minicpmv4_6.FAMILY, step3.FAMILY, llava_onevision.FAMILY,
                                     qwen3_vl.FAMILY, qwen3_vl.MOE_FAMILY, qwen3_5.FAMILY, qwen3_5.MOE_FAMILY)

_BY_MODEL_TYPE = {family.model_type: family for family in FAMILIES}
_BY_PRESET = {name: family for family in FAMILIES for name in family.presets}
PRESETS = tuple(_BY_PRESET)


def vision_adapter(model: str | os.PathLike) -> VisionAdapter:
    """The vision adapter for a preset name, an s3:// URI or a local checkpoint folder."""
    path = resolve_model(model)
    return family_of(path).vision_adapter(path)


def language_adapter(model: str | os.PathLike) -> LanguageAdapter:
    """The language-side adapter (tokenizer, positions, language model loader) for a checkpoint."""
    path = resolve_model(model)
    return family_of(path).language_adapter(path)


def family_of(checkpoint: pathlib.Path) -> ModelFamily:
    kind = read_config(checkpoint).get("model_type", "")
    if kind not in _BY_MODEL_TYPE:
        raise InvalidInput(f"model_type {kind!r} is not supported yet (supported: {sorted(_BY_MODEL_TYPE)})",
                           item="model", code="unsupported_model")
    return _BY_MODEL_TYPE[kind]


def resolve_model(model: str | os.PathLike) -> pathlib.Path:
    """The local checkpoint folder `model` names: a preset (written on first use), an `s3://...` URI
    (copied once per node), or a local folder with a `config.json`."""
    if isinstance(model, str) and model in PRESETS:
        return preset_checkpoint(model)
    if isinstance(model, str) and model.startswith("s3://"):
        from raypipe.models.remote import fetch_model

        return fetch_model(model)
    path = pathlib.Path(model)
    if not (path / "config.json").is_file():
        raise InvalidInput(f"no config.json in {str(path)!r}: expected a preset name {PRESETS}, a local HF "
                           "checkpoint folder or an s3:// URI", item="model")
    return path


def model_for_actors(model: str | os.PathLike, checkpoint: pathlib.Path) -> str:
    """What to hand actors that may start on other nodes: a preset name or an s3:// URI, which each
    node resolves to its own local copy, else the local folder's absolute path."""
    model = os.fspath(model)
    return model if model in PRESETS or model.startswith("s3://") else str(checkpoint.resolve())


def preset_checkpoint(name: str, path: str | os.PathLike | None = None) -> pathlib.Path:
    """The preset's checkpoint folder, written once (deterministically) and reused."""
    family = _BY_PRESET[name]
    target = pathlib.Path(path) if path is not None else \
        default_cache_dir() / f"{name}-{family.model_type}-{PRESET_VERSION}"
    return write_once(target, lambda folder: family.write(folder, name))


def tiny_checkpoint(path: str | os.PathLike | None = None) -> pathlib.Path:
    """The tiny Qwen2.5-VL checkpoint folder."""
    return preset_checkpoint("tiny", path)
