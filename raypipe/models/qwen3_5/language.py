"""Qwen3.5 language side (dense and MoE): Qwen3-VL's tokens and positions, and the hybrid text model.

Prompt layout and 3-D positions are Qwen3-VL's (`qwen3_vl/positions.py`: transformers 5.23's
`Qwen3_5Model.get_rope_index` splits a video into one `t = 1` grid per temporal group exactly as
Qwen3-VL's does, and vLLM's Qwen3.5 model takes Qwen3-VL's `get_mrope_input_positions`; tests check
both). The decode engine loads transformers' `Qwen3_5TextModel` (`Qwen3_5MoeTextModel`: its router,
experts and shared expert run as transformers runs them) plus `lm_head`, and gives it one cache per
layer kind from `text_config.layer_types` (`decode/cache_kinds.py`): gated-delta-net conv and recurrent
state rows for `linear_attention`, the paged pool for `full_attention`, as for MiniCPM-V 4.6 whose text
model this is. Visual rows are the tower's merger output alone (no deepstack), so the plain
`TextDecoder` scatters them.

MoE checkpoints store each expert's projections apart; `expert_layout.fused_experts` fuses them as
transformers' module holds them.
"""

from __future__ import annotations

import functools

import torch

from raypipe.models.expert_layout import fused_experts
from raypipe.models.qwen2_5_vl.language import LANGUAGE_PREFIXES, VISION_EXCLUDE
from raypipe.models.qwen3_vl.language import Qwen3VLLanguageAdapter
from raypipe.models.text_decoder import TextDecoder


class Qwen3_5LanguageAdapter(Qwen3VLLanguageAdapter):
    def load_model(self, device: torch.device, dtype: torch.dtype, shard=None) -> TextDecoder:
        if self.config.model_type == "qwen3_5_moe":
            from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextModel as text_model
        else:
            from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel as text_model
        convert = functools.partial(fused_experts, config=self.config)
        return TextDecoder.from_checkpoint(self, text_model, device, dtype, prefixes=LANGUAGE_PREFIXES,
                                           exclude=VISION_EXCLUDE, shard=shard, convert=convert)

