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
Only containers with a keyframe index are sought in; should a seek still land past its target, or
find no frame at all (the index lists frames past the end of a truncated file), the stream is rewound
to its start and decoded on from there, seeking no more.

If the stream ends before a kept index (its header promised more frames than it holds, e.g. a
truncated upload), the last decoded frame is repeated for the missing ones -- the video stays on its
last picture. An upload cut short inside a frame (an MP4 whose index, written first, lists frames
past the cut) ends in a packet the demuxer flags corrupt: when the decoder refuses such a packet, it
is dropped (its frame is lost, not the ones before it) rather than the video refused. A video none
of whose frames decodes is corrupt.

The first frame is decoded before the frame plan is made (`start_decoding`): its display matrix tells
which way up the video is shown (`raypipe.inputs.video_orientation`), and every kept frame is turned
upright. Where a header gives neither duration nor frame count (a live recording, e.g. a browser's
MediaRecorder WebM), they are counted from the packets first (`demuxed_extent`), decoding nothing.

The decoder keeps PyAV's default threading (slices only). Frame threading ("AUTO") was measured
slower on a 30 s 640x360 h264 clip sampled at 2 fps on a 2-core host (0.52 s against 0.39 s), and a
server decodes many videos at once anyway: parallelism comes from requests, not from one decoder.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import pathlib
from collections.abc import Iterator, Sequence

import av
import av.error
import numpy as np

from raypipe.errors import InvalidInput
from raypipe.inputs.video_orientation import Orientation

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


def demuxed_extent(container: av.container.InputContainer, stream: av.VideoStream, max_duration_s: float,
                   item: str) -> tuple[int, float]:
    """(frames, seconds) of a stream whose header gives neither, from its packets: one packet per frame,
    from the first timestamp to the end of the last frame. Nothing is decoded; the bytes read are bounded
    by the encoded size checked before opening, and reading stops as soon as a timestamp passes
    `max_duration_s` (`video_too_long`), so an over-long stream is refused without reading it all."""
    time_base = float(stream.time_base)
    count, first, last, last_duration = 0, None, None, 0
    try:
        for packet in container.demux(stream):
            if packet.size == 0:  # the empty packet that ends the demuxing
                continue
            count += 1
            if packet.pts is None:
                continue
            first = packet.pts if first is None else min(first, packet.pts)
            if last is None or packet.pts >= last:
                last, last_duration = packet.pts, packet.duration or 0
            if (last - first) * time_base > max_duration_s:
                raise InvalidInput(f"video runs past {max_duration_s:g} s (its header gives no duration; read up "
                                   f"to there); the limit is {max_duration_s:g} s", item=item, code="video_too_long")
    except av.error.FFmpegError as exc:
        raise _corrupt(exc, item) from None
    if first is None:
        return count, 0.0
    span = (last - first) * time_base
    # A recorder that writes no frame durations (MediaRecorder): the last frame lasts as long as the average one.
    last_s = last_duration * time_base if last_duration else (span / (count - 1) if count > 1 else 0.0)
    return count, span + last_s


@dataclasses.dataclass(slots=True)
class Decoding:
    """A video stream being decoded from its start, its first frame already decoded."""

    container: av.container.InputContainer
    stream: av.VideoStream
    orientation: Orientation  # from the first frame's display matrix
    frames: Iterator[av.VideoFrame]  # the decoded frames from the start, the first one included


def start_decoding(container: av.container.InputContainer, stream: av.VideoStream, item: str) -> Decoding:
    """Decode up to the first frame, which tells the orientation; refuse a video with no decodable frame."""
    frames = _decoded(container, stream)
    try:
        first = next(frames, None)
    except av.error.FFmpegError as exc:
        raise _corrupt(exc, item) from None
    if first is None:
        raise InvalidInput("video holds no decodable frame (truncated or corrupt)", item=item, code="corrupt_video")
    return Decoding(container, stream, Orientation.of_frame(first), itertools.chain([first], frames))


def kept_frames(decoding: Decoding, indices: Sequence[int], fps: float, item: str) -> Iterator[np.ndarray]:
    """Upright RGB (H, W, 3) uint8 frames at `indices` (ascending, distinct), in order; see the module docstring."""
    container, stream, upright = decoding.container, decoding.stream, decoding.orientation.apply
    ticks_per_frame = 1 / (float(stream.time_base) * fps)
    start = stream.start_time  # None: the first decoded frame's timestamp is the start
    min_seek_gap = fps * MIN_SEEK_GAP_S
    longest_gop = 0  # frames between keyframes: the longest seen, or learnt from where a seek landed
    next_kept, seek_to, position = 0, None, -1  # position: index of the last decoded frame
    last = None  # the last decoded frame
    seekable = container.format.name in _INDEXED_FORMATS
    frames = decoding.frames
    try:
        while next_kept < len(indices):
            if seek_to is not None:
                container.seek(start + max(0, round((seek_to - 0.5) * ticks_per_frame)), stream=stream,
                               backward=True)
                frames = _decoded(container, stream)
            landing, last_key, shown = seek_to is not None, None, None  # shown: on screen before this frame
            for frame in frames:
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
                    yield upright((current if indices[next_kept] == index or shown is None else shown).rgb())
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
                if landing and seekable:  # the seek found no frame (its target lies past a truncated end): rewind
                    seek_to, seekable = 0, False
                    continue
                break  # end of stream
    except av.error.FFmpegError as exc:
        raise _corrupt(exc, item) from None
    for _ in range(len(indices) - next_kept):  # the stream ended early: it stays on its last picture
        yield upright(last.rgb())


@dataclasses.dataclass(slots=True)
class _Decoded:
    """A decoded frame, converted to RGB at most once (two kept indices may show the same frame)."""

    frame: av.VideoFrame
    pixels: np.ndarray | None = None

    def rgb(self) -> np.ndarray:
        if self.pixels is None:
            self.pixels = self.frame.to_ndarray(format="rgb24")
        return self.pixels


def _corrupt(exc: av.error.FFmpegError, item: str) -> InvalidInput:
    return InvalidInput(f"video data is corrupt ({exc.strerror})", item=item, code="corrupt_video")


def _decoded(container: av.container.InputContainer, stream: av.VideoStream) -> Iterator[av.VideoFrame]:
    """Decoded frames from the demuxer's current position (its last, empty packet flushes the decoder)."""
    for packet in container.demux(stream):
        try:
            frames = packet.decode()
        except av.error.FFmpegError:
            if not packet.is_corrupt:
                raise
            continue  # cut short by the end of the data: its frame is lost, the frames before it are not
        yield from frames


def _head(path: pathlib.Path) -> bytes:
    try:
        with path.open("rb") as file:
            return file.read(12)
    except OSError:
        return b""
