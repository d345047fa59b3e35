"""Step3 (`step3p7`): a global view plus sliding-window crops; MoE language model with sliding-window layers."""

from raypipe.models.family import ModelFamily

FAMILY = ModelFamily(
    model_type="step3p7",
    vision="raypipe.models.step3.vision:Step3VisionAdapter",
    language="raypipe.models.step3.language:Step3LanguageAdapter",
    presets=("tiny-step3", "small-step3"),
    write_preset="raypipe.models.step3.preset:write",
)
