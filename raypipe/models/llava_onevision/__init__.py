"""LLaVA-OneVision: a SigLIP tower on fixed-size AnyRes tiles plus a base view; a Qwen2 language model."""

from raypipe.models.family import ModelFamily

FAMILY = ModelFamily(
    model_type="llava_onevision",
    vision="raypipe.models.llava_onevision.vision:LlavaOnevisionVisionAdapter",
    language="raypipe.models.llava_onevision.language:LlavaOnevisionLanguageAdapter",
    presets=("tiny-llava-ov", "small-llava-ov"),
    write_preset="raypipe.models.llava_onevision.preset:write",
)
