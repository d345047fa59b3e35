"""Qwen3.5 vision side: Qwen3-VL's adapter (geometry, units, timestamped video, budgeted forwards) over
transformers' `Qwen3_5VisionModel` (`Qwen3_5MoeVisionModel` in MoE checkpoints), the same forward without
deepstack mergers, so an item's embedding is the merger's rows alone (`hidden_size` = the text width)."""

from __future__ import annotations

from raypipe.models.qwen3_vl.vision import Qwen3VLVisionAdapter


class Qwen3_5VisionAdapter(Qwen3VLVisionAdapter):
    def tower_class(self):
        if self.config.model_type == "qwen3_5_moe":
            from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

            return Qwen3_5MoeVisionModel
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

        return Qwen3_5VisionModel
