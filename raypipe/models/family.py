"""`ModelFamily`: the one record a model family package declares to the registry.

A record names the checkpoint `model_type` it serves, where its adapters live, which presets
it writes and how its chat answers carry reasoning. Adapters and preset writers are named as `"module:attribute"` strings and imported on
first use, so reading the registry never imports torch or a transformers model class.
"""

from __future__ import annotations

import dataclasses
import importlib


@dataclasses.dataclass(frozen=True, slots=True)
class ModelFamily:
    model_type: str  # `config.json`'s model_type
    vision: str  # "module:Class" of the `VisionAdapter`
    language: str  # "module:Class" of the `LanguageAdapter`
    presets: tuple[str, ...] = ()  # preset names this family writes
    write_preset: str = ""  # "module:function(folder, name)" writing one preset's checkpoint
    # how a chat answer's reasoning is told from its content (`models/reasoning.py`): "qwen3" (a
    # `<think>` block the template opens), or "" (no reasoning output)
    reasoning: str = ""
    # the vision tower's modules that the encoders apply LoRA adapters on (`models/lora.py`,
    # `encode/tower_lora.py`): (checkpoint prefix, the same modules' prefix inside the tower's `lora_root`)
    # pairs; empty: an adapter on this family's tower is refused
    lora_tower_prefixes: tuple[tuple[str, str], ...] = ()

    def vision_adapter(self, checkpoint):
        return _load(self.vision)(checkpoint)

    def language_adapter(self, checkpoint):
        return _load(self.language)(checkpoint)

    def write(self, folder, name: str) -> None:
        _load(self.write_preset)(folder, name)

    def thinks(self, chat_template_kwargs: dict | None) -> bool:
        """Whether a chat answer starts inside a thinking block: the family reasons and the request did not
        switch thinking off (Qwen3.5's template thinks unless `enable_thinking` is false)."""
        return bool(self.reasoning) and (chat_template_kwargs or {}).get("enable_thinking", True) is not False


def _load(target: str):
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)
