"""The PyAV side of video loading: open a container (telling "not a video" from "a broken video") and
decode only the frames a plan keeps.

Kept frames are found by timestamp, not by counting: a decoded frame's index is its presentation
time since the stream's start times the source rate, so streams that start at a non-zero timestamp
(a clip cut from a broadcast, MPEG-TS) and frames reached by seeking are numbered the same way. The
frame kept for index i is the one on screen at i's time: the last frame that starts at or before it.

Between kept frames that are close together the decoder runs on, and only kept frames are converted
to RGB. When the next kept frame is further ahead than the longest keyframe interval seen so far
(and more than a second), the demuxer seeks to it instead: decoding restarts at the keyframe before
it, which skips whole groups of pictures. Where a seek lands teaches how long groups are at least
(no keyframe lies between the landing and the target), so a gap that short is not sought again.
Only containers with a keyframe index are sought in; should a seek still land past its target, the
stream is rewound to its start and decoded on from there, seeking no more.

If the stream ends before a kept index (its header promised more frames than it holds, e.g. a
truncated upload), the last decoded frame is repeated for the missing ones -- the video stays on its
last picture -- but only if some frame was decoded at all; otherwise the video is corrupt.

The decoder keeps PyAV's default threading (slices only). Frame threading ("AUTO") was measured
slower on a 30 s 640x360 h264 clip sampled at 2 fps on a 2-core host (0.52 s against 0.39 s), and a
server decodes many videos at once anyway: parallelism comes from requests, not from one decoder.
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
from collections.abc import Iterator, Sequence

import av
import av.error
import numpy as np

from raypipe.errors import InvalidInput

MIN_SEEK_GAP_S = 1.0  # closer kept frames are reached by decoding on: a seek flushes the decoder's pipeline
# Containers with an index of keyframes, where a backward seek lands on the keyframe before its target.
# Others (MPEG-TS, raw streams) seek by guessing from timestamps and may land after it: decoded on.
_INDEXED_FORMATS = ("mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm")
# Still-image demuxers FFmpeg would happily open as a one-frame "video": an image is not a video here.
_IMAGE_FORMATS = ("image2", "gif", "apng")
# How a container file starts (mp4/mov boxes, Matroska/WebM EBML, AVI, FLV, Ogg): such data that
# FFmpeg cannot open is a broken video rather than not a video at all.
_BOX_TYPES = (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip")
_SIGNATURES = (b"\x1a\x45\xdf\xa3", b"RIFF", b"FLV", b"OggS")


def open_container(source: bytes | pathlib.Path, item: str) -> av.container.InputContainer:
    """Open `source` and read its header; refuse data that is not a video container, or is a still image."""
    try:
        container = av.open(io.BytesIO(source) if isinstance(source, bytes) else str(source), mode="r",
                            metadata_errors="ignore")
    except av.error.FFmpegError as exc:
        head = source[:12] if isinstance(source, bytes) else _head(source)
        if head[4:8] in _BOX_TYPES or head.startswith(_SIGNATURES):
            raise InvalidInput(f"video container is truncated or corrupt ({exc.strerror})", item=item,
                               code="corrupt_video") from None
        raise InvalidInput("data is not a recognised video format", item=item, code="not_a_video") from None
    name = container.format.name
    if name.endswith("_pipe") or name in _IMAGE_FORMATS:
        container.close()
        raise InvalidInput(f"data is a still image ({name}), not a video; send it as an image", item=item,
                           code="not_a_video")
    return container


def video_stream(container: av.container.InputContainer, item: str) -> av.VideoStream:
    """The first video stream, with a decoder for its codec."""
    if not container.streams.video:
        kinds = ", ".join(stream.type for stream in container.streams) or "nothing"
        raise InvalidInput(f"file has no video stream (it holds {kinds})", item=item, code="no_video_stream")
    stream = container.streams.video[0]
    if stream.codec_context is None:  # PyAV gives no codec context where FFmpeg has no decoder
        raise InvalidInput("no decoder for this video's codec on this server", item=item, code="unsupported_codec")
    return stream


def kept_frames(container: av.container.InputContainer, stream: av.VideoStream, indices: Sequence[int],
                fps: float, item: str) -> Iterator[np.ndarray]:
    """RGB (H, W, 3) uint8 frames at `indices` (ascending, distinct), in order; see the module docstring."""
    ticks_per_frame = 1 / (float(stream.time_base) * fps)
    start = stream.start_time  # None: the first decoded frame's timestamp is the start
    min_seek_gap = fps * MIN_SEEK_GAP_S
    longest_gop = 0  # frames between keyframes: the longest seen, or learnt from where a seek landed
    next_kept, seek_to, position = 0, None, -1  # position: index of the last decoded frame
    last = None  # the last decoded frame
    seekable = container.format.name in _INDEXED_FORMATS
    try:
        while next_kept < len(indices):
            if seek_to is not None:
                container.seek(start + max(0, round((seek_to - 0.5) * ticks_per_frame)), stream=stream,
                               backward=True)
            landing, last_key, shown = seek_to is not None, None, None  # shown: on screen before this frame
            for frame in _decoded(container, stream):
                if start is None:
                    start = frame.pts or 0
                index = position + 1 if frame.pts is None else round((frame.pts - start) / ticks_per_frame)
                if landing and index > seek_to and seekable:  # overshot (no usable index after all): rewind once
                    seek_to, seekable = 0, False
                    break
                if landing:  # no keyframe between here and the target: groups are at least that long
                    longest_gop, landing = max(longest_gop, seek_to - index), False
                if frame.key_frame:
                    longest_gop = max(longest_gop, index - last_key) if last_key is not None else longest_gop
                    last_key = index
                current, kept_before = _Decoded(frame), next_kept
                while next_kept < len(indices) and indices[next_kept] <= index:
                    # On screen at the kept index's time: this frame if it starts then, else the one before it.
                    yield (current if indices[next_kept] == index or shown is None else shown).rgb()
                    next_kept += 1
                shown = last = current
                # Decide on seeking only after a kept frame (or the first frame): never twice towards one target.
                first_frame, position = position < 0, index
                if seekable and next_kept < len(indices) and (next_kept > kept_before or first_frame):
                    gap = indices[next_kept] - index
                    if gap > min_seek_gap and gap > longest_gop:
                        seek_to = indices[next_kept]
                        break
            else:
                break  # end of stream
    except av.error.FFmpegError as exc:
        raise InvalidInput(f"video data is corrupt ({exc.strerror})", item=item, code="corrupt_video") from None
    if next_kept < len(indices):
        if last is None:
            raise InvalidInput("video holds no decodable frame (truncated or corrupt)", item=item,
                               code="corrupt_video")
        for _ in range(len(indices) - next_kept):
            yield last.rgb()


@dataclasses.dataclass(slots=True)
class _Decoded:
    """A decoded frame, converted to RGB at most once (two kept indices may show the same frame)."""

    frame: av.VideoFrame
    pixels: np.ndarray | None = None

    def rgb(self) -> np.ndarray:
        if self.pixels is None:
            self.pixels = self.frame.to_ndarray(format="rgb24")
        return self.pixels


def _decoded(container: av.container.InputContainer, stream: av.VideoStream) -> Iterator[av.VideoFrame]:
    """Decoded frames from the demuxer's current position (its last, empty packet flushes the decoder)."""
    for packet in container.demux(stream):
        yield from packet.decode()


def _head(path: pathlib.Path) -> bytes:
    try:
        with path.open("rb") as file:
            return file.read(12)
    except OSError:
        return b""
