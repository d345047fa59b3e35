"""Qwen3.5 vision side: Qwen3-VL's adapter (geometry, units, timestamped video, budgeted forwards) over
transformers' `Qwen3_5VisionModel` (`Qwen3_5MoeVisionModel` in MoE checkpoints), the same forward without
deepstack mergers, so an item's embedding is the merger's rows alone (`hidden_size` = the text width)."""

from __future__ import annotations

from raypipe.errors import InvalidInput
from raypipe.inputs.media import DecodedVisual
from raypipe.models.base import VisionItem, VisualLayout
from raypipe.models.qwen3_vl.vision import Qwen3VLVisionAdapter


class Qwen3_5VisionAdapter(Qwen3VLVisionAdapter):
    def tower_class(self):
        if self.config.model_type == "qwen3_5_moe":
            from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

            return Qwen3_5MoeVisionModel
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

        return Qwen3_5VisionModel

    def layout(self, visual: DecodedVisual, item: VisionItem, pruning_rate: float = 0.0) -> VisualLayout:
        if pruning_rate > 0:
            # Qwen3-VL's EVS (vLLM's per-group rule) is held by tests for Qwen3-VL only: refused here rather than
            # served without an oracle run for this family.
            raise InvalidInput("EVS (video_pruning_rate) is not supported for Qwen3.5 yet", item="video_pruning_rate",
                               code="invalid_video_pruning_rate")
        return super().layout(visual, item)
