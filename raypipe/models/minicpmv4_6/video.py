"""MiniCPM-V 4.6 videos: transformers' `MiniCPMV4_6VideoProcessor`, its frame plan and tensor work, without torchvision.

The processor keeps one main frame per second of video (at most `max_num_frames`, spread over the
whole video beyond that) and, with `stack_frames > 1`, `stack_frames - 1` sub-second frames per second,
packed into one canvas image per second (`concat_frames_as_image`). Its visual units are then main
frame 0, canvas of second 0, main frame 1, canvas of second 1, ... (for a video longer than the cap, the
i-th main frame is paired with the i-th second's canvas, as transformers pairs them). Each unit is
resized and sliced like an image (overview, then slices row by row).

What is transformers' own code here: `sample_frames` (which frames), `concat_frames_as_image` (the
canvas), `get_sliced_grid` / `find_best_resize` / `get_refine_size` (geometry), `resize_and_split_patches`
(the overview and slices of a unit), `rescale_and_normalize` and `reshape_by_patch` (the tower's
packed layout). Only two tensor kernels are replaced, by the torch kernels torchvision calls for
these inputs (`raypipe.models.video_kernels`): bicubic antialiased resize of uint8 and `(x - mean) / std`.
The grouping of sub-second frames by second is transformers' inline code in `_preprocess`, re-done in `visual_units`.

The frame plan keeps frames at their source size, in transformers' order (main frames, then
sub-second frames): canvases are built from full-size frames before they are resized, so resizing
frames as they are decoded would change the pixels.
"""

from __future__ import annotations

import math
import pathlib

import numpy as np
import torch

from raypipe.errors import InvalidInput
from raypipe.inputs.video import FramePlan, PlanFrames, VideoMetadata, VideoSampling
from raypipe.models.video_kernels import TorchVideoKernels

VIDEO_PROCESSOR_CONFIG = "video_preprocessor_config.json"
# Kept frames stay at source size until the coordinator cuts them into pieces: a plan whose frames would
# hold more than this is refused from the header (120 frames of 1080p are 0.75 GiB; of 4K, 3 GiB).
MAX_KEPT_BYTES = 2 * 1024**3


def _processor_class():
    from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import MiniCPMV4_6VideoProcessor

    class MiniCPMV4_6VideoProcessorTorch(TorchVideoKernels, MiniCPMV4_6VideoProcessor):
        pass

    return MiniCPMV4_6VideoProcessorTorch


def load_processor(checkpoint: str | pathlib.Path):
    """The checkpoint's video processor (the class defaults where it has no `video_preprocessor_config.json`)."""
    cls = _processor_class()
    if (pathlib.Path(checkpoint) / VIDEO_PROCESSOR_CONFIG).is_file():
        return cls.from_pretrained(checkpoint)
    return cls()


def _invalid(message: str) -> InvalidInput:
    return InvalidInput(message, item="video_sampling", code="invalid_video_sampling")


def frame_planner(processor, sampling: VideoSampling | None = None) -> PlanFrames:
    """The `PlanFrames` of one request: transformers' `sample_frames`; of the sampling knobs only `max_frames`
    (the processor's `max_num_frames`, the cap on main frames) applies to this family."""
    sampling = sampling or VideoSampling()
    others = [name for name in ("fps", "num_frames", "min_frames", "min_pixels", "max_pixels", "total_pixels")
              if getattr(sampling, name) is not None]
    if others:
        raise _invalid(f"{', '.join(others)}: not supported by MiniCPM-V, which keeps one frame per second "
                       "(only max_frames applies)")
    max_num_frames = processor.max_num_frames if sampling.max_frames is None else sampling.max_frames
    if max_num_frames < 1:
        raise _invalid(f"max_frames must be at least 1, got {max_num_frames}")

    def plan(meta: VideoMetadata) -> FramePlan:
        from transformers.video_utils import VideoMetadata as HFVideoMetadata

        hf_meta = HFVideoMetadata(total_num_frames=meta.total_num_frames, fps=meta.fps,
                                  duration=meta.frames_duration_s, width=meta.width, height=meta.height)
        indices = processor.sample_frames(hf_meta, max_num_frames=max_num_frames)
        kept = len(indices) * meta.height * meta.width * 3
        if kept > MAX_KEPT_BYTES:
            raise InvalidInput(f"{len(indices)} frames of {meta.width}x{meta.height} would be kept at source size "
                               f"({kept / 1024**3:.1f} GiB; the limit is {MAX_KEPT_BYTES / 1024**3:g} GiB): send a "
                               "smaller video or a lower max_frames", item="video", code="video_too_large")
        return FramePlan(tuple(int(i) for i in indices), meta.height, meta.width, _keep)

    return plan


def _keep(frames: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    return frames  # kept at source size: see the module docstring


def visual_units(num_frames: int, duration_s: float | None, processor) -> list[int]:
    """transformers' visual units of a sampled video, in the order the language model reads them, as the
    number of sub-second frames each holds: 0 for a main frame, k for the canvas of k sub-second frames.

    Main frames are the first frames of the plan, then sub-second frames in time order; canvases take
    them in that order (a canvas is one second's frames, and the i-th main frame is followed by the
    i-th second's canvas), so these counts say which frames each unit is made of."""
    stack = processor.stack_frames
    if not stack or stack <= 1:
        return [0] * num_frames
    if duration_s is None:
        raise InvalidInput("this model groups a video's frames by second: the video needs its duration (decode it "
                           "with this model's frame plan)", item="video", code="invalid_video")
    seconds = math.ceil(duration_s)
    subs = [sec + j / stack for sec in range(seconds) for j in range(1, stack) if sec + j / stack < duration_s]
    main, kept = _split(num_frames, seconds, len(subs), stack)
    if kept < len(subs):  # the same downsampling `sample_frames` applied
        subs = [subs[int(i)] for i in np.linspace(0, len(subs) - 1, kept, dtype=int)]
    counts, cursor = [], 0
    for sec in range(seconds):
        start = cursor
        while cursor < len(subs) and subs[cursor] < sec + 1:
            cursor += 1
        counts.append(cursor - start)
    units: list[int] = []
    for i in range(main):
        units.append(0)
        if i < len(counts) and counts[i]:
            units.append(counts[i])
    return units


def _split(num_frames: int, seconds: int, subs: int, stack: int) -> tuple[int, int]:
    """(main frames, sub-second frames) of a plan of `num_frames`: one main frame per second, or, beyond the
    main-frame cap c (which the plan does not record), c main frames and at most c * (stack - 1) sub-frames.
    The two cases cannot give the same count, since c < seconds there."""
    if num_frames == seconds + subs:
        return seconds, subs
    for main in range(1, min(num_frames, seconds)):
        if main + min(subs, main * (stack - 1)) == num_frames:
            return main, num_frames - main
    raise InvalidInput(f"{num_frames} frames are not a frame plan of a video of {seconds} s", item="video",
                       code="invalid_video")


def canvas_size(processor, frames: int, height: int, width: int) -> tuple[int, int]:
    """(height, width) of the canvas `concat_frames_as_image` makes from `frames` frames of this size."""
    if frames == 1:
        return height, width
    shape_only = torch.zeros(1, 1, 1, 1, dtype=torch.uint8).expand(frames, 1, height, width)
    return tuple(processor.concat_frames_as_image(shape_only).shape[-2:])


def pieces(unit: torch.Tensor, processor) -> list[torch.Tensor]:
    """A visual unit `(1, C, h, w)` uint8 -> its overview and slices, `(C, h', w')` uint8 each, in reading order."""
    p = processor
    [interleaved], _, _ = p.resize_and_split_patches(unit[None], resample=p.resample, slice_mode=p.slice_mode,
                                                     max_slice_nums=p.max_slice_nums,
                                                     scale_resolution=p.scale_resolution, patch_size=p.patch_size,
                                                     downsample_mode=p.downsample_mode)
    return [piece[0] for piece in interleaved]


def pack_piece(piece: np.ndarray, processor) -> torch.Tensor:
    """An `(h, w, 3)` uint8 piece -> `(C, patch, h*w/patch)` float32: the processor's fused rescale +
    normalize, then its NaViT patch layout."""
    p = processor
    video = torch.from_numpy(np.ascontiguousarray(piece)).permute(2, 0, 1)[None, None]
    video = p.rescale_and_normalize(video, p.do_rescale, p.rescale_factor, p.do_normalize, tuple(p.image_mean),
                                    tuple(p.image_std))
    return p.reshape_by_patch(video, p.patch_size)[0, 0]
