"""MiniCPM-V 4.6: an image is an overview plus slices; hybrid gated-delta-net / attention language model."""

from raypipe.models.family import ModelFamily

FAMILY = ModelFamily(
    model_type="minicpmv4_6",
    vision="raypipe.models.minicpmv4_6.vision:MiniCPMV4_6VisionAdapter",
    language="raypipe.models.minicpmv4_6.language:MiniCPMV4_6LanguageAdapter",
    presets=("tiny-minicpmv", "small-minicpmv"),
    # LoRA on the tower's layers (its vit_merger too) and the merger (the tower's `lora_root` names both)
    lora_tower_prefixes=(("model.vision_tower.", "vision_tower."), ("model.merger.", "merger.")),
    write_preset="raypipe.models.minicpmv4_6.preset:write",
)
