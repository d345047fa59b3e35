"""Oracles for Qwen3-VL and Qwen3.5 (same processor and tower, no deepstack): transformers' own processor, vision tower and `generate()`, and the position rule
written out plainly.

`Qwen3VLProcessor` checks on construction that its video processor is of the class its auto-mapping names,
a lookup that needs torchvision (absent here, see `raypipe/models/qwen2_5_vl/video.py`); `hf_processor`
skips that check only. The processor's own prompt expansion (`replace_image_token`, `replace_video_token`)
and its image processor then run unchanged. Its video processor's frame sampling, sizes and patchify are
torch/numpy and run as they are; only its resize and normalize call torchvision, so `video_pixels`
normalizes frames already at tower size the way it fuses rescale and normalize, then calls its `patchify`.

Video prompts follow the model's original processor (transformers 4.57, vLLM): the template's
`<|vision_start|><|video_pad|><|vision_end|>` is replaced as a whole by the timestamped groups, each with
its own vision start/end. transformers 5.23 replaces the `<|video_pad|>` alone and keeps the outer pair
(two vision starts before the first timestamp); `video_prompt_ids` expands the video token alone where
the template's three tokens were, which is the original rule, with the processor's own replacement text.
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
                                video_processor=Qwen3VLVideoProcessor.from_pretrained(ckpt),
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
    return [torch.cat([main, *(level[i] for level in _levels(out))], dim=-1)
            for i, main in enumerate(out.pooler_output)]


def hf_generate(hf_model, inputs: dict, max_new_tokens: int, eos: int) -> list[int]:
    """Greedy `generate()` on the full model from pixels; ids after the prompt up to and including `eos`."""
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    tokens = out[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def rule_positions(ids: list[int], grids: list[tuple[int, int, int]], image_token: int | set[int], merge: int
                   ) -> tuple[torch.Tensor, int]:
    """`(positions (3, len(ids)), rope_delta)` by Qwen3-VL's rule, in plain loops: text at consecutive
    positions one past the largest so far; a run of image tokens (one per image or video temporal group,
    `grids` in prompt order, each `(1, h, w)`) at `start + (0, row, column)` over its merged grid. A run
    shorter than its grid (a group EVS pruned; vLLM's `get_mrope_input_positions`) takes the grid's first
    cells, row by row."""
    placeholders = {image_token} if isinstance(image_token, int) else image_token
    axes = ([], [], [])
    start, i, item = 0, 0, 0
    while i < len(ids):
        if ids[i] not in placeholders:
            for axis in axes:
                axis.append(start)
            start, i = start + 1, i + 1
            continue
        _, h, w = grids[item]
        largest = start
        for cell in range(h // merge * w // merge):
            if i == len(ids) or ids[i] not in placeholders:
                break
            row, column = divmod(cell, w // merge)
            for axis, value in zip(axes, (start, start + row, start + column)):
                axis.append(value)
            largest = max(largest, start + row, start + column)
            i += 1
        start, item = largest + 1, item + 1
    return torch.tensor(axes), start - len(ids)


def video_pixels(video_processor, frames) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """`(pixel rows, grid)` of frames already at tower size: rescale fused into normalize as transformers
    does (`_fuse_mean_std_and_rescale_factor`: mean and std times `1 / rescale`, float32), then the
    processor's own `patchify`."""
    video = torch.from_numpy(frames).permute(0, 3, 1, 2).float()[None]
    mean = torch.tensor(video_processor.image_mean) * (1.0 / video_processor.rescale_factor)
    std = torch.tensor(video_processor.image_std) * (1.0 / video_processor.rescale_factor)
    video = (video - mean.view(1, 1, -1, 1, 1)) / std.view(1, 1, -1, 1, 1)
    rows, t, h, w = video_processor.patchify(video, video_processor.patch_size, video_processor.merge_size,
                                             video_processor.temporal_patch_size)
    return rows[0], (t, h, w)


def _levels(out) -> tuple:
    """transformers' deepstack levels of a vision output (none from Qwen3.5's tower)."""
    return getattr(out, "deepstack_features", None) or ()


def video_prompt_ids(processor, messages: list[dict], images: list, videos: list[tuple]) -> list[int]:
    """Prompt ids by the processor's own rules: the chat template, each image's `replace_image_token`, each
    video's `replace_video_token` (its grid and `VideoMetadata`: source fps and sampled frame indices) put where
    the template's `<|vision_start|><|video_pad|><|vision_end|>` was, then the tokenizer."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    video_part = processor.vision_start_token + processor.video_token + processor.vision_end_token
    grids = processor.image_processor(images=images, return_tensors="pt")["image_grid_thw"] if images else []
    pieces, image_index, video_index = [], 0, 0
    for chunk in _split_keep(text, [processor.image_token, video_part]):
        if chunk == processor.image_token:
            chunk = processor.replace_image_token({"image_grid_thw": grids}, image_index)
            image_index += 1
        elif chunk == video_part:
            grid, metadata = videos[video_index]
            chunk = processor.replace_video_token({"video_grid_thw": torch.tensor([grid]),
                                                   "video_metadata": [metadata]}, 0)
            video_index += 1
        pieces.append(chunk)
    assert (image_index, video_index) == (len(images), len(videos))
    return processor.tokenizer("".join(pieces), add_special_tokens=False)["input_ids"]


def _split_keep(text: str, separators: list[str]) -> list[str]:
    import re

    return [piece for piece in re.split("(" + "|".join(map(re.escape, separators)) + ")", text) if piece]


def rule_video_grids(grids: list[tuple[str, tuple[int, int, int]]]) -> list[tuple[int, int, int]]:
    """The runs of a prompt's visual items in order: an image's grid, a video's one `(1, h, w)` per temporal group."""
    return [(1, h, w) for kind, (t, h, w) in grids for _ in range(t if kind == "video" else 1)]


def video_features(hf_model, pixel_values_videos: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """Per video, transformers' `get_video_features` on the whole batch, every deepstack level on the columns."""
    with torch.no_grad():
        out = hf_model.model.get_video_features(pixel_values_videos, torch.tensor(grids))
    return [torch.cat([main, *(level[i] for level in _levels(out))], dim=-1)
            for i, main in enumerate(out.pooler_output)]
