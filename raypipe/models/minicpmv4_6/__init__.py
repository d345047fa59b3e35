"""MiniCPM-V 4.6: an image is an overview plus slices; hybrid gated-delta-net / attention language model."""

from raypipe.models.family import ModelFamily

FAMILY = ModelFamily(
    model_type="minicpmv4_6",
    vision="raypipe.models.minicpmv4_6.vision:MiniCPMV4_6VisionAdapter",
    language="raypipe.models.minicpmv4_6.language:MiniCPMV4_6LanguageAdapter",
    presets=("tiny-minicpmv", "small-minicpmv"),
    write_preset="raypipe.models.minicpmv4_6.preset:write",
)
