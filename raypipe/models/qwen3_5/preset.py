"""`tiny-qwen3.5`, `tiny-qwen3.5-moe`, `small-qwen3.5`: deterministic Qwen3.5 checkpoints
(`raypipe.models.presets` has the recipe).

The chat template is Qwen3.5's as raypipe serves it: Qwen3-VL's turns and vision parts, no default
system turn, and the thinking switch of Qwen3.5's template: the generation prompt opens the thinking
block (`<|im_start|>assistant\\n<think>\\n`, so the model writes its reasoning, `</think>`, then the
answer) unless `enable_thinking` is false, when it writes an empty block (`<think>\\n\\n</think>\\n\\n`)
and the model answers at once. An assistant turn after the last user turn writes its past reasoning
(`reasoning_content`) as a thinking block before its content, earlier ones drop it (Qwen3.5's rule). `<think>` and `</think>` are single tokens that are not special (as in
Qwen's vocabulary), so the decoded text keeps them for the reasoning parser.

The tiny presets' text model has layers linear, linear, full attention (the hybrid in miniature), 32-wide
heads with half of each rotated at rope base 10^4 (Qwen3.5's 10^7 barely turns the few frequencies a tiny
head has) and every gated-delta-net head slow to forget, so a wrong position, state or image changes
greedy tokens (tests/test_qwen3_5_decode.py shows it); the MoE one routes every layer
through 4 experts, 2 per token, plus the shared expert.
"""

from __future__ import annotations

import pathlib

from raypipe.models.presets import (
    PAST_REASONING,
    build_byte_tokenizer,
    chat_template,
    save_preset,
    slow_linear_attention_decay,
)
from raypipe.models.qwen2_5_vl.preset import QWEN_SPECIAL_TOKENS
from raypipe.models.qwen3_vl.preset import config_kwargs, write_processors

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# What Qwen3.5's template writes after `<|im_start|>assistant\n` in the generation prompt.
THINKING_SWITCH = ("{% if enable_thinking is defined and enable_thinking is false %}"
                   "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}")
QWEN3_5_CHAT_TEMPLATE = chat_template("<|vision_start|><|image_pad|><|vision_end|>",
                                      video_part="<|vision_start|><|video_pad|><|vision_end|>",
                                      generation_tail=THINKING_SWITCH, past_reasoning=PAST_REASONING)

_TINY_VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, num_position_embeddings=64)
_TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4,
                  layer_types=["linear_attention", "linear_attention", "full_attention"],
                  partial_rotary_factor=0.5, mrope_section=[2, 3, 3], rope_theta=10000.0)
_TINY_PIXELS = dict(min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 256, video_min_pixels=32 * 32 * 8,
                    video_max_pixels=32 * 32 * 16 * 64)

# name -> vision kwargs, text kwargs, MoE kwargs or None, image- and video-processor pixel bounds
SHAPES = {
    "tiny-qwen3.5": dict(vision=_TINY_VISION, text=_TINY_TEXT, moe=None, **_TINY_PIXELS),
    "tiny-qwen3.5-moe": dict(vision=_TINY_VISION, text=_TINY_TEXT,
                             moe=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=32), **_TINY_PIXELS),
    # Realistic proportions scaled to a CPU (Qwen3.5: three gated-delta-net layers to one attention layer,
    # a quarter of each attention head rotated): benchmarks, not tests.
    "small-qwen3.5": dict(
        vision=dict(depth=8, hidden_size=256, intermediate_size=688, num_heads=4, num_position_embeddings=2304),
        text=dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
                  linear_num_key_heads=4, linear_num_value_heads=8, linear_conv_kernel_dim=4,
                  layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
                  + ["full_attention"], partial_rotary_factor=0.25, mrope_section=[2, 3, 3], rope_theta=10000000.0),
        moe=None, min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 1024,
        video_min_pixels=32 * 32 * 16, video_max_pixels=32 * 32 * 256 * 128),
}
PRESETS = tuple(SHAPES)


def write(folder: pathlib.Path, name: str) -> None:
    import torch
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    shape = SHAPES[name]
    tokenizer = build_byte_tokenizer(QWEN_SPECIAL_TOKENS, QWEN3_5_CHAT_TEMPLATE, eos="<|im_end|>",
                                     pad="<|endoftext|>", added=(THINK_OPEN, THINK_CLOSE))
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in QWEN_SPECIAL_TOKENS}
    text = dict(shape["text"])
    rope = {key: text.pop(key) for key in ("mrope_section", "partial_rotary_factor", "rope_theta")}
    config_class, model_class = ((Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration) if shape["moe"]
                                 else (Qwen3_5Config, Qwen3_5ForConditionalGeneration))
    config = config_class(**config_kwargs(shape, text, rope, tokenizer, ids))
    torch.manual_seed(0)
    model = model_class(config).eval()
    slow_linear_attention_decay(model.model.language_model.layers)
    save_preset(folder, model, tokenizer, eos_id=ids["<|im_end|>"], pad_id=ids["<|endoftext|>"])
    write_processors(folder, shape)  # Qwen3-VL's tower, Qwen3-VL's processors
