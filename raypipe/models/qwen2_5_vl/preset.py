"""`tiny` and `small`: deterministic Qwen2.5-VL checkpoints (see `raypipe.models.presets` for the recipe)."""

from __future__ import annotations

import pathlib

from raypipe.models.presets import (
    build_byte_tokenizer,
    chat_template,
    padded_vocab_size,
    save_preset,
)
from raypipe.models.qwen2_5_vl.video import VIDEO_PROCESSOR_CONFIG, QwenVideoConfig

# Qwen's special tokens, in the order the real vocabulary has them.
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen2.5-VL's chat template, reduced to what raypipe serves (text, image and video parts).
QWEN_CHAT_TEMPLATE = chat_template("<|vision_start|><|image_pad|><|vision_end|>",
                                   default_system="You are a helpful assistant.",
                                   video_part="<|vision_start|><|video_pad|><|vision_end|>")

# name -> (vision kwargs, text kwargs, image-processor pixel bounds, video-processor per-frame pixel bounds)
SHAPES = {
    # CPU test oracle: depth 2 = one window block + one full-attention block.
    "tiny": dict(
        vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, fullatt_block_indexes=[1]),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, mrope_section=[2, 3, 3]),
        min_pixels=28 * 28 * 4,
        max_pixels=28 * 28 * 256,
        video_min_pixels=28 * 28 * 4,
        video_max_pixels=28 * 28 * 64,  # small frames: a 64-frame video stays cheap on a CPU
    ),
    # Realistic shape scaled to a CPU (~70M parameters): used by benchmarks, not tests.
    "small": dict(
        vision=dict(depth=8, hidden_size=256, intermediate_size=688, num_heads=4, fullatt_block_indexes=[3, 7]),
        text=dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, mrope_section=[8, 12, 12]),
        min_pixels=28 * 28 * 4,
        max_pixels=28 * 28 * 1024,  # Qwen2.5-VL ships 28*28*1280
        video_min_pixels=28 * 28 * 16,
        video_max_pixels=28 * 28 * 256,  # transformers' default is 28*28*768
    ),
}


def write(folder: pathlib.Path, name: str) -> None:
    write_shape(folder, SHAPES[name])


def write_shape(folder: pathlib.Path, shape: dict) -> None:
    """A checkpoint of `shape` (an entry like `SHAPES`'): the GPU check writes a larger one on its machine."""
    import json

    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tokenizer = build_byte_tokenizer(QWEN_SPECIAL_TOKENS, QWEN_CHAT_TEMPLATE, eos="<|im_end|>", pad="<|endoftext|>")
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in QWEN_SPECIAL_TOKENS}
    text = dict(shape["text"])
    mrope_section = text.pop("mrope_section")
    init = 0.2
    config = Qwen2_5_VLConfig(
        vision_config=dict(shape["vision"], out_hidden_size=text["hidden_size"], patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           initializer_range=init),
        text_config=dict(text, vocab_size=padded_vocab_size(tokenizer), max_position_embeddings=4096,
                         initializer_range=init,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": mrope_section},
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"]),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        initializer_range=init,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    save_preset(folder, model, tokenizer, eos_id=ids["<|im_end|>"], pad_id=ids["<|endoftext|>"])
    Qwen2VLImageProcessorPil(min_pixels=shape["min_pixels"], max_pixels=shape["max_pixels"], patch_size=14,
                             merge_size=2, temporal_patch_size=2).save_pretrained(folder)
    video = QwenVideoConfig(min_pixels=shape["video_min_pixels"], max_pixels=shape["video_max_pixels"])
    (folder / VIDEO_PROCESSOR_CONFIG).write_text(json.dumps(video.to_json(), indent=2))
