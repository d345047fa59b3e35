"""Qwen2.5-VL language side: tokenizer facts, 3-D mrope positions, and the language model alone.

The decode engine never holds the vision tower. It loads transformers' `Qwen2_5_VLTextModel` plus
`lm_head` from the checkpoint's language tensors only, and drives it with `inputs_embeds` (text
embeddings with image embeddings scattered at the `<|image_pad|>` tokens), explicit 3-D
`position_ids` and a 4-D attention mask the engine builds itself.

Positions come from transformers' own `get_rope_index`, bound to a config-only object so that no
vision weights are needed; it is pure CPU work done once per request.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import torch

from raypipe.models.checkpoint import load_module_weights, load_tensors
from raypipe.models.language_model import DecoderLM, LanguageAdapter

# Both layouts occur: the original release (`model.layers...`) and newer transformers saves.
LANGUAGE_PREFIXES = ("model.language_model.", "model.")
LM_HEAD_PREFIXES = ("lm_head.",)
VISION_EXCLUDE = ("visual.", "model.visual.")


class _RopeIndex:
    """transformers' mrope position code, without the model it normally lives on."""

    def __init__(self, config):
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

        self.config = config
        # Plain functions taken from the class: they only read `self.config` and each other.
        self._get_rope_index = Qwen2_5_VLModel.get_rope_index
        self.get_vision_position_ids = Qwen2_5_VLModel.get_vision_position_ids.__get__(self)

    def __call__(self, input_ids, mm_token_type_ids, image_grid_thw):
        return self._get_rope_index(self, input_ids, mm_token_type_ids, image_grid_thw=image_grid_thw)


class Qwen2_5_VLLanguageAdapter(LanguageAdapter):
    """Config-level knowledge of the language side (no weights): tokens, limits, positions."""

    def __init__(self, checkpoint: str | pathlib.Path):
        super().__init__(checkpoint)
        self.vision_start_token_id = self.config.vision_start_token_id
        self.vision_end_token_id = self.config.vision_end_token_id
        self.merge = self.config.vision_config.spatial_merge_size
        self._rope_index = _RopeIndex(self.config)

    def tokens_per_image(self, grid: Sequence[int]) -> int:
        t, h, w = grid
        return t * h * w // self.merge**2

    def image_token_runs(self, grid: Sequence[int]) -> list[int]:
        """An image is one run of `<|image_pad|>` in the prompt."""
        return [self.tokens_per_image(grid)]

    def positions(self, token_ids: Sequence[int], grids: Sequence[Sequence[int]]) -> tuple[torch.Tensor, int]:
        """`(position_ids (3, L), rope_delta)` of one prompt; decode position = index + rope_delta."""
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        if not grids:  # text only: plain 1-D positions on all three axes
            return torch.arange(ids.shape[1]).expand(3, -1).clone(), 0
        mm_token_type_ids = (ids == self.image_token_id).int()
        grid_thw = torch.tensor([list(g) for g in grids], dtype=torch.long)
        position_ids, rope_deltas = self._rope_index(ids, mm_token_type_ids, grid_thw)
        return position_ids[:, 0], int(rope_deltas[0, 0])

    def load_model(self, device: torch.device, dtype: torch.dtype) -> "Qwen2_5_VLLanguageModel":
        return Qwen2_5_VLLanguageModel(self, device, dtype)


class Qwen2_5_VLLanguageModel(DecoderLM):
    """Token embeddings, decoder stack, final norm and lm_head of Qwen2.5-VL on one device."""

    def __init__(self, adapter: Qwen2_5_VLLanguageAdapter, device: torch.device, dtype: torch.dtype):
        from transformers.initialization import no_init_weights
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel

        super().__init__()
        text_config = adapter.text_config
        with no_init_weights():  # weights come from the checkpoint; skip the random init
            self.model = Qwen2_5_VLTextModel._from_config(text_config, dtype=dtype)
            self.lm_head = torch.nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False, dtype=dtype)
        state = load_tensors(adapter.checkpoint, LANGUAGE_PREFIXES, dtype=dtype,
                             exclude=VISION_EXCLUDE + LM_HEAD_PREFIXES)
        load_module_weights(self.model, state, what=f"{adapter.checkpoint} language model")
        if getattr(adapter.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            head = load_tensors(adapter.checkpoint, LM_HEAD_PREFIXES, dtype=dtype)
            load_module_weights(self.lm_head, head, what=f"{adapter.checkpoint} lm_head")
        self.to(device).eval()
        self.device = torch.device(device)
        self.dtype = dtype
        self.image_token_id = adapter.image_token_id

