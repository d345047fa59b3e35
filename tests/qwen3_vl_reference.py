"""Oracles for Qwen3-VL: transformers' own processor, vision tower and `generate()`, and the position rule
written out plainly.

`Qwen3VLProcessor` checks on construction that its video processor is of the class its auto-mapping names,
a lookup that needs torchvision (absent here, see `raypipe/models/qwen2_5_vl/video.py`); `hf_processor`
skips that check only. The processor's own prompt expansion (`replace_image_token`) and its image
processor then run unchanged.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def _no_class_check():
    from transformers.processing_utils import ProcessorMixin

    original = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, argument: None
    try:
        yield
    finally:
        ProcessorMixin.check_argument_for_proper_class = original


def hf_processor(ckpt):
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    with _no_class_check():
        return Qwen3VLProcessor(image_processor=AutoImageProcessor.from_pretrained(ckpt), tokenizer=tokenizer,
                                video_processor=Qwen3VLVideoProcessor(patch_size=16),
                                chat_template=tokenizer.chat_template)


def hf_inputs(processor, messages: list[dict], images: list) -> dict:
    """The processor's own `input_ids`, `mm_token_type_ids`, `pixel_values`, `image_grid_thw` for a chat."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return dict(processor(text=[text], images=images or None, return_tensors="pt"))


def features(hf_model, inputs: dict) -> list[torch.Tensor]:
    """Per image, transformers' `get_image_features` on the whole batch: the merger's rows and every deepstack
    level side by side on the columns (raypipe's layout of a Qwen3-VL embedding)."""
    if "pixel_values" not in inputs:
        return []
    with torch.no_grad():
        out = hf_model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    return [torch.cat([main, *(level[i] for level in out.deepstack_features)], dim=-1)
            for i, main in enumerate(out.pooler_output)]


def hf_generate(hf_model, inputs: dict, max_new_tokens: int, eos: int) -> list[int]:
    """Greedy `generate()` on the full model from pixels; ids after the prompt up to and including `eos`."""
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    tokens = out[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def rule_positions(ids: list[int], grids: list[tuple[int, int, int]], image_token: int, merge: int
                   ) -> tuple[torch.Tensor, int]:
    """`(positions (3, len(ids)), rope_delta)` by Qwen3-VL's rule, in plain loops: text at consecutive
    positions one past the largest so far; a run of image tokens (one per image or video temporal group,
    `grids` in prompt order, each `(1, h, w)`) at `start + (0, row, column)` over its merged grid."""
    axes = ([], [], [])
    start, i, item = 0, 0, 0
    while i < len(ids):
        if ids[i] != image_token:
            for axis in axes:
                axis.append(start)
            start, i = start + 1, i + 1
            continue
        _, h, w = grids[item]
        largest = start
        for row in range(h // merge):
            for column in range(w // merge):
                for axis, value in zip(axes, (start, start + row, start + column)):
                    axis.append(value)
                largest = max(largest, start + row, start + column)
                i += 1
        start, item = largest + 1, item + 1
    return torch.tensor(axes), start - len(ids)
