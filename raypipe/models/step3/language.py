"""Step3 language side: tokenizer facts, plain 1-D positions, and the MoE text model alone.

The decode engine runs transformers' `Step3p7TextModel` (gated attention, sliding-window and
full-attention layers per `layer_types`, mixture-of-experts MLPs with a shared expert) plus
`lm_head`, fed `inputs_embeds` with the image rows scattered over the `<im_patch>` tokens, explicit
positions and one mask per layer type (the engine cache keeps the `sliding_attention` layers' K/V in
blocks freed as they leave the window). MTP layers (`num_nextn_predict_layers`) are not run: greedy decoding does not need them.

Step3 has no multimodal rope: a prompt token's position is its index, image tokens included.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import torch

from raypipe.models.base import LanguageAdapter
from raypipe.models.step3.geometry import IMAGE_TOKEN, Step3Geometry
from raypipe.models.step3.image_processor import load_image_processor
from raypipe.models.step3.loading import load_step3_model
from raypipe.models.text_decoder import TextDecoder


class Step3LanguageAdapter(LanguageAdapter):
    """Config-level knowledge of the language side (no weights): tokens, limits, positions."""

    def __init__(self, checkpoint: str | pathlib.Path):
        super().__init__(checkpoint)
        if self.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) != self.image_token_id:
            raise ValueError(f"{checkpoint}: config image_token_id {self.image_token_id} is not {IMAGE_TOKEN!r}")
        self.geometry = Step3Geometry(load_image_processor(self.checkpoint))

    def token_runs(self, grid: Sequence[int]) -> list[int]:
        return self.geometry.token_runs(tuple(grid))

    def load_model(self, device: torch.device, dtype: torch.dtype, shard=None) -> "Step3LanguageModel":
        if shard is not None:  # it loads through from_pretrained (loading.py), which reads every tensor
            raise ValueError("Step3's language model is not tensor-parallel yet: run it with tensor_parallel_size 1")
        return Step3LanguageModel(self, device, dtype)


class Step3LanguageModel(TextDecoder):
    """Token embeddings, decoder stack, final norm and lm_head of Step3 on one device.

    Loaded through `from_pretrained` (see `loading.py`) rather than `TextDecoder.from_checkpoint`'s
    tensor-prefix loader; embedding, logits and the engine's calls are `TextDecoder`'s.
    """

    def __init__(self, adapter: Step3LanguageAdapter, device: torch.device, dtype: torch.dtype):
        full = load_step3_model(adapter.checkpoint, dtype)
        super().__init__(adapter, full.model.language_model, full.lm_head, device, dtype)

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, attention_mask: dict, cache) -> torch.Tensor:
        # The engine's positions are (3, B, L) rows of equal 1-D indices; Step3's rope takes one row.
        return super().forward(inputs_embeds, position_ids[0], attention_mask, cache)
