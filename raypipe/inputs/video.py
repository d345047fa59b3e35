"""Videos: what users send -> the sampled, resized frames a vision tower consumes (visual items of kind "video").

Which frames are kept and at what size is the model family's decision (`PlanFrames`: Qwen2.5-VL
follows transformers' Qwen2-VL video processor); this module reads the container's header, refuses
what is over the limits before decoding anything, decodes the first frame (which way up the video is
shown), asks for the plan, then decodes only the kept frames and resizes them a few at a time as
they are decoded, so a long high-resolution video never sits in memory at full size.
Sizes are the upright frame's: a phone video's display matrix is applied to its frames (the frame
plan, and so the token count, follows the shown frame, not the stored one).

Accepted: encoded bytes, `data:` URLs and allow-listed `http(s)://`/`file://` URLs (as for images,
`raypipe.inputs.urls`), a `pathlib.Path` (a trusted local file, read by the caller's own process:
Pipeline, batch jobs), a list of frames (numpy (H, W, 3) uint8 or PIL images, all one size) taken as
a video at `frames_fps`, and an already decoded video item. Still images (PNG, JPEG, GIF, ...) are
refused as `not_a_video`. Every refusal is an `InvalidInput` naming the item, the reason and a code.
How kept frames are found, and what happens when a stream ends early: `raypipe.inputs.video_decode`.
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
from collections.abc import Callable, Iterable, Iterator

import av
import numpy as np
from PIL import Image

from raypipe.errors import InvalidInput
from raypipe.inputs.media import DecodedVisual, pixel_hash
from raypipe.inputs.urls import read_url
from raypipe.inputs.video_decode import demuxed_extent, kept_frames, open_container, start_decoding, video_stream

RESIZE_BATCH = 8  # kept frames held at source size at once, before `FramePlan.resize` shrinks them
# What a family's frame plan names the video it refuses (it does not know the request's field): `load_video`
# renames it to the item it was given (`videos[0]`).
PLAN_ITEM = "video"


@dataclasses.dataclass(frozen=True, slots=True)
class VideoLimits:
    """What a server accepts as one video; everything but `max_frames` is checked before any frame is decoded
    (from the header, or from the packets where a header gives no duration)."""

    max_bytes: int = 512 * 1024 * 1024  # encoded size
    max_duration_s: float = 3600.0  # a 2-hour upload is refused
    max_source_pixels: int = 3840 * 2160  # per source frame: 4K yes, 8K no
    max_frames: int = 768  # kept frames (Qwen2.5-VL's own cap)
    allowed_url_prefixes: tuple[str, ...] = ()  # e.g. ("https://videos.example.com/", "file:///data/")
    fetch_timeout_s: float = 30.0

    def __post_init__(self):
        if min(self.max_bytes, self.max_duration_s, self.max_source_pixels, self.max_frames,
               self.fetch_timeout_s) <= 0:
            raise ValueError(f"video limits must be positive: {self}")


@dataclasses.dataclass(frozen=True, slots=True)
class VideoMetadata:
    """What the container's header (or, lacking duration and frame count, its packets) says about its video
    stream (a list of frames: what the caller says); width and height are the upright frame's."""

    total_num_frames: int
    fps: float  # average frame rate of the source
    duration_s: float
    width: int
    height: int
    codec: str = ""

    @property
    def frames_duration_s(self) -> float:
        """Frames / rate: the duration transformers' video decoders report (the header's may differ slightly)."""
        return self.total_num_frames / self.fps


@dataclasses.dataclass(frozen=True, slots=True)
class FramePlan:
    """A family's decision for one video: which source frames to keep and the size to resize them to."""

    indices: tuple[int, ...]  # source frame indices, in the order the family wants its frames
    height: int
    width: int
    resize: Callable[[np.ndarray, tuple[int, int]], np.ndarray]  # (n, H, W, 3) uint8, (h, w) -> (n, h, w, 3) uint8

    def __post_init__(self):
        # A repeated index repeats its frame (a plan may pad to an even count). The order is free (MiniCPM-V
        # lists main frames, then sub-second frames): decoding still runs forward over the distinct indices.
        if self.indices and min(self.indices) < 0:
            raise ValueError(f"frame indices must be non-negative: {self.indices[:16]}...")
        if self.height < 1 or self.width < 1:
            raise ValueError(f"frame plan size must be positive: {self.height}x{self.width}")


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


def load_video(video, limits: VideoLimits, plan_frames: PlanFrames, *, item: str = "video",
               frames_fps: float = 2.0) -> DecodedVisual:
    """Validate and decode one video into the frames `plan_frames` keeps; `frames_fps`: the rate of a frames list."""
    if isinstance(video, DecodedVisual) and video.kind == "video":
        return video
    if isinstance(video, (list, tuple)):
        return _load_frame_list(video, limits, plan_frames, item, frames_fps)
    if isinstance(video, pathlib.Path):
        try:
            size = video.stat().st_size
        except OSError as exc:
            raise InvalidInput(f"could not read video file ({exc})", item=item, code="video_fetch_failed") from None
        return _load_encoded(video, size, limits, plan_frames, item)
    if isinstance(video, str):
        video = read_url(video, kind="video", allowed_prefixes=limits.allowed_url_prefixes,
                         timeout_s=limits.fetch_timeout_s, max_bytes=limits.max_bytes, item=item)
    if isinstance(video, (bytes, bytearray, memoryview)):
        data = bytes(video)
        if not data:
            raise InvalidInput("video data is empty", item=item, code="not_a_video")
        return _load_encoded(data, len(data), limits, plan_frames, item)
    raise InvalidInput(f"unsupported video type {type(video).__name__}; expected bytes, a data: URL, a path or a "
                       "list of frames", item=item, code="unsupported_video_type")


def _load_encoded(source: bytes | pathlib.Path, size: int, limits: VideoLimits, plan_frames: PlanFrames,
                  item: str) -> DecodedVisual:
    if size > limits.max_bytes:
        raise InvalidInput(f"encoded video is {size} bytes; the limit is {limits.max_bytes}", item=item,
                           code="video_too_large")
    with open_container(source, item) as container:
        stream = video_stream(container, item)
        metadata, demuxed = _read_metadata(container, stream, limits, item)
        if not demuxed:
            return _decode_planned(container, stream, metadata, limits, plan_frames, item)
    # Counting the packets read the file to its end, and not every format seeks back: decode a fresh reading.
    with open_container(source, item) as container:
        return _decode_planned(container, video_stream(container, item), metadata, limits, plan_frames, item)


def _decode_planned(container: av.container.InputContainer, stream: av.VideoStream, metadata: VideoMetadata,
                    limits: VideoLimits, plan_frames: PlanFrames, item: str) -> DecodedVisual:
    """Check the header against the limits, then decode the first frame (its orientation), plan, decode the rest."""
    _check_header(metadata, limits, item)
    decoding = start_decoding(container, stream, item)
    width, height = decoding.orientation.size(metadata.width, metadata.height)
    metadata = dataclasses.replace(metadata, width=width, height=height)
    plan = _plan(plan_frames, metadata, limits, item)
    distinct = sorted(set(plan.indices))
    pixels = _resize_in_batches(kept_frames(decoding, distinct, metadata.fps, item), len(distinct), plan)
    return _visual(pixels, distinct, plan, metadata)


def _read_metadata(container: av.container.InputContainer, stream: av.VideoStream, limits: VideoLimits,
                   item: str) -> tuple[VideoMetadata, bool]:
    """The header's word on frame count, rate, duration and stored size, and whether the packets had to be
    counted for want of it (a live recording's header gives neither duration nor frame count)."""
    rate = stream.average_rate or stream.guessed_rate
    if stream.duration:
        duration = float(stream.duration * stream.time_base)
    elif container.duration:
        # Matroska/WebM give no stream duration, and their segment duration is the end time, from 0.
        duration = (container.duration - max(container.start_time or 0, 0)) / av.time_base
    else:
        duration = 0.0
    frames = stream.frames
    demuxed = not frames and not duration
    if demuxed:
        frames, duration = demuxed_extent(container, stream, limits.max_duration_s, item)
        # The whole recording's rate: the header's is guessed from the first packets, and a live recording's
        # rate drifts (a browser records fewer frames in a background tab); frame indices must span it all.
        rate = frames / duration if frames and duration else rate
    fps = float(rate) if rate else (frames / duration if frames and duration else 0.0)
    total = frames or round(duration * fps)  # Matroska/WebM headers give no frame count
    context = stream.codec_context
    metadata = VideoMetadata(total_num_frames=total, fps=fps, duration_s=duration, width=context.width,
                             height=context.height, codec=context.name)
    if fps <= 0 or context.width <= 0 or context.height <= 0:
        raise InvalidInput(f"video header gives no frame rate or frame size ({metadata})", item=item,
                           code="corrupt_video")
    return metadata, demuxed


def _load_frame_list(frames: list | tuple, limits: VideoLimits, plan_frames: PlanFrames, item: str,
                     fps: float) -> DecodedVisual:
    sizes = [_frame_size(frame, f"{item}[{i}]") for i, frame in enumerate(frames)]
    if not sizes:
        raise InvalidInput("video has no frames", item=item, code="empty_video")
    if len(set(sizes)) > 1:
        first = next(i for i, size in enumerate(sizes) if size != sizes[0])
        raise InvalidInput(f"frame {first} is {sizes[first][1]}x{sizes[first][0]} but frame 0 is "
                           f"{sizes[0][1]}x{sizes[0][0]}; all frames of a video must be one size", item=item,
                           code="frame_size_mismatch")
    height, width = sizes[0]
    metadata = VideoMetadata(total_num_frames=len(frames), fps=fps, duration_s=len(frames) / fps, width=width,
                             height=height, codec="frames")
    _check_header(metadata, limits, item)
    plan = _plan(plan_frames, metadata, limits, item)
    distinct = sorted(set(plan.indices))
    pixels = _resize_in_batches((_frame_rgb(frames[i]) for i in distinct), len(distinct), plan)
    return _visual(pixels, distinct, plan, metadata)


def _frame_size(frame, item: str) -> tuple[int, int]:
    if isinstance(frame, Image.Image):
        return frame.height, frame.width
    if isinstance(frame, np.ndarray) and frame.ndim == 3 and frame.shape[-1] == 3 and frame.dtype == np.uint8:
        return frame.shape[:2]
    what = f"array of shape {frame.shape} and dtype {frame.dtype}" if isinstance(frame, np.ndarray) \
        else type(frame).__name__
    raise InvalidInput(f"video frame is {what}; expected an (H, W, 3) uint8 array or a PIL image", item=item,
                       code="unsupported_video_type")


def _frame_rgb(frame: np.ndarray | Image.Image) -> np.ndarray:
    return np.asarray(frame.convert("RGB")) if isinstance(frame, Image.Image) else frame


def _check_header(metadata: VideoMetadata, limits: VideoLimits, item: str) -> None:
    """Refuse what the header shows is over the limits (nothing decoded yet)."""
    if metadata.duration_s > limits.max_duration_s:
        raise InvalidInput(f"video is {metadata.duration_s:.1f} s long; the limit is {limits.max_duration_s:g} s",
                           item=item, code="video_too_long")
    if metadata.width * metadata.height > limits.max_source_pixels:
        raise InvalidInput(f"video frames are {metadata.width}x{metadata.height}; the limit is "
                           f"{limits.max_source_pixels} pixels per frame", item=item, code="video_resolution_too_large")
    if metadata.total_num_frames <= 0:
        raise InvalidInput("video has no frames", item=item, code="empty_video")


def _plan(plan_frames: PlanFrames, metadata: VideoMetadata, limits: VideoLimits, item: str) -> FramePlan:
    """Ask the family which frames to keep, naming its refusals after `item`; refuse too many kept frames."""
    try:
        plan = plan_frames(metadata)
    except InvalidInput as err:
        if err.item != PLAN_ITEM:
            raise
        raise InvalidInput(err.reason, item=item, code=err.code) from None
    if not plan.indices:
        raise InvalidInput(f"no frame of this {metadata.duration_s:.2f} s video is kept", item=item,
                           code="empty_video")
    if len(plan.indices) > limits.max_frames:
        raise InvalidInput(f"{len(plan.indices)} frames would be sampled; the limit is {limits.max_frames}",
                           item=item, code="too_many_frames")
    if max(plan.indices) >= metadata.total_num_frames:
        raise ValueError(f"frame plan keeps frame {max(plan.indices)} of a {metadata.total_num_frames}-frame video")
    return plan


def _resize_in_batches(frames: Iterable[np.ndarray], count: int, plan: FramePlan) -> np.ndarray:
    """Resize frames a few at a time into one (count, h, w, 3) array: only resized frames accumulate."""
    out = np.empty((count, plan.height, plan.width, 3), np.uint8)
    done = 0
    for batch in _batched(iter(frames), RESIZE_BATCH):
        resized = plan.resize(np.stack(batch), (plan.height, plan.width))
        if resized.shape != (len(batch), plan.height, plan.width, 3) or resized.dtype != np.uint8:
            raise ValueError(f"frame plan resize gave {resized.shape} {resized.dtype}; expected "
                             f"({len(batch)}, {plan.height}, {plan.width}, 3) uint8")
        out[done:done + len(batch)] = resized
        done += len(batch)
    return out


def _batched(frames: Iterator[np.ndarray], size: int) -> Iterator[list[np.ndarray]]:
    while batch := list(itertools.islice(frames, size)):
        yield batch


def _visual(pixels: np.ndarray, distinct: list[int], plan: FramePlan, metadata: VideoMetadata) -> DecodedVisual:
    if list(distinct) != list(plan.indices):  # repeated or reordered indices: frames in the plan's order
        pixels = pixels[np.searchsorted(distinct, plan.indices)]
    pixels = np.ascontiguousarray(pixels)
    fps = len(plan.indices) / metadata.total_num_frames * metadata.fps
    return DecodedVisual(pixels, pixel_hash(pixels), "video", fps, metadata.frames_duration_s,
                         frame_times_s=tuple(i / metadata.fps for i in plan.indices))
