"""LLaVA-OneVision: a SigLIP tower on fixed-size AnyRes tiles plus a base view; a Qwen2 language model."""

from raypipe.models.family import ModelFamily

FAMILY = ModelFamily(
    model_type="llava_onevision",
    vision="raypipe.models.llava_onevision.vision:LlavaOnevisionVisionAdapter",
    language="raypipe.models.llava_onevision.language:LlavaOnevisionLanguageAdapter",
    presets=("tiny-llava-ov", "small-llava-ov"),
    # LoRA on the SigLIP tower's layers and the projector (the tower's `lora_root` names both)
    lora_tower_prefixes=(("model.vision_tower.", "vision_tower."),
                         ("model.multi_modal_projector.", "multi_modal_projector.")),
    write_preset="raypipe.models.llava_onevision.preset:write",
)
