"""Qwen2.5-VL: variable-size images through a windowed ViT, 3-D mrope in the language model."""

from raypipe.models.family import ModelFamily

FAMILY = ModelFamily(
    model_type="qwen2_5_vl",
    vision="raypipe.models.qwen2_5_vl.vision:Qwen2_5_VLVisionAdapter",
    language="raypipe.models.qwen2_5_vl.language:Qwen2_5_VLLanguageAdapter",
    presets=("tiny", "small"),
    write_preset="raypipe.models.qwen2_5_vl.preset:write",
    lora_tower_prefixes=(("model.visual.", ""), ("visual.", "")),  # the tower's blocks and merger
)
