"""Qwen3-VL, dense and MoE: Qwen2.5-VL's geometry, a tower with deepstack levels the language model adds
to its first layers' hidden states, interleaved mrope.

Two records share the package: the registry picks a family by `config.json`'s `model_type`, and the
dense (`qwen3_vl`) and MoE (`qwen3_vl_moe`) checkpoints have different ones. Everything but the text
model class is the same, so both records name the same adapters; the language adapter loads the text
model of the checkpoint's kind.
"""

from raypipe.models.family import ModelFamily

_VISION = "raypipe.models.qwen3_vl.vision:Qwen3VLVisionAdapter"
_LANGUAGE = "raypipe.models.qwen3_vl.language:Qwen3VLLanguageAdapter"
_WRITE = "raypipe.models.qwen3_vl.preset:write"
_TOWER = (("model.visual.", ""), ("visual.", ""))  # LoRA on the tower's blocks and mergers

FAMILY = ModelFamily(model_type="qwen3_vl", vision=_VISION, language=_LANGUAGE,
                     presets=("tiny-qwen3-vl", "small-qwen3-vl"), write_preset=_WRITE,
                     lora_tower_prefixes=_TOWER)
MOE_FAMILY = ModelFamily(model_type="qwen3_vl_moe", vision=_VISION, language=_LANGUAGE,
                         presets=("tiny-qwen3-vl-moe",), write_preset=_WRITE,
                         lora_tower_prefixes=_TOWER)
