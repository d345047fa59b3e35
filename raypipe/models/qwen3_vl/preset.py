"""`tiny-qwen3-vl`, `tiny-qwen3-vl-moe`, `small-qwen3-vl`: deterministic Qwen3-VL checkpoints
(`raypipe.models.presets` has the recipe).

The tiny presets put deepstack levels after the language model's layers 0 and 1 of 3, so dropping a
level or misplacing it changes greedy tokens (tests/test_qwen3_vl_decode.py shows it); the MoE one
routes every layer through 4 experts, 2 per token.
"""

from __future__ import annotations

import pathlib

from raypipe.models.presets import build_byte_tokenizer, chat_template, padded_vocab_size, save_preset
from raypipe.models.qwen2_5_vl.preset import QWEN_SPECIAL_TOKENS
from raypipe.models.qwen2_5_vl.video import VIDEO_PROCESSOR_CONFIG
from raypipe.models.qwen3_vl.video import Qwen3VideoConfig

# Qwen3-VL's chat template, reduced to what raypipe serves: no default system turn (Qwen3-VL has none).
QWEN3_VL_CHAT_TEMPLATE = chat_template("<|vision_start|><|image_pad|><|vision_end|>",
                                       video_part="<|vision_start|><|video_pad|><|vision_end|>")

_TINY_VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, num_position_embeddings=64,
                    deepstack_visual_indexes=[0, 1])
_TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, mrope_section=[2, 3, 3])

# name -> (vision kwargs, text kwargs, MoE kwargs or None, image-processor pixel bounds, video-processor
# whole-clip pixel bounds)
SHAPES = {
    "tiny-qwen3-vl": dict(vision=_TINY_VISION, text=_TINY_TEXT, moe=None,
                          min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 256,
                          video_min_pixels=32 * 32 * 8, video_max_pixels=32 * 32 * 16 * 64),
    "tiny-qwen3-vl-moe": dict(vision=_TINY_VISION, text=_TINY_TEXT,
                              moe=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                       decoder_sparse_step=1),
                              min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 256,
                              video_min_pixels=32 * 32 * 8, video_max_pixels=32 * 32 * 16 * 64),
    # Realistic proportions scaled to a CPU (Qwen3-VL-2B: depth 24, deepstack 5/11/17): benchmarks, not tests.
    "small-qwen3-vl": dict(
        vision=dict(depth=8, hidden_size=256, intermediate_size=688, num_heads=4, num_position_embeddings=2304,
                    deepstack_visual_indexes=[1, 3, 5]),
        text=dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, mrope_section=[8, 12, 12]),
        moe=None, min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 1024,
        video_min_pixels=32 * 32 * 16, video_max_pixels=32 * 32 * 256 * 128),  # Qwen3-VL ships 32*32*768*32
}
PRESETS = tuple(SHAPES)


def write(folder: pathlib.Path, name: str) -> None:
    import torch
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    shape = SHAPES[name]
    tokenizer = build_byte_tokenizer(QWEN_SPECIAL_TOKENS, QWEN3_VL_CHAT_TEMPLATE, eos="<|im_end|>",
                                     pad="<|endoftext|>")
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in QWEN_SPECIAL_TOKENS}
    text = dict(shape["text"])
    rope = {"rope_theta": 5000000.0, "mrope_section": text.pop("mrope_section")}
    config_class, model_class = ((Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration) if shape["moe"]
                                 else (Qwen3VLConfig, Qwen3VLForConditionalGeneration))
    config = config_class(**config_kwargs(shape, text, rope, tokenizer, ids))
    torch.manual_seed(0)
    model = model_class(config).eval()
    save_preset(folder, model, tokenizer, eos_id=ids["<|im_end|>"], pad_id=ids["<|endoftext|>"])
    write_processors(folder, shape)


def config_kwargs(shape: dict, text: dict, rope: dict, tokenizer, ids: dict) -> dict:
    """The config of a Qwen3-VL-tower checkpoint (Qwen3.5's too): `text` (its rope keys taken out into
    `rope`) with the MoE fields, interleaved mrope and `initializer_range` 0.2 everywhere (the tiny presets
    are oracles: wrong positions must change greedy tokens), the tower sized to the text width, token ids."""
    init = 0.2
    text_config = dict(text, **(shape["moe"] or {}), vocab_size=padded_vocab_size(tokenizer),
                       max_position_embeddings=4096, initializer_range=init,
                       rope_parameters={"rope_type": "default", **rope, "mrope_interleaved": True},
                       bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                       pad_token_id=ids["<|endoftext|>"])
    return dict(
        vision_config=dict(shape["vision"], out_hidden_size=text["hidden_size"], patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, initializer_range=init),
        text_config=text_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def write_processors(folder: pathlib.Path, shape: dict) -> None:
    """The image- and video-processor configs of a Qwen3-VL-tower checkpoint (Qwen3.5's too): Qwen2-VL's
    image processor with 16-pixel patches and mean/std 0.5, and the video sampling of `Qwen3VideoConfig`."""
    import json

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(min_pixels=shape["min_pixels"], max_pixels=shape["max_pixels"], patch_size=16,
                             merge_size=2, temporal_patch_size=2, image_mean=[0.5, 0.5, 0.5],
                             image_std=[0.5, 0.5, 0.5]).save_pretrained(folder)
    video = Qwen3VideoConfig(min_pixels=shape["video_min_pixels"], max_pixels=shape["video_max_pixels"])
    (folder / VIDEO_PROCESSOR_CONFIG).write_text(json.dumps(video.to_json(), indent=2))
