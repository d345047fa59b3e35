"""`tiny-step3` / `small-step3`: deterministic Step3.7 checkpoints (transformers `step3p7`), real HF folders;
tiny for tests, small for benchmarks.

Same recipe as every preset (`raypipe.models.presets`) (seeded init, `initializer_range=0.2` in every sub-config so a
wrong position, window or image order changes the greedy output, byte-level tokenizer) with what
makes Step3 Step3:

- vision: the rope-2D ViT with its two stride-2 downsamplers (fan-in scaled, see
  `_tame_vision_output`), global view plus sliding-window crops. The views are scaled down (global 224 px, crops 168 px, images capped at 896 px — the
  real 728/504/3024 divided by 3.25) so a test image costs milliseconds; the crop plan is the
  processor's own and keeps its thresholds, which are ratios of these sizes.
- text (`step3p5`): gated attention, `layer_types` with two sliding-window layers around a
  full-attention one, a window of 16 tokens (shorter than every image prompt), per-layer head
  counts (sliding layers have fewer query heads), a dense first MLP then mixture-of-experts
  layers with 4 routed experts, top-2, plus the shared expert. No MTP layers.
"""

from __future__ import annotations

import pathlib

from raypipe.models.presets import build_byte_tokenizer, chat_template, padded_vocab_size, save_preset
from raypipe.models.step3.geometry import IMAGE_TOKEN

# Step3's placeholder tokens (`Step3p7Processor`) plus the chat tokens of the preset's template.
STEP3_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<im_patch>",
    "<patch_start>",
    "<patch_end>",
    "<patch_newline>",
    "<im_start>",
    "<im_end>",
]

# The chat template renders one `<im_patch>` per image; `Step3p7Processor` (and raypipe's prompt
# builder) replace it with the image's crop and global-view placeholders.
STEP3_CHAT_TEMPLATE = chat_template("<im_patch>")

SHAPES = {
    "tiny-step3": dict(
        vision=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2.0, image_size=224),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_sliding_attention_heads=2, num_key_value_heads=2, head_dim=16,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  mlp_layer_types=["dense", "sparse", "sparse"], sliding_window=16,
                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, share_expert_dim=32),
        processor=dict(size={"height": 224, "width": 224}, patch_size=168, max_image_size=896),
    ),
    # Benchmark-sized (like `small` / `small-minicpmv`): the real model's layer pattern at a smaller
    # scale (three sliding-window layers to one full-attention layer, a dense first MLP then MoE), a
    # window of 128 tokens (the real one is 512) so a chat's prompt leaves it several times over.
    "small-step3": dict(
        vision=dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, mlp_ratio=2.0, image_size=224),
        text=dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_sliding_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"] * 2,
                  mlp_layer_types=["dense"] + ["sparse"] * 7, sliding_window=128,
                  n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=384, share_expert_dim=384),
        processor=dict(size={"height": 224, "width": 224}, patch_size=168, max_image_size=896),
    ),
}


def _tame_vision_output(model) -> None:
    """Fan-in scaled weights for the two downsampler convs and the projector.

    At std 0.2 each of them multiplies magnitudes by 3-5x (fan-ins of 288 to 576), so image
    embeddings reach ~100 and fp32 rounding that depends on batch shape alone (how many views share
    a forward) exceeds `atol=1e-5` on the entries near zero. With std 1/sqrt(fan_in) the embeddings
    stay O(1); everything else keeps `initializer_range=0.2`.
    """
    import torch

    inner = model.model
    with torch.no_grad():
        for layer in (inner.vision_model.downsampler1, inner.vision_model.downsampler2, inner.multi_modal_projector):
            fan_in = layer.weight[0].numel()
            layer.weight.normal_(0.0, fan_in**-0.5)


def write(folder: pathlib.Path, name: str) -> None:
    import torch
    from transformers import Step3p7Config, Step3p7ForConditionalGeneration, Step3p7Processor

    from raypipe.models.step3.image_processor import Step3p7ImageProcessorTorch

    shape = SHAPES[name]
    tokenizer = build_byte_tokenizer(STEP3_SPECIAL_TOKENS, STEP3_CHAT_TEMPLATE, eos="<|im_end|>",
                                     pad="<|endoftext|>")
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in STEP3_SPECIAL_TOKENS}
    init = 0.2
    config = Step3p7Config(
        vision_config=dict(shape["vision"], patch_size=14, initializer_range=init,
                           max_position_embeddings=(shape["vision"]["image_size"] // 14) ** 2,
                           rope_parameters={"rope_type": "axial", "rope_theta": 10000.0}),
        text_config=dict(shape["text"], vocab_size=padded_vocab_size(tokenizer), max_position_embeddings=4096, initializer_range=init,
                         rope_theta=10000.0, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False),
        image_token_id=ids[IMAGE_TOKEN],
        initializer_range=init,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Step3p7ForConditionalGeneration(config).eval()
    _tame_vision_output(model)
    # The processor first: `save_preset` writes the tokenizer last, over the processor's copy.
    Step3p7Processor(image_processor=Step3p7ImageProcessorTorch(**shape["processor"]), tokenizer=tokenizer,
                     chat_template=STEP3_CHAT_TEMPLATE).save_pretrained(folder)
    save_preset(folder, model, tokenizer, eos_id=ids["<|im_end|>"], pad_id=ids["<|endoftext|>"])
