"""Deterministic tiny MiniCPM-V 4.6 checkpoints (SigLIP-style tower with the window merger, hybrid
gated-delta-net / full-attention Qwen3.5 text model), written as real HF folders.

Same recipe as every preset (`raypipe.models.presets`): seeded random weights, `initializer_range=0.2` in
every sub-config, a byte-level tokenizer with the family's special tokens and a chat template, the
family's own Pillow image processor config. The processor's token attributes (`image_token`,
`slice_start_token`, ...) are the tokenizer's named extra special tokens, as transformers'
`MiniCPMV4_6Processor` reads them.
"""

from __future__ import annotations

import pathlib

from raypipe.models.presets import (
    build_byte_tokenizer,
    chat_template,
    padded_vocab_size,
    save_preset,
    slow_linear_attention_decay,
)

# Named tokens the processor reads from the tokenizer (attribute -> token).
MINICPMV_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "image_start_token": "<image>",
    "image_end_token": "</image>",
    "slice_start_token": "<slice>",
    "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>",
    "image_id_end_token": "</image_id>",
}

# Qwen-style chat; each image part renders one `<|image_pad|>`, which the processor (and raypipe's
# prompt builder) expands to `<image_id>N</image_id><image>...</image><slice>...</slice>...`; each video
# part one `<|video_pad|>`, expanded to its id and every visual unit's `<image>...</image><slice>...`.
MINICPMV_CHAT_TEMPLATE = chat_template("<|image_pad|>\n", video_part="<|video_pad|>\n")

SHAPES = {
    # CPU test oracle: vision depth 2 with the window merger after layer 0; text layers
    # linear, linear, full (two gated-delta-net layers and one attention layer).
    "tiny-minicpmv": dict(
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    image_size=224),
        insert_layer_id=0,
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4,
                  layer_types=["linear_attention", "linear_attention", "full_attention"]),
        scale_resolution=224,
        # Canvases of two sub-second frames per second; a small cap so tests reach it with short videos.
        video=dict(stack_frames=3, max_num_frames=8),
    ),
    # Realistic proportions scaled to a CPU: benchmarks, not tests. 448 px slices like the release.
    "small-minicpmv": dict(
        vision=dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=4,
                    image_size=448),
        insert_layer_id=3,
        text=dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
                  linear_num_key_heads=4, linear_num_value_heads=8, linear_conv_kernel_dim=4,
                  layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2),
        scale_resolution=448,
        video=dict(stack_frames=2, max_num_frames=128),
    ),
}


def write(folder: pathlib.Path, name: str) -> None:
    import torch
    from transformers import MiniCPMV4_6Config, MiniCPMV4_6ForConditionalGeneration
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import MiniCPMV4_6ImageProcessorPil
    from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import MiniCPMV4_6VideoProcessor

    shape = SHAPES[name]
    tokenizer = build_byte_tokenizer(["<|im_start|>", "<|im_end|>", *MINICPMV_TOKENS.values()], MINICPMV_CHAT_TEMPLATE,
                                     eos="<|im_end|>", pad="<|endoftext|>", unk="<|endoftext|>", named=MINICPMV_TOKENS)
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    init = 0.2
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1] if name == "tiny-minicpmv" else [6, 5, 5], "mrope_interleaved": True}
    config = MiniCPMV4_6Config(
        vision_config=dict(shape["vision"], patch_size=14, initializer_range=init),
        text_config=dict(shape["text"], model_type="qwen3_5_text", vocab_size=padded_vocab_size(tokenizer),
                         max_position_embeddings=4096, initializer_range=init, rope_parameters=rope,
                         bos_token_id=pad, eos_token_id=eos, pad_token_id=pad),
        insert_layer_id=shape["insert_layer_id"],
        image_size=shape["scale_resolution"],
        image_token_id=tokenizer.convert_tokens_to_ids(MINICPMV_TOKENS["image_token"]),
        video_token_id=tokenizer.convert_tokens_to_ids(MINICPMV_TOKENS["video_token"]),
        initializer_range=init,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = MiniCPMV4_6ForConditionalGeneration(config).eval()
    slow_linear_attention_decay(model.model.language_model.layers)
    save_preset(folder, model, tokenizer, eos_id=eos, pad_id=pad)
    MiniCPMV4_6ImageProcessorPil(scale_resolution=shape["scale_resolution"], max_slice_nums=9,
                                 patch_size=14).save_pretrained(folder)
    # transformers' own class (it builds without torchvision), so the folder is a normal checkpoint.
    MiniCPMV4_6VideoProcessor(scale_resolution=shape["scale_resolution"], max_slice_nums=9, patch_size=14,
                              **shape["video"]).save_pretrained(folder)
