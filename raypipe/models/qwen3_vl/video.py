"""Qwen3-VL's video processing (transformers' `Qwen3VLVideoProcessor`) without torchvision, and the
timestamps its prompt carries.

Its semantics are the spec (the tensor work is Qwen2.5-VL's `process_video`, with this config's
mean/std and patch size):

- which frames (`sample_frames`): with `fps`, `int(total / source_fps * fps)` frames clamped to
  `[min_frames, min(max_frames, total)]`; with `num_frames`, that count; without either, every frame
  within `[min_frames, max_frames]`. Indices `linspace(0, total - 1, n)` rounded: first and last frames
  always kept. No rounding to the temporal patch: an odd count is padded by repeating the last frame.
- what size (`resize`): `smart_resize` of the whole clip: `t_bar * h * w` (t_bar: frames rounded to the
  temporal patch) within `[min_pixels, max_pixels]` (`size["shortest_edge"]`, `size["longest_edge"]`:
  budgets of the whole video). With `cap_pixels_per_frame` (qwen-vl-utils' rule, raypipe's default as for
  Qwen2.5-VL) a frame's share is `min(max_video_tokens` patches, `max_pixels / frames)`, at least
  `1.05 * min_pixels`.
- the prompt: before each temporal group's placeholder run, `<t seconds>` with `t` the mean of its
  frames' source times (`Qwen3VLProcessor._calculate_timestamps`, one decimal).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from raypipe.errors import InvalidInput
from raypipe.inputs.video import PLAN_ITEM, FramePlan, PlanFrames, VideoMetadata, VideoSampling
from raypipe.models.qwen2_5_vl.video import (
    MAX_ASPECT_RATIO,
    MIN_PIXELS_HEADROOM,
    QwenVideoConfig,
    resize_frames,
    resolve_sampling,
)


@dataclasses.dataclass(frozen=True, slots=True)
class Qwen3VideoConfig(QwenVideoConfig):
    """`Qwen3VLVideoProcessor`'s settings (its defaults); `min_pixels` / `max_pixels` bound the whole clip."""

    processor_type = "Qwen3VLVideoProcessor"

    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 768 * 32 * 32
    max_video_tokens: int = 768  # a frame's token ceiling under the cap
    patch_size: int = 16
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @property
    def total_pixels(self) -> int:
        return self.max_pixels  # the clip's budget is `max_pixels` itself


def frame_planner(config: Qwen3VideoConfig, sampling: VideoSampling | None = None) -> PlanFrames:
    """The `PlanFrames` of one request: its `sampling` knobs over the model's `config` (None: the model's)."""
    if sampling is not None and sampling.total_pixels is not None:
        raise InvalidInput("total_pixels does not apply to Qwen3-VL: max_pixels is the whole video's budget",
                           item="video_sampling", code="invalid_video_sampling")
    knobs = resolve_sampling(config, sampling)

    def plan(meta: VideoMetadata) -> FramePlan:
        indices = sample_indices(meta, fps=knobs.fps, num_frames=knobs.num_frames, min_frames=knobs.min_frames,
                                 max_frames=knobs.max_frames)
        height, width = frame_size(config, len(indices), meta.height, meta.width, knobs.min_pixels,
                                   knobs.max_pixels)
        return FramePlan(indices, height, width, resize_frames)

    return plan


def sample_indices(meta: VideoMetadata, *, fps: float | None, num_frames: int | None, min_frames: int,
                   max_frames: int) -> tuple[int, ...]:
    """Source frames `Qwen3VLVideoProcessor.sample_frames` keeps."""
    total = meta.total_num_frames
    if total < 1:
        raise InvalidInput("the video has no frames", item=PLAN_ITEM, code="invalid_video")
    if num_frames is None and fps is not None:
        if not meta.fps > 0:
            raise InvalidInput(f"the video's frame rate is {meta.fps}; sampling by fps needs it",
                               item=PLAN_ITEM, code="invalid_video")
        num_frames = min(max(int(total / meta.fps * fps), min_frames), max_frames, total)
    elif num_frames is None:
        num_frames = min(max(total, min_frames), max_frames)
    if num_frames == 1:
        return (0,)
    # numpy's linspace (what transformers calls): i * step in float64, the last exactly `total - 1`; rounded
    # half to even as numpy's `round`
    step = (total - 1) / (num_frames - 1)
    return (*(round(i * step) for i in range(num_frames - 1)), total - 1)


def frame_size(config: Qwen3VideoConfig, num_frames: int, height: int, width: int, min_pixels: int,
               max_pixels: int) -> tuple[int, int]:
    """(height, width) every sampled frame is resized to (the processor's `resize`, `smart_resize` of the clip)."""
    factor, temporal = config.factor, config.temporal_patch_size
    if config.cap_pixels_per_frame:
        per_frame = max(min(config.max_video_tokens * factor * factor, max_pixels // num_frames),
                        int(min_pixels * MIN_PIXELS_HEADROOM))
        max_pixels = per_frame * num_frames
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise InvalidInput(f"video frames are {width}x{height}, an aspect ratio of {ratio:.0f}:1; this model takes "
                           f"at most {MAX_ASPECT_RATIO}:1", item=PLAN_ITEM, code="bad_aspect_ratio")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = max(round(num_frames / temporal), 1) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def group_times(frame_times_s: Sequence[float], temporal_patch_size: int) -> tuple[float, ...]:
    """Each temporal group's time: the mean of its first and last frames' source times (a trailing partial
    group padded with its last frame, as the tower pads its pixels)."""
    times = list(frame_times_s)
    times += times[-1:] * (-len(times) % temporal_patch_size)
    return tuple((times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times),
                                                                                     temporal_patch_size))


def timestamp_text(seconds: float) -> str:
    return f"<{seconds:.1f} seconds>"
