"""Qwen3-VL language side (dense and MoE): tokenizer facts, positions, and the language model alone with
deepstack.

The decode engine loads transformers' `Qwen3VLTextModel` (or `Qwen3VLMoeTextModel`: its experts run as
transformers runs them) plus `lm_head`, and drives it with explicit 3-D positions (`positions.py`).
Visual rows arrive as `(tokens, hidden * (1 + levels))` (`vision.py`); `DeepstackTextDecoder` writes the
first `hidden` columns over the placeholder tokens and hands the levels to the text model's own
deepstack path, which adds level `i` to the hidden states at the visual positions after layer `i`.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Sequence

import torch

from raypipe.models.base import VisualLayout
from raypipe.models.expert_layout import fused_experts
from raypipe.models.prompt import token_runs
from raypipe.models.qwen2_5_vl.language import LANGUAGE_PREFIXES, VISION_EXCLUDE, Qwen2_5_VLLanguageAdapter
from raypipe.models.qwen3_vl.positions import qwen3_positions
from raypipe.models.qwen3_vl.vision import deepstack_levels
from raypipe.models.text_decoder import TextDecoder


class Qwen3VLLanguageAdapter(Qwen2_5_VLLanguageAdapter):
    """Qwen2.5-VL's tokens, with a video's runs per temporal group, Qwen3-VL's positions and text model."""

    def __init__(self, checkpoint: str | pathlib.Path):
        super().__init__(checkpoint)
        self.levels = deepstack_levels(self.config.vision_config)
        self.embedding_width = self.hidden_size * (1 + self.levels)

    def token_runs(self, grid: Sequence[int]) -> list[int]:
        t, h, w = grid
        return [h * w // self.merge**2] * t  # an image's one run; a video's one run per temporal group

    def positions(self, token_ids: Sequence[int], layouts: Sequence[VisualLayout],
                  kept: Sequence[torch.Tensor | None] = ()) -> tuple[torch.Tensor, int]:
        """`(position_ids (3, L), rope_delta)`: `positions.py`'s rule; an EVS-pruned video's positions follow from
        its geometry and rate (vLLM's Qwen3-VL rule), not from the retention masks `kept`."""
        runs = token_runs(token_ids, tuple(self.placeholder_token_ids.values()))
        return qwen3_positions(runs, len(token_ids), layouts, self.merge)

    def load_model(self, device: torch.device, dtype: torch.dtype, shard=None) -> "DeepstackTextDecoder":
        if self.config.model_type == "qwen3_vl_moe":
            from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextModel as text_model
        else:
            from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel as text_model
        # Qwen's -FP8 releases store the experts apart: fused on load (`expert_layout.py`)
        convert = functools.partial(fused_experts, config=self.config)
        return DeepstackTextDecoder.from_checkpoint(self, text_model, device, dtype, prefixes=LANGUAGE_PREFIXES,
                                                    exclude=VISION_EXCLUDE, shard=shard, convert=convert)


class DeepstackTextDecoder(TextDecoder):
    """A text decoder whose visual rows carry deepstack levels after the main embedding's columns."""

    def __init__(self, adapter, model, lm_head, device, dtype):
        super().__init__(adapter, model, lm_head, device, dtype)
        self.hidden = adapter.hidden_size

    def embed(self, input_ids: torch.Tensor, visual_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return super().embed(input_ids, None if visual_embeds is None else visual_embeds[:, :self.hidden])

    def prefill(self, input_ids: torch.Tensor, visual_embeds: torch.Tensor | None, position_ids: torch.Tensor,
                attention_mask: dict, cache) -> torch.Tensor:
        """As `TextDecoder.prefill`, the levels added by transformers' own `_deepstack_process` at the
        placeholder tokens of `input_ids` (row-major, the order of `visual_embeds`'s rows)."""
        if visual_embeds is None or not visual_embeds.numel():
            return super().prefill(input_ids, visual_embeds, position_ids, attention_mask, cache)
        levels = list(visual_embeds[:, self.hidden:].split(self.hidden, dim=-1))
        out = self.model(inputs_embeds=self.embed(input_ids, visual_embeds), position_ids=position_ids,
                         attention_mask=_full_attention(attention_mask), past_key_values=cache, use_cache=True,
                         visual_pos_masks=torch.isin(input_ids, self.placeholder_ids),
                         deepstack_visual_embeds=levels)
        return out.last_hidden_state

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, attention_mask: dict, cache
                ) -> torch.Tensor:
        return super().forward(inputs_embeds, position_ids, _full_attention(attention_mask), cache)


def _full_attention(masks: dict):
    """Qwen3-VL's text model has full-attention layers only and builds its mask itself from a 4-D one (which
    it passes through unchanged), not from the engine's per-layer-type dict."""
    return masks["full_attention"]
