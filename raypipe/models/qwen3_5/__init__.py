"""Qwen3.5 / Qwen3.6, dense and MoE: Qwen3-VL's vision tower without deepstack, a hybrid language model
(gated delta-net layers with a recurrent state and a short convolution, gated full attention every few
layers; dense MLP, or MoE experts plus a shared expert), and a chat template with a thinking switch.

Its own package that builds on `qwen3_vl/` rather than one shared Qwen3 package: everything visual
(geometry, units, timestamped video, the tower's budgeted forwards, positions) is Qwen3-VL's and is
imported from there unchanged, while what differs (the text model, no deepstack columns, the template
and its reasoning output) stays here, so neither family's files branch on the other's model type.
Two records share the package, as Qwen3-VL's do: the registry keys on `config.json`'s `model_type`.
"""

from raypipe.models.family import ModelFamily

_VISION = "raypipe.models.qwen3_5.vision:Qwen3_5VisionAdapter"
_LANGUAGE = "raypipe.models.qwen3_5.language:Qwen3_5LanguageAdapter"
_WRITE = "raypipe.models.qwen3_5.preset:write"
_TOWER = (("model.visual.", ""), ("visual.", ""))  # LoRA on the tower's blocks and mergers

FAMILY = ModelFamily(model_type="qwen3_5", vision=_VISION, language=_LANGUAGE,
                     presets=("tiny-qwen3.5", "small-qwen3.5"), write_preset=_WRITE, reasoning="qwen3",
                     lora_tower_prefixes=_TOWER)
MOE_FAMILY = ModelFamily(model_type="qwen3_5_moe", vision=_VISION, language=_LANGUAGE,
                         presets=("tiny-qwen3.5-moe",), write_preset=_WRITE, reasoning="qwen3",
                         lora_tower_prefixes=_TOWER)
