"""LLaVA-OneVision videos: transformers' `LlavaOnevisionVideoProcessor` frame plan and frame tensors, and the
2x2 pooling `get_video_features` applies after the projector.

Frames: the processor's `sample_frames` (`num_frames` evenly spaced over the video, or `fps` frames per
second of it), each frame resized to the tower's square (bicubic, aspect ratio not kept) as it is
decoded; the worker only runs the processor's fused rescale + normalize. Each frame is one tower
input of the tiles' size: a unit of the same cost, so a video's frames split evenly over the workers
next to the batch's tiles. The processor config falls back to `preprocessor_config.json` (the image
processor's size, mean and std) when a checkpoint has no video config, as transformers' loader does.

Tokens (`processing_llava_onevision.replace_video_token`): each frame's projected side x side feature map
shrunk bilinearly to ceil(side / 2) squared, frames back to back, then one `image_newline` row for the
whole video.
"""

from __future__ import annotations

import math
import pathlib

import numpy as np
import torch

from raypipe.errors import InvalidInput
from raypipe.inputs.video import FramePlan, PlanFrames, VideoMetadata, VideoSampling
from raypipe.models.video_kernels import TorchVideoKernels

# transformers keeps every frame unless told (`do_sample_frames=False`); the released models were trained on
# up to 32 frames per video, which is also what a request gets when neither it nor the checkpoint says.
DEFAULT_NUM_FRAMES = 32


def load_processor(checkpoint: str | pathlib.Path):
    from transformers.models.llava_onevision.video_processing_llava_onevision import LlavaOnevisionVideoProcessor

    class LlavaOnevisionVideoProcessorTorch(TorchVideoKernels, LlavaOnevisionVideoProcessor):
        pass

    return LlavaOnevisionVideoProcessorTorch.from_pretrained(checkpoint)


def _invalid(message: str) -> InvalidInput:
    return InvalidInput(message, item="video_sampling", code="invalid_video_sampling")


def frame_planner(processor, sampling: VideoSampling | None = None) -> PlanFrames:
    """The `PlanFrames` of one request: `sample_frames` with the request's `num_frames` or `fps` (else the
    checkpoint's, else up to `DEFAULT_NUM_FRAMES`), frames resized to the processor's size."""
    sampling = sampling or VideoSampling()
    others = [name for name in ("min_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels")
              if getattr(sampling, name) is not None]
    if others:
        raise _invalid(f"{', '.join(others)}: not supported by LLaVA-OneVision, whose frames are all the tower's "
                       "size (num_frames or fps apply)")
    if sampling.num_frames is not None and sampling.fps is not None:
        raise _invalid("num_frames and fps are mutually exclusive")
    given = sampling.num_frames is not None or sampling.fps is not None
    num_frames = sampling.num_frames if given else processor.num_frames
    fps = sampling.fps if given else processor.fps
    if (num_frames is not None and num_frames < 1) or (fps is not None and fps <= 0):
        raise _invalid(f"num_frames must be at least 1 and fps positive, got {num_frames} and {fps}")
    size = (processor.size.height, processor.size.width)

    def plan(meta: VideoMetadata) -> FramePlan:
        from transformers.video_utils import VideoMetadata as HFVideoMetadata

        count = num_frames
        if count is None and fps is None:
            count = min(DEFAULT_NUM_FRAMES, meta.total_num_frames)
        hf_meta = HFVideoMetadata(total_num_frames=meta.total_num_frames, fps=meta.fps,
                                  duration=meta.frames_duration_s, width=meta.width, height=meta.height)
        try:
            indices = processor.sample_frames(hf_meta, num_frames=count, fps=None if count else fps)
        except ValueError as exc:  # more frames asked for than the video has
            raise _invalid(str(exc)) from None
        return FramePlan(tuple(int(i) for i in indices), *size, lambda frames, hw: resize(processor, frames, hw))

    return plan


def resize(processor, frames: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """`(n, H, W, 3)` uint8 -> `(n, h, w, 3)` uint8, the processor's resize."""
    from transformers.image_utils import SizeDict

    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
    out = processor.resize(video, size=SizeDict(height=size[0], width=size[1]), resample=processor.resample)
    return np.ascontiguousarray(out.permute(0, 2, 3, 1).numpy())


def pixel_values(frames: list[np.ndarray], processor) -> torch.Tensor:
    """`(h, w, 3)` uint8 frames already at the processor's size -> `(n, C, h, w)` float32: its fused rescale +
    normalize."""
    p = processor
    video = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2)
    return p.rescale_and_normalize(video, p.do_rescale, p.rescale_factor, p.do_normalize, tuple(p.image_mean),
                                   tuple(p.image_std))


def pooled_side(side: int) -> int:
    return math.ceil(side / 2)


def num_tokens(frames: int, side: int) -> int:
    """A video's placeholder run: every frame's pooled map, then one newline row."""
    return frames * pooled_side(side) ** 2 + 1


def pool(features: torch.Tensor, side: int) -> torch.Tensor:
    """`(frames, side * side, dim)` projected features -> `(frames, ceil(side / 2) ** 2, dim)`: `apply_pooling`."""
    frames, _, dim = features.shape
    grid = features.view(frames, side, side, dim).permute(0, 3, 1, 2)
    shrunk = torch.nn.functional.interpolate(grid, size=(pooled_side(side),) * 2, mode="bilinear")
    return shrunk.permute(0, 2, 3, 1).reshape(frames, -1, dim)
