"""Videos: what users send -> the sampled, resized frames a vision tower consumes (visual items of kind "video").

Which frames are kept and at what size is the model family's decision (`PlanFrames`: Qwen2.5-VL
follows transformers' Qwen2-VL video processor); this module reads the container's header, refuses
what is over the limits before decoding anything, then decodes only the kept frames and resizes each
as it is decoded, so a long high-resolution video never sits in memory at full size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class VideoMetadata:
    """What the container's header says about its video stream (a list of frames: what the caller says)."""

    total_num_frames: int
    fps: float  # average frame rate of the source
    duration_s: float
    width: int
    height: int
    codec: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class FramePlan:
    """A family's decision for one video: which source frames to keep and the size to resize them to."""

    indices: tuple[int, ...]  # source frame indices, ascending
    height: int
    width: int
    resize: Callable[[np.ndarray, tuple[int, int]], np.ndarray]  # (n, H, W, 3) uint8 -> (n, h, w, 3) uint8


PlanFrames = Callable[[VideoMetadata], FramePlan]


@dataclasses.dataclass(frozen=True, slots=True)
class VideoSampling:
    """Per-request (or per-deployment) sampling knobs, under the names vLLM's server accepts in
    `mm_processor_kwargs`; None means the model's own default (its video processor config)."""

    fps: float | None = None  # frames sampled per second of video
    num_frames: int | None = None  # a fixed frame count instead of fps
    min_frames: int | None = None
    max_frames: int | None = None
    min_pixels: int | None = None  # per frame
    max_pixels: int | None = None  # per frame
    total_pixels: int | None = None  # budget for all frames of one video
