"""Qwen2.5-VL's video processing (transformers' `Qwen2VLVideoProcessor`) without torchvision.

transformers' video processor imports torchvision at module level, and the torchvision wheels this
project can install do not load next to the CPU torch. Its semantics are the spec, reproduced here:

- which frames (`sample_frames`): with `fps`, `total / source_fps * fps` frames clamped to
  `[min_frames, min(max_frames, total)]` and floored to a multiple of `temporal_patch_size`; with
  `num_frames`, that count rounded to a multiple of it; indices `arange(0, total, total / n)`.
  Where transformers' formula gives 0 frames (a 1-frame video, `num_frames=1`) one frame is kept,
  index 0, and `patchify` pads it to a temporal patch as transformers pads odd counts.
- what size (`resize`): `smart_resize` to a multiple of patch * merge within `[min_pixels,
  max_pixels]` per frame, where `max_pixels` is also capped by the frame's share of the video's
  `total_pixels` budget (transformers' `cap_pixels_per_frame`, qwen-vl-utils' `VIDEO_TOTAL_PIXELS`).
- the pixels: torchvision's bicubic antialiased resize of uint8 frames, rescale + normalize
  (OpenAI CLIP mean/std), and `patchify` into `(t*h*w, C*tp*p*p)` rows in the tower's merge order.

The frame plan (`frame_planner`) runs where videos are decoded (`raypipe.inputs.video.load_video`), so
only sampled frames at tower size travel to the encoders; `process_video` runs on the encoder worker.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import ClassVar, NamedTuple

import numpy as np
import torch

from raypipe.errors import InvalidInput
from raypipe.inputs.video import PLAN_ITEM, FramePlan, PlanFrames, VideoMetadata, VideoSampling

VIDEO_PROCESSOR_CONFIG = "video_preprocessor_config.json"
# transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD (the normalization Qwen2.5-VL was trained with)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
TOTAL_BUDGET_SHARE = 0.9  # transformers: the total-video budget is 90% of `max_video_tokens` tokens' pixels
MIN_PIXELS_HEADROOM = 1.05  # transformers: a frame's capped budget never drops below 1.05 * min_pixels
MAX_ASPECT_RATIO = 200  # transformers' smart_resize refuses a longer side over 200 times the shorter


@dataclasses.dataclass(frozen=True, slots=True)
class QwenVideoConfig:
    """A checkpoint's video processor settings; defaults are `Qwen2VLVideoProcessor`'s (fps: qwen-vl-utils')."""

    processor_type: ClassVar[str] = "Qwen2VLVideoProcessor"  # the transformers class these settings are for

    fps: float | None = 2.0
    num_frames: int | None = None  # a fixed frame count instead of fps
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 128 * 28 * 28  # per frame (transformers: size["shortest_edge"])
    max_pixels: int = 768 * 28 * 28  # per frame (transformers: size["longest_edge"])
    max_video_tokens: int = 128000  # the total-pixel budget of one video, in tokens
    # transformers leaves the cap off for backward compatibility (and warns it will turn on); raypipe
    # applies it as qwen-vl-utils and transformers' own announced default do: a video's cost stays bounded.
    cap_pixels_per_frame: bool = True
    temporal_patch_size: int = 2
    patch_size: int = 14
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def total_pixels(self) -> int:
        return int(self.max_video_tokens * self.factor**2 * TOTAL_BUDGET_SHARE)

    @classmethod
    def from_checkpoint(cls, checkpoint: str | pathlib.Path) -> "QwenVideoConfig":
        """The checkpoint's `video_preprocessor_config.json` over the class defaults (all defaults if absent)."""
        path = pathlib.Path(checkpoint) / VIDEO_PROCESSOR_CONFIG
        if not path.is_file():
            return cls()
        raw = json.loads(path.read_text())
        size = raw.get("size") or {}
        found = {"min_pixels": size.get("shortest_edge", raw.get("min_pixels")),
                 "max_pixels": size.get("longest_edge", raw.get("max_pixels"))}
        names = {f.name for f in dataclasses.fields(cls)} - found.keys()
        found.update({name: raw.get(name) for name in names})
        tuples = {"image_mean", "image_std"}
        return cls(**{k: tuple(v) if k in tuples else v for k, v in found.items() if v is not None})

    def to_json(self) -> dict:
        """This config under the keys of transformers' `Qwen2VLVideoProcessor` (`size`, `fps`, ...), for presets."""
        out = dataclasses.asdict(self)
        out.update(video_processor_type=self.processor_type, do_sample_frames=True,
                   size={"shortest_edge": out.pop("min_pixels"), "longest_edge": out.pop("max_pixels")})
        return out


def _invalid(message: str) -> InvalidInput:
    return InvalidInput(message, item="video_sampling", code="invalid_video_sampling")


class Sampling(NamedTuple):
    """A request's sampling knobs resolved over the model's config and checked."""

    fps: float | None
    num_frames: int | None
    min_frames: int
    max_frames: int
    min_pixels: int
    max_pixels: int
    total_pixels: int


def resolve_sampling(config: QwenVideoConfig, sampling: VideoSampling | None = None) -> Sampling:
    """`sampling`'s knobs over `config`'s (None: the model's), refused with `invalid_video_sampling` when they
    cannot sample a video (shared by the Qwen frame plans)."""
    sampling = sampling or VideoSampling()
    if sampling.fps is not None and sampling.num_frames is not None:
        raise _invalid("fps and num_frames are mutually exclusive")
    if sampling.fps is not None or sampling.num_frames is not None:  # the request picks the mode
        fps, num_frames = sampling.fps, sampling.num_frames
    else:
        fps, num_frames = (None, config.num_frames) if config.num_frames is not None else (config.fps, None)

    def pick(name):
        value = getattr(sampling, name)
        return getattr(config, name) if value is None else value

    min_frames, max_frames = pick("min_frames"), pick("max_frames")
    min_pixels, max_pixels = pick("min_pixels"), pick("max_pixels")
    total_pixels = sampling.total_pixels if sampling.total_pixels is not None else config.total_pixels
    if fps is None and num_frames is None:
        raise _invalid("neither fps nor num_frames is set (request or model config)")
    if fps is not None and not (math.isfinite(fps) and fps > 0):
        raise _invalid(f"fps must be a positive number, got {fps}")
    for name, value in (("num_frames", num_frames), ("min_frames", min_frames), ("max_frames", max_frames)):
        if value is not None and value < 1:
            raise _invalid(f"{name} must be at least 1, got {value}")
    if min_frames > max_frames:
        raise _invalid(f"min_frames ({min_frames}) is above max_frames ({max_frames})")
    factor_area = config.factor**2
    for name, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels), ("total_pixels", total_pixels)):
        if value < factor_area:
            raise _invalid(f"{name} must be at least {factor_area} (one {config.factor}x{config.factor} patch), "
                           f"got {value}")
    if min_pixels > max_pixels:
        raise _invalid(f"min_pixels ({min_pixels}) is above max_pixels ({max_pixels})")
    return Sampling(fps, num_frames, min_frames, max_frames, min_pixels, max_pixels, total_pixels)


def frame_planner(config: QwenVideoConfig, sampling: VideoSampling | None = None) -> PlanFrames:
    """The `PlanFrames` of one request: its `sampling` knobs over the model's `config` (None: the model's)."""
    fps, num_frames, min_frames, max_frames, min_pixels, max_pixels, total_pixels = resolve_sampling(config, sampling)

    def plan(meta: VideoMetadata) -> FramePlan:
        indices = sample_indices(meta, config.temporal_patch_size, fps=fps, num_frames=num_frames,
                                 min_frames=min_frames, max_frames=max_frames)
        frame_max = max_pixels
        if config.cap_pixels_per_frame:
            frame_max = max(min(max_pixels, total_pixels * config.temporal_patch_size // len(indices)),
                            int(min_pixels * MIN_PIXELS_HEADROOM))
        height, width = frame_size(meta.height, meta.width, config.factor, min_pixels, frame_max)
        return FramePlan(indices, height, width, resize_frames)

    return plan


def sample_indices(meta: VideoMetadata, temporal_patch_size: int, *, fps: float | None, num_frames: int | None,
                   min_frames: int, max_frames: int) -> tuple[int, ...]:
    """Source frames `Qwen2VLVideoProcessor.sample_frames` keeps (at least one; see the module docstring)."""
    total = meta.total_num_frames
    if total < 1:
        raise InvalidInput("the video has no frames", item=PLAN_ITEM, code="invalid_video")
    if num_frames is not None:
        count = round(num_frames / temporal_patch_size) * temporal_patch_size
        if count > total:
            raise _invalid(f"num_frames={num_frames} asks for {count} frames; the video has {total}")
    else:
        if not meta.fps > 0:
            raise InvalidInput(f"the video's frame rate is {meta.fps}; sampling by fps needs it",
                               item=PLAN_ITEM, code="invalid_video")
        ceiling = math.floor(min(max_frames, total) / temporal_patch_size) * temporal_patch_size
        count = min(max(total / meta.fps * fps, min_frames), ceiling, total)
        count = math.floor(count / temporal_patch_size) * temporal_patch_size
    count = max(count, 1)
    # The very float arange transformers uses: the same float steps truncate to the same indices.
    return tuple(torch.arange(0, total, total / count).int().tolist())


def frame_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) every sampled frame is resized to (`smart_resize`, as the processor calls it)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise InvalidInput(f"video frames are {width}x{height}, an aspect ratio of {ratio:.0f}:1; this model takes "
                           f"at most {MAX_ASPECT_RATIO}:1", item=PLAN_ITEM, code="bad_aspect_ratio")
    return smart_resize(height, width, factor, min_pixels=min_pixels, max_pixels=max_pixels)


def resize_frames(frames: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """`(n, H, W, 3)` uint8 -> `(n, h, w, 3)` uint8, as torchvision's `resize(BICUBIC, antialias=True)` does.

    On CPU torchvision resizes uint8 bicubic natively: `_do_native_uint8_resize_on_cpu(BICUBIC)` is
    true, so it calls `interpolate(mode="bicubic", align_corners=False, antialias=True)` on the uint8
    tensor itself (the float round trip, clamped and rounded, is its GPU path). Memory layout does not
    change the result.
    """
    if tuple(size) == frames.shape[1:3]:
        return frames
    tensor = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
    out = torch.nn.functional.interpolate(tensor, size=tuple(size), mode="bicubic", align_corners=False,
                                          antialias=True)
    return np.ascontiguousarray(out.permute(0, 2, 3, 1).numpy())


def process_video(frames: np.ndarray, config: QwenVideoConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Frames at tower size `(T, h, w, 3)` uint8 -> `(pixel_values (t*gh*gw, C*tp*p*p) float32, (t, gh, gw))`."""
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()
    # Rescale fused into normalize as transformers does: (x - mean / rescale) / (std / rescale), float32.
    mean = (torch.tensor(config.image_mean) * (1.0 / config.rescale_factor)).view(1, -1, 1, 1)
    std = (torch.tensor(config.image_std) * (1.0 / config.rescale_factor)).view(1, -1, 1, 1)
    video = (video - mean) / std
    return patchify(video, config.patch_size, config.merge_size, config.temporal_patch_size)


def patchify(video: torch.Tensor, patch: int, merge: int, temporal: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """`(T, C, H, W)` -> rows of `C*temporal*patch*patch` values, in the order the tower's patch embed
    and merger expect: temporal group, merge window row/col, position inside the window.

    T is padded to a multiple of `temporal` by repeating the last frame (as transformers does)."""
    if pad := -video.shape[0] % temporal:
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
    frames, channels, height, width = video.shape
    t, gh, gw = frames // temporal, height // patch, width // patch
    patches = video.reshape(t, temporal, channels, gh // merge, merge, patch, gw // merge, merge, patch)
    # (t, gh/m, gw/m, m, m, C, temporal, p, p): transformers' order without its batch axis
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(t * gh * gw, channels * temporal * patch * patch), (t, gh, gw)
