"""Model families by name: each family package declares one `ModelFamily` record, read here.

A checkpoint is a preset name (written on first use), an `s3://` URI (copied to this node's cache
once, see `raypipe.models.remote`), a local folder, or a Hugging Face id `org/name[@revision]` (the
hub's cache, else a download: `raypipe.models.hub`); its `config.json` `model_type` picks the family.
`resolve_model` is the one place a model name becomes a folder.
Adding a family: its package under `raypipe/models/` and one entry in `FAMILIES`.
"""

from __future__ import annotations

import difflib
import os
import pathlib

from raypipe.errors import InvalidInput
from raypipe.models import llava_onevision, minicpmv4_6, qwen2_5_vl, qwen3_5, qwen3_vl, step3
from raypipe.models.base import LanguageAdapter, VisionAdapter
from raypipe.models.checkpoint import read_config
from raypipe.models.family import ModelFamily
from raypipe.models.hub import is_hub_id, snapshot_folder
from raypipe.models.presets import PRESET_VERSION, default_cache_dir, write_once
from raypipe.models.quantized.presets import VERSION as QUANTIZED_VERSION, quantized_presets, write_quantized

FAMILIES: tuple[ModelFamily, ...] = (qwen2_5_vl.FAMILY, minicpmv4_6.FAMILY, step3.FAMILY, llava_onevision.FAMILY,
                                     qwen3_vl.FAMILY, qwen3_vl.MOE_FAMILY, qwen3_5.FAMILY, qwen3_5.MOE_FAMILY)

_BY_MODEL_TYPE = {family.model_type: family for family in FAMILIES}
_BY_PRESET = {name: family for family in FAMILIES for name in family.presets}
_QUANTIZED = quantized_presets()  # name -> (base preset, format)
PRESETS = tuple(_BY_PRESET) + tuple(_QUANTIZED)


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
    (copied once per node), a local folder with a `config.json`, or a Hugging Face id (`org/name[@rev]`:
    the hub cache, else downloaded). A folder that exists wins over a hub id of the same spelling."""
    if isinstance(model, str) and model in PRESETS:
        return preset_checkpoint(model)
    if isinstance(model, str) and model.startswith("s3://"):
        from raypipe.models.remote import fetch_model

        return fetch_model(model)
    path = pathlib.Path(model)
    if (path / "config.json").is_file():
        return path
    if isinstance(model, str) and not path.exists() and is_hub_id(model):
        return snapshot_folder(model)
    raise InvalidInput(_not_a_model(os.fspath(model)), item="model", code="model_not_found")


def _not_a_model(model: str) -> str:
    if os.path.isdir(model):
        return f"the folder {model!r} has no config.json: expected a Hugging Face checkpoint folder"
    close = difflib.get_close_matches(model, PRESETS, n=1)
    hint = f"did you mean the preset {close[0]!r}? " if close else ""
    return (f"unknown model {model!r}: {hint}expected a preset ({', '.join(PRESETS)}), a local checkpoint "
            "folder, s3://bucket/prefix/ or a Hugging Face id org/name[@revision]")


def model_for_actors(model: str | os.PathLike, checkpoint: pathlib.Path) -> str:
    """What to hand actors that may start on other nodes: a preset name, an s3:// URI or a hub id, which
    each node resolves to its own local copy, else the local folder's absolute path."""
    model = os.fspath(model)
    if model in PRESETS or model.startswith("s3://") or (is_hub_id(model) and not os.path.exists(model)):
        return model
    return str(checkpoint.resolve())


def preset_checkpoint(name: str, path: str | os.PathLike | None = None) -> pathlib.Path:
    """The preset's checkpoint folder, written once (deterministically) and reused; a quantized preset
    (`raypipe.models.quantized.presets`) is written from its base preset's checkpoint."""
    if name in _QUANTIZED:
        base, fmt = _QUANTIZED[name]
        target = pathlib.Path(path) if path is not None else \
            default_cache_dir() / f"{name}-{PRESET_VERSION}-{QUANTIZED_VERSION}"
        return write_once(target, lambda folder: write_quantized(preset_checkpoint(base), folder, fmt))
    family = _BY_PRESET[name]
    target = pathlib.Path(path) if path is not None else \
        default_cache_dir() / f"{name}-{family.model_type}-{PRESET_VERSION}"
    return write_once(target, lambda folder: family.write(folder, name))


def tiny_checkpoint(path: str | os.PathLike | None = None) -> pathlib.Path:
    """The tiny Qwen2.5-VL checkpoint folder."""
    return preset_checkpoint("tiny", path)
