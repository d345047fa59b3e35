"""Step3 (`step3p7`): a global view plus sliding-window crops; MoE language model with sliding-window layers."""

from raypipe.models.family import ModelFamily

FAMILY = ModelFamily(
    model_type="step3p7",
    vision="raypipe.models.step3.vision:Step3VisionAdapter",
    language="raypipe.models.step3.language:Step3LanguageAdapter",
    presets=("tiny-step3", "small-step3"),
    # LoRA on the tower's layers and the projector, itself one linear (the tower's `lora_root` names both)
    lora_tower_prefixes=(("model.vision_model.", "vision_model."),
                         ("model.multi_modal_projector.", "multi_modal_projector.")),
    write_preset="raypipe.models.step3.preset:write",
)
