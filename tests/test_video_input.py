"""Videos: the kept frames are the source frames at the planned indices, whatever the container, start
time or decoding path (sequential or seeking), turned upright as the display matrix asks; every bad
video is an InvalidInput with its own code, and what the header shows is over the limits is refused
before any frame is decoded."""

from __future__ import annotations

import base64
import io

import av
import numpy as np
import pytest
from PIL import Image

from raypipe.errors import InvalidInput
from raypipe.inputs import video as video_module
from raypipe.inputs.media import DecodedVisual
from raypipe.inputs.video import RESIZE_BATCH, FramePlan, VideoLimits, VideoMetadata, load_video
from raypipe.testing.sample_videos import (
    cut_before_first_frame,
    frame_index,
    index_frame,
    index_frames,
    make_audio_only,
    make_long_4k_video,
    make_unknown_codec_video,
    make_video,
)

LIMITS = VideoLimits()
CODECS = {"mp4": "libx264", "mkv": "libx264", "webm": "libvpx-vp9", "mpegts": "libx264"}


def nearest(frames: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    height, width = size
    ys = np.arange(height) * frames.shape[1] // height
    xs = np.arange(width) * frames.shape[2] // width
    return np.ascontiguousarray(frames[:, ys][:, :, xs])


def every(step: int, size: tuple[int, int] | None = None, seen: list | None = None):
    """A plan keeping every `step`-th frame, resized by nearest neighbour (to `size`, else kept as is)."""
    def plan(metadata: VideoMetadata) -> FramePlan:
        if seen is not None:
            seen.append(metadata)
        height, width = size or (metadata.height, metadata.width)
        return FramePlan(tuple(range(0, metadata.total_num_frames, step)), height, width, nearest)
    return plan


def keeping(*indices: int):
    return lambda metadata: FramePlan(indices, metadata.height, metadata.width, nearest)


def all_frames(data: bytes) -> list[np.ndarray]:
    """The reference: every frame, decoded sequentially by the same decoder."""
    with av.open(io.BytesIO(data)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def sample(container="mp4", count=30, fps=10, **kwargs) -> bytes:
    return make_video(index_frames(count), fps, codec=CODECS[container], container=container, **kwargs)


@pytest.fixture(scope="module")
def long_4k():
    return make_long_4k_video()


# --- bad videos: each refused with its own code ---------------------------------------------------------

def _png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(index_frame(1)).save(buffer, format="PNG")
    return buffer.getvalue()


BAD = {
    "text": (lambda: b"hello, I am not a video", LIMITS, "not_a_video"),
    "empty_bytes": (lambda: b"", LIMITS, "not_a_video"),
    "png_image": (_png, LIMITS, "not_a_video"),
    "audio_only": (make_audio_only, LIMITS, "no_video_stream"),
    "header_only_mkv": (lambda: cut_before_first_frame(sample("mkv")), LIMITS, "corrupt_video"),
    "mp4_without_index": (lambda: sample("mp4")[:2000], LIMITS, "corrupt_video"),  # moov is written last
    "unknown_codec": (make_unknown_codec_video, LIMITS, "unsupported_codec"),
    "over_max_bytes": (sample, VideoLimits(max_bytes=1000), "video_too_large"),
    "too_many_frames": (sample, VideoLimits(max_frames=5), "too_many_frames"),
    "bad_base64": (lambda: "data:video/mp4;base64,@@not-base64@@", LIMITS, "invalid_base64"),
    "data_url_not_base64": (lambda: "data:video/mp4,rawbytes", LIMITS, "invalid_video_url"),
    "plain_string": (lambda: "cat.mp4", LIMITS, "invalid_video_url"),
    "https_url": (lambda: "https://example.com/cat.mp4", LIMITS, "url_not_allowed"),
    "file_url": (lambda: "file:///etc/passwd", LIMITS, "url_not_allowed"),
    "wrong_type": (lambda: 12345, LIMITS, "unsupported_video_type"),
    "image_item": (lambda: DecodedVisual(index_frame(0), "h"), LIMITS, "unsupported_video_type"),
    "empty_frame_list": (lambda: [], LIMITS, "empty_video"),
    "float_frames": (lambda: [np.zeros((48, 64, 3), np.float32)], LIMITS, "unsupported_video_type"),
    "mixed_frame_sizes": (lambda: [index_frame(0), index_frame(1, 48, 80)], LIMITS, "frame_size_mismatch"),
    "over_one_hour_of_frames": (lambda: [index_frame(0)] * 7201, LIMITS, "video_too_long"),  # at 2 fps
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_videos_are_named_and_coded(name):
    make, limits, code = BAD[name]
    with pytest.raises(InvalidInput) as err:
        load_video(make(), limits, every(3), item="videos[1]")
    assert err.value.item.startswith("videos[1]")  # a bad frame of a list is named as videos[1][i]
    assert err.value.code == code, str(err.value)
    assert str(err.value).startswith(f"{err.value.item}: ") and err.value.reason


def test_extreme_aspect_ratio_is_refused_naming_the_videos_item():
    """A frame plan does not know the request's field: `load_video` names its refusals after the item."""
    from raypipe.models.qwen2_5_vl.video import QwenVideoConfig, frame_planner

    strip = make_video([np.full((8, 2000, 3), 128, np.uint8)] * 2)  # 250:1
    with pytest.raises(InvalidInput) as err:
        load_video(strip, LIMITS, frame_planner(QwenVideoConfig()), item="videos[0]")
    assert (err.value.item, err.value.code) == ("videos[0]", "bad_aspect_ratio")
    assert err.value.reason == "video frames are 2000x8, an aspect ratio of 250:1; this model takes at most 200:1"


def test_plan_keeping_nothing_is_an_empty_video():
    with pytest.raises(InvalidInput) as err:
        load_video(sample(), LIMITS, keeping())
    assert err.value.code == "empty_video"


@pytest.fixture
def no_decoding(monkeypatch):
    """Fail the test if any frame would be decoded."""
    def refuse(*args, **kwargs):
        raise AssertionError("a frame was decoded")
    monkeypatch.setattr(video_module, "start_decoding", refuse)
    monkeypatch.setattr(video_module, "kept_frames", refuse)


def test_two_hour_4k_upload_is_refused_from_its_header(long_4k, no_decoding):
    planned = []
    with pytest.raises(InvalidInput) as err:
        load_video(long_4k, LIMITS, every(1, seen=planned))
    assert err.value.code == "video_too_long" and "7200" in err.value.reason
    with pytest.raises(InvalidInput) as err:
        load_video(long_4k, VideoLimits(max_duration_s=8000, max_source_pixels=1920 * 1080), every(1, seen=planned))
    assert err.value.code == "video_resolution_too_large" and "3840x2160" in err.value.reason
    assert planned == []  # refused before the family was even asked for a plan


def test_4k_source_within_limits_is_accepted(long_4k):
    visual = load_video(long_4k, VideoLimits(max_duration_s=8000), keeping(0))
    assert visual.pixels.shape == (1, 2160, 3840, 3)


# --- the kept frames are the right ones ------------------------------------------------------------------

@pytest.mark.parametrize("container", sorted(CODECS))
def test_kept_frames_equal_a_full_decode_at_those_indices(container):
    data = sample(container, count=40)
    reference = all_frames(data)
    visual = load_video(data, LIMITS, every(3))
    kept = list(range(0, 40, 3))
    np.testing.assert_array_equal(visual.pixels, np.stack([reference[i] for i in kept]))
    assert [frame_index(frame) for frame in visual.pixels] == kept
    assert visual.kind == "video" and visual.pixels.flags.c_contiguous and visual.pixels.dtype == np.uint8
    assert visual.fps == pytest.approx(len(kept) / 40 * 10)


class CountingContainer:
    """Wraps a PyAV container to count seeks and demuxed packets."""

    def __init__(self, container):
        self.container, self.seeks, self.packets = container, 0, 0

    def __getattr__(self, name):
        return getattr(self.container, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.container.close()

    def seek(self, *args, **kwargs):
        self.seeks += 1
        return self.container.seek(*args, **kwargs)

    def demux(self, *args, **kwargs):
        for packet in self.container.demux(*args, **kwargs):
            self.packets += 1
            yield packet


@pytest.fixture
def opened(monkeypatch):
    """The containers `load_video` opens, counted."""
    containers = []
    real_open = video_module.open_container

    def counting_open(source, item):
        containers.append(CountingContainer(real_open(source, item)))
        return containers[-1]
    monkeypatch.setattr(video_module, "open_container", counting_open)
    return containers


@pytest.mark.parametrize("container", ["mp4", "mkv", "webm"])
def test_sparse_plan_seeks_and_keeps_the_same_frames(container, opened):
    data = sample(container, count=120, gop_size=5)  # 12 s at 10 fps, a keyframe every half second
    reference = all_frames(data)
    kept = (0, 3, 37, 38, 71, 104, 119)  # gaps of 3.4 s: beyond the next keyframe
    visual = load_video(data, LIMITS, keeping(*kept))
    np.testing.assert_array_equal(visual.pixels, np.stack([reference[i] for i in kept]))
    assert opened[0].seeks >= 3
    assert opened[0].packets < 120 - 40  # whole groups of pictures were skipped


def test_dense_plan_decodes_on_without_seeking(opened):
    data = sample("mp4", count=60, gop_size=5)
    load_video(data, LIMITS, every(5))  # gaps of half a second: closer than MIN_SEEK_GAP_S
    assert opened[0].seeks == 0


def test_a_seek_landing_behind_teaches_the_keyframe_interval(opened):
    data = sample("mp4", count=200, gop_size=1000)  # one keyframe: every seek lands on frame 0
    kept = tuple(range(0, 200, 25))
    visual = load_video(data, LIMITS, keeping(*kept))
    assert [frame_index(frame) for frame in visual.pixels] == list(kept)
    assert opened[0].seeks == 1  # tried once, learnt that groups are longer than the gap


def test_unindexed_stream_is_decoded_on(opened):
    data = sample("mpegts", count=90, gop_size=10)
    visual = load_video(data, LIMITS, every(25))
    assert [frame_index(frame) for frame in visual.pixels] == [0, 25, 50, 75]
    assert opened[0].seeks == 0


def test_a_seek_past_its_target_rewinds_to_the_start(opened, monkeypatch):
    from raypipe.inputs import video_decode

    # MPEG-TS seeks by timestamp guesses and lands after its target here: pretend it has an index.
    monkeypatch.setattr(video_decode, "_INDEXED_FORMATS", ("mpegts",))
    data = sample("mpegts", count=90, gop_size=10)
    visual = load_video(data, LIMITS, every(25))
    assert [frame_index(frame) for frame in visual.pixels] == [0, 25, 50, 75]


@pytest.mark.parametrize("container", ["mkv", "webm"])
def test_matroska_without_frame_count_is_planned_from_duration(container):
    seen = []
    visual = load_video(sample(container, count=30, fps=10), LIMITS, every(4, seen=seen))
    assert (seen[0].total_num_frames, seen[0].fps, seen[0].duration_s) == (30, 10.0, 3.0)
    assert [frame_index(frame) for frame in visual.pixels] == list(range(0, 30, 4))


@pytest.mark.parametrize("container", ["mp4", "mkv", "mpegts"])
def test_stream_starting_at_a_late_timestamp(container):
    seen = []
    data = sample(container, count=30, start_pts=50)  # a clip cut from a longer stream, at 5 s
    visual = load_video(data, LIMITS, every(4, seen=seen))
    assert seen[0].total_num_frames == 30 and seen[0].duration_s == pytest.approx(3.0)
    assert [frame_index(frame) for frame in visual.pixels] == list(range(0, 30, 4))


def test_truncated_stream_repeats_its_last_decoded_frame():
    whole = sample("mkv", count=30)
    cut = whole[:len(whole) // 2]  # the header still says 3 s (30 frames)
    decoded = all_frames(cut)
    assert 0 < len(decoded) < 25
    visual = load_video(cut, LIMITS, keeping(0, 25, 29))
    np.testing.assert_array_equal(visual.pixels, np.stack([decoded[0], decoded[-1], decoded[-1]]))


def test_truncated_faststart_mp4_keeps_the_frames_before_the_cut():
    """An MP4 with its index first lists every frame; cut in half, the frames wholly before the cut are
    kept and the plan is padded with the last of them (the module docstring's promise), not refused."""
    whole = sample("mp4", count=60, gop_size=10, faststart=True)
    assert whole.index(b"moov") < whole.index(b"mdat")
    cut = whole[:len(whole) // 2]
    with av.open(io.BytesIO(whole)) as container:  # the oracle: which frames' data lies wholly before the cut
        stream = container.streams.video[0]
        ticks = 1 / (float(stream.time_base) * 10)
        complete = {round((packet.pts - stream.start_time) / ticks) for packet in container.demux(stream)
                    if packet.size and packet.pos + packet.size <= len(cut)}
    last = max(complete)
    assert 3 < last < 25 and complete == set(range(last + 1))
    reference = all_frames(whole)
    visual = load_video(cut, LIMITS, keeping(0, 3, 25, 59))
    np.testing.assert_array_equal(visual.pixels, np.stack([reference[0], reference[3], reference[last],
                                                           reference[last]]))


def test_frames_are_resized_a_few_at_a_time():
    batches = []

    def plan(metadata):
        def resize(frames, size):
            batches.append(len(frames))
            return nearest(frames, size)
        return FramePlan(tuple(range(30)), 24, 32, resize)
    visual = load_video(sample(count=30), LIMITS, plan)
    assert visual.pixels.shape == (30, 24, 32, 3)
    assert max(batches) <= RESIZE_BATCH and sum(batches) == 30
    assert [frame_index(frame) for frame in visual.pixels] == list(range(30))


def test_repeated_indices_repeat_their_frames():
    visual = load_video(sample(count=10), LIMITS, keeping(0, 4, 9, 9))
    assert [frame_index(frame) for frame in visual.pixels] == [0, 4, 9, 9]
    assert visual.fps == pytest.approx(4 / 10 * 10)


def test_frames_come_back_in_the_plans_order():
    """A plan may list frames out of order (MiniCPM-V: main frames, then sub-second frames); decoding
    still goes forward once over the distinct frames."""
    visual = load_video(sample(count=10), LIMITS, keeping(0, 5, 9, 2, 7, 7))
    assert [frame_index(frame) for frame in visual.pixels] == [0, 5, 9, 2, 7, 7]
    assert visual.duration_s == pytest.approx(10 / 10)


def test_frame_plan_checks():
    with pytest.raises(ValueError, match="non-negative"):
        FramePlan((3, -1), 10, 10, nearest)
    with pytest.raises(ValueError, match="positive"):
        FramePlan((0,), 0, 10, nearest)


def test_video_limits_must_be_positive():
    with pytest.raises(ValueError):
        VideoLimits(max_frames=0)


# --- a live recording's header: no duration, no frame count ---------------------------------------------

def media_recorder_webm(count: int, fps: int = 30) -> bytes:
    """A WebM as a browser's MediaRecorder writes it: VP8, millisecond timestamps, written live (no
    duration, no cues, no frame count in its header)."""
    data = make_video(index_frames(count), fps, codec="libvpx", container="webm", pts=[i / fps for i in range(count)],
                      live=True)
    with av.open(io.BytesIO(data)) as container:
        assert container.duration is None and container.streams.video[0].frames == 0
    return data


def test_live_webm_is_counted_from_its_packets():
    data = media_recorder_webm(45)
    seen = []
    visual = load_video(data, LIMITS, every(4, seen=seen))
    assert seen[0].total_num_frames == 45 and seen[0].fps == pytest.approx(30.0)
    assert seen[0].duration_s == pytest.approx(45 / 30, abs=0.002)  # millisecond timestamps
    reference = all_frames(data)
    kept = list(range(0, 45, 4))
    np.testing.assert_array_equal(visual.pixels, np.stack([reference[i] for i in kept]))
    assert [frame_index(frame) for frame in visual.pixels] == kept


def test_live_webm_whose_rate_drops_is_sampled_over_its_whole_length():
    """One second at 30 fps, then one at 10 fps (a background tab): the probed header rate says 30, but
    the plan's clock runs at the recording's average rate, so its frame indices reach the end."""
    times = [i / 30 for i in range(30)] + [1 + i / 10 for i in range(10)]
    data = make_video(index_frames(40), 30, codec="libvpx", container="webm", pts=times, live=True)
    with av.open(io.BytesIO(data)) as container:
        assert container.streams.video[0].average_rate == 30 and container.duration is None
    seen = []
    visual = load_video(data, LIMITS, every(1, seen=seen))
    fps = seen[0].fps
    assert seen[0].total_num_frames == 40 and fps == pytest.approx(40 / seen[0].duration_s)
    assert 1.9 < seen[0].duration_s < 2.0
    # The rule: a frame's index is its (millisecond) timestamp times the rate, rounded; index i shows the
    # frame that starts then (the first, where the recording was denser than the rate), else the one before.
    starts = [round(round(t * 1000) / 1000 * fps) for t in times]
    shown = [starts.index(i) if i in starts else max(j for j, k in enumerate(starts) if k < i) for i in range(40)]
    assert [frame_index(frame) for frame in visual.pixels] == shown and shown[-1] >= 38


def test_live_webm_over_the_duration_limit_is_refused_while_demuxing(opened):
    data = media_recorder_webm(60, fps=10)  # 6 s
    with pytest.raises(InvalidInput) as err:
        load_video(data, VideoLimits(max_duration_s=2.0), every(1))
    assert err.value.code == "video_too_long" and err.value.item == "video"
    assert opened[0].packets <= 2 * 10 + 2  # stopped right past the limit, not at the end


# --- phone videos: the display matrix is applied ---------------------------------------------------------

ORIENTATIONS = {  # (degrees counter-clockwise, hflip) -> the shown frame, from the decoded one (numpy)
    (90, False): lambda frame: np.rot90(frame, 1),
    (-90, False): lambda frame: np.rot90(frame, -1),  # what an iPhone held upright writes
    (180, False): lambda frame: np.rot90(frame, 2),
    (0, True): np.fliplr,
    (90, True): lambda frame: np.fliplr(np.rot90(frame, 1)),  # PyAV: the mirror applies after the turn
}
INVERSE = {(90, False): lambda frame: np.rot90(frame, -1), (-90, False): lambda frame: np.rot90(frame, 1),
           (180, False): lambda frame: np.rot90(frame, 2), (0, True): np.fliplr,
           (90, True): lambda frame: np.rot90(np.fliplr(frame), -1)}


@pytest.mark.parametrize("rotation, hflip", sorted(ORIENTATIONS), ids=str)
def test_display_matrix_turns_the_kept_frames_upright(rotation, hflip):
    upright = index_frames(12, 48, 64)  # what the camera saw; the file stores it as the sensor did
    stored = [np.ascontiguousarray(INVERSE[rotation, hflip](frame)) for frame in upright]
    data = make_video(stored, 10, rotation=rotation, hflip=hflip)
    seen = []
    visual = load_video(data, LIMITS, every(3, seen=seen))
    assert (seen[0].height, seen[0].width) == (48, 64)  # the plan is made for the upright frame
    reference = all_frames(data)  # PyAV's decode, as stored (it applies no display matrix)
    assert reference[0].shape[:2] == stored[0].shape[:2]
    shown = ORIENTATIONS[rotation, hflip]
    np.testing.assert_array_equal(visual.pixels, np.stack([shown(reference[i]) for i in range(0, 12, 3)]))
    assert [frame_index(frame) for frame in visual.pixels] == [0, 3, 6, 9]


def test_portrait_phone_video_is_planned_as_its_upright_frames():
    """Qwen's frame size and token grid for a portrait clip stored sideways (an iPhone's -90 degrees) are
    those of the same clip sent upright."""
    from raypipe.models.qwen2_5_vl.video import QwenVideoConfig, frame_planner

    upright = index_frames(8, 64, 48)
    sideways = make_video([np.ascontiguousarray(np.rot90(frame, 1)) for frame in upright], 2, rotation=-90)
    planner = frame_planner(QwenVideoConfig())
    phone, sent_upright = load_video(sideways, LIMITS, planner), load_video(upright, LIMITS, planner, frames_fps=2)
    assert phone.pixels.shape == sent_upright.pixels.shape and phone.height > phone.width
    assert [frame_index(frame) for frame in phone.pixels] == [frame_index(frame) for frame in sent_upright.pixels]


# --- every accepted way of sending a video -------------------------------------------------------------

def test_frame_list_is_a_video_at_frames_fps():
    frames = index_frames(12)
    as_arrays = load_video(frames, LIMITS, every(3, size=(24, 32)), frames_fps=4.0)
    assert as_arrays.pixels.shape == (4, 24, 32, 3)
    np.testing.assert_array_equal(as_arrays.pixels, nearest(np.stack(frames[::3]), (24, 32)))
    assert as_arrays.fps == pytest.approx(4 / 12 * 4.0)
    as_images = load_video(tuple(Image.fromarray(frame) for frame in frames), LIMITS, every(3, size=(24, 32)),
                           frames_fps=4.0)
    np.testing.assert_array_equal(as_images.pixels, as_arrays.pixels)
    assert as_images.content_hash == as_arrays.content_hash


def test_frame_size_mismatch_names_the_frame():
    with pytest.raises(InvalidInput, match="frame 2 is 80x48 but frame 0 is 64x48"):
        load_video([index_frame(0), index_frame(1), index_frame(2, 48, 80)], LIMITS, every(1))


def test_data_url_file_url_and_path_decode_alike(tmp_path):
    data = sample(count=20)
    expected = load_video(data, LIMITS, every(5))
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    for video, limits in [
        ("data:video/mp4;base64," + base64.b64encode(data).decode(), LIMITS),
        ("DATA:video/mp4;BASE64," + base64.encodebytes(data).decode(), LIMITS),  # line-wrapped
        (f"file://{path}", VideoLimits(allowed_url_prefixes=(f"file://{tmp_path}/",))),
        (path, LIMITS),
        (memoryview(data), LIMITS),
    ]:
        visual = load_video(video, limits, every(5))
        np.testing.assert_array_equal(visual.pixels, expected.pixels)
        assert visual.content_hash == expected.content_hash


def test_missing_path_is_a_fetch_failure(tmp_path):
    with pytest.raises(InvalidInput) as err:
        load_video(tmp_path / "missing.mp4", LIMITS, every(1))
    assert err.value.code == "video_fetch_failed"


def test_decoded_video_is_returned_as_is():
    visual = load_video(sample(count=10), LIMITS, every(2))
    assert load_video(visual, LIMITS, every(1)) is visual
