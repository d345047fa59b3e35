"""Tiny videos written in code with PyAV (nothing to download), good ones and the bad ones a server meets.

Every frame of `index_frames` shows its own index as flat colour blocks (one base-4 digit per block
and channel, levels far apart), so `frame_index` reads it back through lossy compression and
resizing: a test can tell which source frame a decoder returned without trusting timestamps.
"""

from __future__ import annotations

import fractions
import io
import pathlib
import tempfile

import av
import numpy as np

_LEVELS = np.array([32, 96, 160, 224], dtype=np.uint8)  # 64 apart: survives h264/vp9 at default quality
_GRID = (2, 2)  # blocks (rows, cols); 4 blocks x 3 channels x 2 bits = indices up to 4096
_FORMATS = {"mp4": "mp4", "webm": "webm", "mkv": "matroska", "mpegts": "mpegts"}
_CLUSTER_ID = b"\x1f\x43\xb6\x75"  # Matroska element holding the frames


def index_frame(index: int, height: int = 48, width: int = 64) -> np.ndarray:
    """A frame whose flat blocks spell `index` in base 4 (block-major, then R, G, B)."""
    rows, cols = _GRID
    digits = [(index >> (2 * k)) & 3 for k in range(rows * cols * 3)]
    frame = np.empty((height, width, 3), np.uint8)
    for block in range(rows * cols):
        r, c = divmod(block, cols)
        ys = slice(r * height // rows, (r + 1) * height // rows)
        xs = slice(c * width // cols, (c + 1) * width // cols)
        frame[ys, xs] = _LEVELS[digits[3 * block:3 * block + 3]]
    return frame


def index_frames(count: int, height: int = 48, width: int = 64) -> list[np.ndarray]:
    return [index_frame(i, height, width) for i in range(count)]


def frame_index(frame: np.ndarray) -> int:
    """The index `index_frame` drew, read from the middle of each block (edges blur under compression)."""
    rows, cols = _GRID
    height, width = frame.shape[:2]
    index = 0
    for block in range(rows * cols):
        r, c = divmod(block, cols)
        y0, y1 = r * height // rows, (r + 1) * height // rows
        x0, x1 = c * width // cols, (c + 1) * width // cols
        middle = frame[(3 * y0 + y1) // 4:(y0 + 3 * y1) // 4 + 1, (3 * x0 + x1) // 4:(x0 + 3 * x1) // 4 + 1]
        means = middle.reshape(-1, 3).mean(axis=0)
        for channel, mean in enumerate(means):
            digit = int(np.abs(_LEVELS.astype(float) - mean).argmin())
            index |= digit << (2 * (3 * block + channel))
    return index


def make_video(frames, fps: int = 10, *, codec: str = "libx264", container: str = "mp4", gop_size: int | None = None,
               start_pts: int = 0, pts: list[int] | None = None, live: bool = False, faststart: bool = False,
               rotation: int = 0, hflip: bool = False) -> bytes:
    """Encode `frames` ((H, W, 3) uint8 each) into an in-memory file.

    `gop_size` puts a keyframe every so many frames (seek tests); `start_pts` shifts every timestamp
    (in frames), like a clip cut from a longer stream; `pts` gives each frame's timestamp in seconds
    instead (a sparse or variable-rate stream, e.g. two frames two hours apart). `live` writes a
    WebM/Matroska as a recorder does while recording (a browser's MediaRecorder): no duration, no cues.
    `faststart` puts an MP4's index (moov) before its frames, as web-ready files have it. `rotation`
    (degrees counter-clockwise) and `hflip` write a display matrix, as a phone held upright does.
    """
    height, width = frames[0].shape[:2]
    options = {"live": "1"} if live else {"movflags": "faststart"} if faststart else {}
    with tempfile.TemporaryDirectory() as folder:
        # The MP4 muxer moves its index to the front by reopening its output by name: a file, not a buffer.
        target = pathlib.Path(folder, "video") if faststart else io.BytesIO()
        with av.open(target, mode="w", format=_FORMATS[container], options=options) as output:
            stream = output.add_stream(codec, rate=fps)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            if rotation or hflip:
                stream.set_display_rotation(rotation, hflip=hflip)
            if pts is not None:
                stream.codec_context.time_base = fractions.Fraction(1, 1000)
            if gop_size is not None:
                stream.codec_context.gop_size = gop_size
                if codec == "libx264":  # x264 also inserts keyframes at scene cuts; only the fixed GOP is wanted
                    stream.codec_context.options = {"sc_threshold": "0", "keyint_min": str(gop_size)}
            for i, pixels in enumerate(frames):
                frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")
                frame.pts = round(pts[i] * 1000) if pts is not None else start_pts + i
                output.mux(stream.encode(frame))
            output.mux(stream.encode(None))
        return target.read_bytes() if faststart else target.getvalue()


def make_audio_only(seconds: float = 1.0, rate: int = 16_000) -> bytes:
    """A Matroska file with one AAC audio stream and no video (a voice memo sent as a video)."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="matroska") as output:
        stream = output.add_stream("aac", rate=rate)
        samples = np.sin(np.arange(int(seconds * rate), dtype=np.float32) * 0.05)[None, :]
        for start in range(0, samples.shape[1], 1024):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples[:, start:start + 1024]), format="fltp",
                                               layout="mono")
            frame.sample_rate, frame.pts = rate, start
            output.mux(stream.encode(frame))
        output.mux(stream.encode(None))
    return buffer.getvalue()


def make_long_4k_video() -> bytes:
    """A 2-hour 3840x2160 video holding only two (flat, cheap) frames: its header alone must get it refused."""
    black = np.zeros((2160, 3840, 3), np.uint8)
    return make_video([black, black], fps=30, container="mkv", pts=[0.0, 7200.0])


def cut_before_first_frame(matroska: bytes) -> bytes:
    """A Matroska/WebM file cut right after its first Cluster starts: a readable header, no decodable frame."""
    return matroska[:matroska.index(_CLUSTER_ID) + 8]


def make_unknown_codec_video() -> bytes:
    """A Matroska file whose video track names a codec no decoder knows (its CodecID rewritten)."""
    return make_video(index_frames(5), container="mkv").replace(b"V_MPEG4/ISO/AVC", b"V_MPEG4/ISO/XYZ")
