"""Step3 language side: tokenizer facts, plain 1-D positions, and the MoE text model alone.

The decode engine runs transformers' `Step3p7TextModel` (gated attention, sliding-window and
full-attention layers per `layer_types`, mixture-of-experts MLPs with a shared expert) plus
`lm_head`, fed `inputs_embeds` with the image rows scattered over the `<im_patch>` tokens, explicit
positions and one mask per layer type (the engine cache keeps the `sliding_attention` layers' K/V in
blocks freed as they leave the window). MTP layers (`num_nextn_predict_layers`) are not run: greedy decoding does not need them.

One device loads the whole checkpoint through `from_pretrained` (`loading.py`); a rank of a decode
group (`shard`, raypipe/parallel/step3_shards.py) builds the text model alone, lets the shard give
its layers this rank's shapes, and reads only its slices (`loading.language_shard_tensors`).

Step3 has no multimodal rope: a prompt token's position is its index, image tokens included.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import torch

from raypipe.models.base import LanguageAdapter
from raypipe.models.step3.geometry import IMAGE_TOKEN, Step3Geometry
from raypipe.models.step3.grouped_experts import group_experts
from raypipe.models.step3.image_processor import load_image_processor
from raypipe.models.checkpoint import load_module_weights
from raypipe.models.step3.loading import LANGUAGE_PREFIX, language_shard_tensors, load_step3_model
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
        if shard is not None:
            return Step3LanguageModel.load_shard(self, device, dtype, shard)
        full = load_step3_model(self.checkpoint, dtype)
        group_experts(full.model.language_model, device)
        return Step3LanguageModel(self, full.model.language_model, full.lm_head, device, dtype)


class Step3LanguageModel(TextDecoder):
    """Token embeddings, decoder stack, final norm and lm_head of Step3 (one device's, or one rank's shard).

    Loaded through `loading.py` rather than `TextDecoder.from_checkpoint`'s tensor-prefix loader
    (Step3's checkpoint layout needs transformers' conversion); embedding, logits and the engine's
    calls are `TextDecoder`'s.
    """

    checkpoint_bytes_read: int | None = None  # a rank's shard: bytes its process read from the checkpoint
    key_prefixes = (LANGUAGE_PREFIX,)  # transformers' Step3p7ForConditionalGeneration's names (a LoRA adapter's)

    @classmethod
    def load_shard(cls, adapter: Step3LanguageAdapter, device: torch.device, dtype: torch.dtype,
                   shard) -> "Step3LanguageModel":
        """This rank's shard: `shard.prepare` gives the layers its shapes, `shard.read` picks its slices."""
        from transformers.initialization import no_init_weights
        from transformers.models.step3p7.modeling_step3p7 import Step3p7TextModel

        text_config = adapter.text_config
        with no_init_weights():  # weights come from the checkpoint; skip the random init
            model = Step3p7TextModel._from_config(text_config, dtype=dtype)
            lm_head = torch.nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False, dtype=dtype)
        shard.prepare(model)
        tensors = language_shard_tensors(adapter.checkpoint, text_config, dtype, shard.read)
        load_module_weights(model, tensors.state, what=f"{adapter.checkpoint} language model shard")
        if tensors.head is None:
            lm_head.weight = model.embed_tokens.weight
        else:
            load_module_weights(lm_head, {"weight": tensors.head}, what=f"{adapter.checkpoint} lm_head")
        group_experts(model, device)
        loaded = cls(adapter, model, lm_head, device, dtype)
        loaded.checkpoint_bytes_read = tensors.bytes_read
        return loaded

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, attention_mask: dict, cache) -> torch.Tensor:
        # The engine's positions are (3, B, L) rows of equal 1-D indices; Step3's rope takes one row.
        return super().forward(inputs_embeds, position_ids[0], attention_mask, cache)
