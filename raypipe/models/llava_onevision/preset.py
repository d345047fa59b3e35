"""Deterministic tiny LLaVA-OneVision checkpoints (SigLIP tower, AnyRes tiles, Qwen2 text model), real HF folders.

Same recipe as every preset (`raypipe.models.presets`): seeded random weights, `initializer_range=0.2`
in every sub-config, a byte-level tokenizer with `<image>` / `<video>` and a chat template, the
family's Pillow image processor config. `LlavaOnevisionProcessor` itself cannot be built here (it
checks for a video processor, which needs torchvision), so its `processor_config.json` is written as
the released checkpoints carry it.

- `tiny-llava-ov` (test oracle): 56 px tiles of 4x4 patches, pinpoints up to 3x3 tiles and
  `anyres_max_4`, so large grids take the bilinear-shrink path of the packing.
- `small-llava-ov` (benchmarks): the release's 384 px tiles (27x27 patches) and `anyres_max_9` with
  pinpoints up to 3x3 tiles (the release goes to 6x6), a narrower and shallower SigLIP and Qwen2.
"""

from __future__ import annotations

import json
import pathlib

from raypipe.models.presets import build_byte_tokenizer, chat_template, padded_vocab_size, save_preset

IMAGE_TOKEN, VIDEO_TOKEN = "<image>", "<video>"
# The released template puts `<image>\n` per image part and `<video>\n` per video part; raypipe's prompt
# builder (and transformers' processor) expand each to the item's rows.
LLAVA_OV_CHAT_TEMPLATE = chat_template(IMAGE_TOKEN + "\n", video_part=VIDEO_TOKEN + "\n")


def _pinpoints(tile: int, most: int) -> list[list[int]]:
    return [[tile * r, tile * c] for r in range(1, most + 1) for c in range(1, most + 1)]


SHAPES = {
    "tiny-llava-ov": dict(
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
        pinpoints=_pinpoints(56, 3), aspect="anyres_max_4",
    ),
    "small-llava-ov": dict(
        vision=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=4,
                    image_size=384),
        text=dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2),
        pinpoints=_pinpoints(384, 3), aspect="anyres_max_9",
    ),
}


def write(folder: pathlib.Path, name: str) -> None:
    import torch
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    shape = SHAPES[name]
    tokenizer = build_byte_tokenizer(["<|im_start|>", "<|im_end|>", IMAGE_TOKEN, VIDEO_TOKEN], LLAVA_OV_CHAT_TEMPLATE,
                                     eos="<|im_end|>", pad="<|endoftext|>", unk="<|endoftext|>")
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    init = 0.2
    vision = shape["vision"]
    config = LlavaOnevisionConfig(
        vision_config=dict(vision, model_type="siglip_vision_model", patch_size=14, vision_use_head=False,
                           initializer_range=init),
        text_config=dict(shape["text"], model_type="qwen2", vocab_size=padded_vocab_size(tokenizer),
                         max_position_embeddings=4096, initializer_range=init, rope_theta=10000.0,
                         bos_token_id=pad, eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=False),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        video_token_index=tokenizer.convert_tokens_to_ids(VIDEO_TOKEN),
        image_grid_pinpoints=shape["pinpoints"],
        vision_aspect_ratio=shape["aspect"],
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        initializer_range=init,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlavaOnevisionForConditionalGeneration(config).eval()
    save_preset(folder, model, tokenizer, eos_id=eos, pad_id=pad)
    side = vision["image_size"]
    LlavaOnevisionImageProcessorPil(size={"height": side, "width": side},
                                    image_grid_pinpoints=shape["pinpoints"]).save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaOnevisionProcessor", "image_token": IMAGE_TOKEN, "video_token": VIDEO_TOKEN,
        "num_image_tokens": (side // 14) ** 2, "vision_feature_select_strategy": "full",
        "vision_aspect_ratio": shape["aspect"]}, indent=2))
