"""`raypipe batch` against a real S3-protocol server (moto, loopback) and local folders.

Every expected value comes from `Pipeline` (itself checked against transformers elsewhere) or from
the inputs we wrote, never from the batch code under test. Jobs run one encoder actor (each costs seconds
to start) except where several are the point: the S3 embed job and the job whose actor is killed run two.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray
import torch
from PIL import Image

from raypipe.batch import BatchOptions, run_batch
from raypipe.batch.inputs import kind_of
from raypipe.cli import build_parser
from raypipe.config import ModelConfig
from raypipe.errors import InvalidInput
from raypipe.jobs.batch import options_from_args
from raypipe.storage import S3Options, list_files, open_filesystem
from raypipe.testing.sample_videos import cut_before_first_frame, index_frames, make_video
from tests.conftest import over_first_workers, stop_decoder

pytestmark = pytest.mark.slow

KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}
FORMATS = ["PNG", "JPEG", "WEBP", "BMP", "GIF"]
# Expected error code per bad file: inputs.images's codes, the same the endpoint returns.
BAD_FILES = {
    "bad/not_an_image.jpg": "not_an_image",
    "bad/empty.png": "not_an_image",
    "bad/truncated.jpg": "corrupt_image",
    "bad/too_small.png": "image_too_small",
    "bad/too_large.png": "image_too_large",
    "bad/bomb.png": "image_too_large",
    "bad/cut.mkv": "corrupt_video",  # inputs.video's codes: a header with no decodable frame
}


def _encode(pixels: np.ndarray, fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def _images(count: int, seed: int = 0) -> dict[str, bytes]:
    """Mixed sizes (thumbnails to a few hundred pixels, wide and tall) and formats."""
    rng = np.random.default_rng(seed)
    files = {}
    for i in range(count):
        h, w = int(rng.integers(16, 120)), int(rng.integers(16, 120))
        if i % 7 == 0:
            h, w = h * 3, w  # tall
        if i % 11 == 0:
            h, w = h, w * 4  # wide
        fmt = FORMATS[i % len(FORMATS)]
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        ext = {"JPEG": "jpg"}.get(fmt, fmt.lower())
        files[f"{'sub/' if i % 3 == 0 else ''}img{i:03d}.{ext}"] = _encode(pixels, fmt)
    return files


def _bad_files() -> dict[str, bytes]:
    jpeg = _encode(np.random.default_rng(1).integers(0, 256, (96, 96, 3), dtype=np.uint8), "JPEG")
    big = io.BytesIO()
    Image.new("1", (7000, 7000)).save(big, format="PNG")  # 49 Mpx > ImageLimits.max_pixels (40 M)
    bomb = io.BytesIO()
    Image.new("1", (14000, 14000)).save(bomb, format="PNG")  # 196 Mpx: PIL's decompression-bomb guard
    return {"bad/not_an_image.jpg": b"this is text, not a JPEG", "bad/empty.png": b"",
            "bad/truncated.jpg": jpeg[: len(jpeg) * 2 // 3],  # header whole, scan data cut
            "bad/too_small.png": _encode(np.zeros((10, 10, 3), np.uint8), "PNG"),
            "bad/too_large.png": big.getvalue(), "bad/bomb.png": bomb.getvalue(),
            "bad/cut.mkv": cut_before_first_frame(make_video(index_frames(10), container="mkv"))}


@pytest.fixture(scope="module")
def videos() -> dict[str, bytes]:
    """Two clips of different sizes, lengths and containers (their frames spell their index)."""
    return {"clips/a.mp4": make_video(index_frames(20, 96, 128), fps=10),
            "clips/b.webm": make_video(index_frames(12, 48, 64), fps=4, codec="libvpx-vp9", container="webm")}


@pytest.fixture(scope="module")
def s3_server():
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(scope="module")
def s3(s3_server):
    options = S3Options(endpoint_url=s3_server, region="us-east-1", access_key="testing", secret_key="testing")
    _make_buckets(options, "photos", "results", "models")
    return options


@pytest.fixture(scope="module")
def env(s3_server):
    """Environment for `raypipe batch` subprocesses: the standard AWS variables."""
    # RAY_ADDRESS=local: a Ray of its own, never a cluster someone else started with `ray start`.
    return {**os.environ, **KEYS, "AWS_ENDPOINT_URL_S3": s3_server, "RAY_ADDRESS": "local"}


def _make_buckets(s3, *names: str) -> None:
    import pyarrow.fs as pafs

    host = s3.endpoint_url.removeprefix("http://")
    fs = pafs.S3FileSystem(endpoint_override=host, scheme="http", region=s3.region, access_key=s3.access_key,
                           secret_key=s3.secret_key, allow_bucket_creation=True)
    for name in names:
        fs.create_dir(name)


def _put(s3, uri: str, files: dict[str, bytes]) -> None:
    fs, root = open_filesystem(uri, s3)
    for name, data in files.items():
        with fs.open_output_stream(f"{root}/{name}") as out:
            out.write(data)


@pytest.fixture(scope="module")
def photos(s3, videos):
    """The good images under s3://photos/in/; `videos` and `BAD_FILES` are there too."""
    images = _images(44)
    _put(s3, "s3://photos/in", {**images, **videos, **_bad_files(), "notes.txt": b"not listed: no image extension"})
    return images


def _video_embedding(hf_model, ckpt, data: bytes) -> torch.Tensor:
    """transformers' vision tower on the video's sampled frames (raypipe's frame plan, checked elsewhere)."""
    from raypipe.inputs.video import VideoLimits, VideoSampling, load_video
    from raypipe.models.qwen2_5_vl.video import process_video
    from raypipe.models.registry import vision_adapter

    adapter = vision_adapter(ckpt)
    frames = load_video(data, VideoLimits(), adapter.plan_frames(VideoSampling())).pixels
    pixel_values, grid = process_video(frames, adapter.video_config)
    with torch.no_grad():
        return hf_model.model.visual(pixel_values, grid_thw=torch.tensor([grid])).pooler_output


@pytest.fixture(scope="module")
def pipe(tiny_ckpt, three_worker_pipelines):
    """The reference: a `Pipeline` over one of the session's `tiny` workers (no embedding cache), its own decoder."""
    p = over_first_workers(three_worker_pipelines.get(tiny_ckpt), 1, cache_bytes=0)
    yield p
    stop_decoder(p)


def _read_output(uri: str, s3):
    import pyarrow as pa

    fs, root = open_filesystem(uri, s3)
    parts = [i.path for i in list_files(fs, root, recursive=False) if i.base_name.startswith("part-")]
    return pa.concat_tables([pq.read_table(p, filesystem=fs) for p in parts]) if parts else None


def _batch_cli(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "raypipe.cli", "batch", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_embed_s3_to_s3_matches_pipeline(photos, videos, s3, pipe, tiny_ckpt, hf_model):
    summary = run_batch(BatchOptions(input="s3://photos/in/", output="s3://results/embed/", s3=s3,
                                     model=ModelConfig(str(tiny_ckpt), num_encoders=2), rows_per_file=16))
    table = _read_output("s3://results/embed/", s3)
    rows = {r["id"]: r for r in table.to_pylist()}
    assert sorted(rows) == sorted([*photos, *videos, *BAD_FILES]) and table.num_rows == len(rows)  # each once
    assert summary.inputs == len(rows) == summary.processed and summary.skipped == 0
    assert summary.errors == {code: list(BAD_FILES.values()).count(code) for code in set(BAD_FILES.values())}
    for name, code in BAD_FILES.items():
        assert rows[name]["error"] == code and rows[name]["embedding"] is None and rows[name]["error_message"]
    names = sorted(photos)
    reference = pipe.encode([photos[n] for n in names])
    for name, emb in zip(names, reference):
        row = rows[name]
        assert row["error"] is None and row["model"] == str(tiny_ckpt)
        assert row["path"] == f"s3://photos/in/{name}"
        image = Image.open(io.BytesIO(photos[name]))
        assert (row["width"], row["height"]) == image.size and row["num_tokens"] == emb.shape[0]
        np.testing.assert_allclose(np.asarray(row["embedding"], np.float32), emb.float().mean(0).numpy(),
                                   atol=1e-5, rtol=0)
    for name, data in videos.items():  # one pooled row per video
        emb = _video_embedding(hf_model, tiny_ckpt, data)
        assert rows[name]["error"] is None and rows[name]["num_tokens"] == emb.shape[0]
        np.testing.assert_allclose(np.asarray(rows[name]["embedding"], np.float32), emb.mean(0).numpy(),
                                   atol=1e-5, rtol=0)
    # The same command again: nothing left to do, nothing written twice.
    again = run_batch(BatchOptions(input="s3://photos/in/", output="s3://results/embed/", s3=s3,
                                   model=ModelConfig(str(tiny_ckpt), num_encoders=2), rows_per_file=16))
    assert (again.skipped, again.processed) == (len(rows), 0)
    assert _read_output("s3://results/embed/", s3).num_rows == len(rows)


def test_manifest_prompts_generate_matches_pipeline(tmp_path, pipe, tiny_ckpt, videos):
    from raypipe import SamplingParams

    folder = tmp_path / "images"
    images = {**_images(6, seed=3), "clip.mp4": videos["clips/a.mp4"]}
    for name, data in images.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    names = sorted(images)
    prompts = ["Describe this image.", "What colour dominates?", "Count the objects.", None, "Tag it.", "OCR?",
               "What happens?"]
    lines = [{"path": f"images/{name}", "key": f"k{i}", "question": p} for i, (name, p) in enumerate(zip(names, prompts))]
    lines.append({"path": "missing/nowhere.png", "key": "k-missing", "question": "?"})
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("\n".join(json.dumps(line) for line in lines))
    out = tmp_path / "out"
    summary = run_batch(BatchOptions(input=str(manifest), output=str(out), task="generate", max_tokens=6,
                                     prompt="Default prompt.", prompt_column="question", id_column="key",
                                     model=ModelConfig(str(tiny_ckpt), num_encoders=1), rows_per_file=4))
    rows = {r["id"]: r for r in _read_output(str(out), None).to_pylist()}
    assert sorted(rows) == sorted(line["key"] for line in lines) and summary.processed == len(lines)
    assert rows["k-missing"]["error"] == "unreadable_object" and rows["k-missing"]["text"] is None
    requests = [[{"role": "user", "content": [{"type": kind_of(name), kind_of(name): images[name]},
                                              {"type": "text", "text": p or "Default prompt."}]}]
                for name, p in zip(names, prompts)]
    expected = pipe.generate(requests, SamplingParams(max_tokens=6, temperature=0.0))
    for i, (name, out_ref) in enumerate(zip(names, expected)):
        row = rows[f"k{i}"]
        assert row["path"] == str(folder / name) and row["error"] is None
        assert row["prompt"] == prompts[i] and row["text"] == out_ref.text
        assert row["finish_reason"] == out_ref.finish_reason


def test_generate_with_a_json_schema_gives_valid_json(tmp_path, pipe, tiny_ckpt):
    import jsonschema

    from raypipe import SamplingParams
    from raypipe.testing.structured_schemas import SCHEMAS

    images = _images(4, seed=9)
    for name, data in images.items():
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_bytes(data)
    schema = SCHEMAS["nested"]
    run_batch(BatchOptions(input=str(tmp_path / "in"), output=str(tmp_path / "out"), task="generate", max_tokens=96,
                           json_schema=json.dumps(schema), model=ModelConfig(str(tiny_ckpt), num_encoders=1)))
    rows = {r["id"]: r for r in _read_output(str(tmp_path / "out"), None).to_pylist()}
    names = sorted(images)
    requests = [[{"role": "user", "content": [{"type": "image", "image": images[n]},
                                              {"type": "text", "text": "Describe this image."}]}] for n in names]
    expected = pipe.generate(requests, SamplingParams(max_tokens=96, structured={"json": schema}))
    for name, want in zip(names, expected):
        row = rows[name]
        assert row["error"] is None and row["text"] == want.text and want.finish_reason == "stop"
        jsonschema.validate(json.loads(row["text"]), schema)
    with pytest.raises(InvalidInput, match="not valid JSON"):
        BatchOptions(input="x", output="y", task="generate", json_schema="{nope")


def test_local_folders_and_pooling_none(tmp_path, pipe, tiny_ckpt):
    images = _images(5, seed=5)
    for name, data in images.items():
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_bytes(data)
    dry = run_batch(BatchOptions(input=str(tmp_path / "in"), output=str(tmp_path / "out"), dry_run=True,
                                 model=ModelConfig(str(tiny_ckpt), num_encoders=1)))
    assert (dry.inputs, dry.to_process, dry.processed) == (5, 5, 0) and not (tmp_path / "out").exists()
    run_batch(BatchOptions(input=str(tmp_path / "in"), output=str(tmp_path / "out"), pooling="none",
                           model=ModelConfig(str(tiny_ckpt), num_encoders=1)))
    rows = {r["id"]: r for r in _read_output(str(tmp_path / "out"), None).to_pylist()}
    names = sorted(images)
    for name, emb in zip(names, pipe.encode([images[n] for n in names])):
        np.testing.assert_allclose(np.asarray(rows[name]["embedding"], np.float32), emb.numpy(), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="different pooling"):  # same output, different job: refused
        run_batch(BatchOptions(input=str(tmp_path / "in"), output=str(tmp_path / "out"), pooling="mean",
                               model=ModelConfig(str(tiny_ckpt), num_encoders=1)))


@pytest.mark.extended  # the same job on `tiny`'s videos: test_embed_s3_to_s3_matches_pipeline
def test_minicpmv_slices_and_videos_local_folders_match_pipeline(tmp_path, three_worker_pipelines, minicpmv_ckpt):
    """A family whose images are several units (MiniCPM-V: overview + slices), and its videos (one above the 8 s
    main-frame cap), through the same batch job. A video's row is the mean of transformers'
    `get_video_features` over its frames, fed as transformers' own pyav reader gives them."""
    from transformers import MiniCPMV4_6ForConditionalGeneration

    from raypipe.models.registry import vision_adapter
    from tests import minicpmv_video_reference as vref
    from tests.test_serve_minicpmv import _all_frames, _encoded

    sizes = [(60, 50), (700, 700), (900, 200), (30, 400), (450, 460), (224, 224)]  # (height, width)
    adapter = vision_adapter(minicpmv_ckpt)
    assert sum(adapter.grid_for(h, w)[0] > 0 for h, w in sizes) >= 3  # several images are cut into slices
    videos = {"clip.mp4": _encoded(2.5, 8, 64, 96, seed=1),
              "sub/long.webm": _encoded(9, 4, 48, 64, seed=2, container="webm")}
    rows = _multi_unit_batch_matches_pipeline(tmp_path, "tiny-minicpmv", minicpmv_ckpt, sizes, three_worker_pipelines,
                                              videos)
    hf = MiniCPMV4_6ForConditionalGeneration.from_pretrained(minicpmv_ckpt).eval()
    with pytest.MonkeyPatch.context() as monkeypatch:
        vref.install(monkeypatch)  # transformers' video processor runnable here (torchvision stand-ins)
        processor = vref.processor(minicpmv_ckpt)
        for name, data in videos.items():
            frames, fps = _all_frames(data)
            processed = vref.preprocess(processor, frames, fps)
            with torch.no_grad():
                units = hf.model.get_video_features(processed["pixel_values_videos"][:1],
                                                    processed["target_sizes_videos"]).pooler_output
            want = torch.cat(units)
            row = rows[name]
            assert row["error"] is None and row["num_tokens"] == want.shape[0]
            np.testing.assert_allclose(np.asarray(row["embedding"], np.float32), want.mean(0).numpy(), atol=1e-5,
                                       rtol=0)


def test_qwen3_vl_rows_carry_deepstack_levels(tmp_path, three_worker_pipelines):
    """Qwen3-VL through the same batch job: a row's embedding is the merger's mean then each deepstack level's
    (the item's embedding columns, pooled), equal to `Pipeline`'s (itself checked against transformers)."""
    from raypipe.models.registry import preset_checkpoint, vision_adapter

    ckpt = preset_checkpoint("tiny-qwen3-vl")
    rows = _multi_unit_batch_matches_pipeline(tmp_path, "tiny-qwen3-vl", ckpt, [(60, 50), (300, 290), (40, 170)],
                                              three_worker_pipelines)
    adapter = vision_adapter(ckpt)
    assert {len(row["embedding"]) for row in rows.values()} == {adapter.vision_config.out_hidden_size * 3}


def _multi_unit_batch_matches_pipeline(tmp_path, preset, ckpt, sizes, pipelines, videos: dict | None = None):
    """The job's image rows equal `Pipeline.encode`'s embeddings, over one of the session's workers of `ckpt`
    (`pipelines`: conftest's `three_worker_pipelines`); `videos` (name -> bytes) go in the same folder, each
    written once without an error (their values are the caller's to check). Every row, by id."""
    videos = videos or {}
    rng = np.random.default_rng(4)
    images = {f"{'sub/' if i % 2 else ''}img{i}.{'png' if i % 3 else 'jpg'}":
              _encode(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "PNG" if i % 3 else "JPEG")
              for i, (h, w) in enumerate(sizes)}
    for name, data in {**images, **videos}.items():
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_bytes(data)
    summary = run_batch(BatchOptions(input=str(tmp_path / "in"), output=str(tmp_path / "out"), read_batch=3,
                                     rows_per_file=2, model=ModelConfig(preset, num_encoders=1)))
    table = _read_output(str(tmp_path / "out"), None)
    rows = {r["id"]: r for r in table.to_pylist()}
    assert sorted(rows) == sorted([*images, *videos]) and table.num_rows == len(rows)  # every input exactly once
    assert summary.processed == len(rows) and not summary.errors
    names = sorted(images)
    reference = over_first_workers(pipelines.get(ckpt), 1, cache_bytes=0).encode([images[n] for n in names])
    for name, emb in zip(names, reference):
        row = rows[name]
        assert row["error"] is None and row["model"] == preset
        assert (row["width"], row["height"]) == Image.open(io.BytesIO(images[name])).size
        assert row["num_tokens"] == emb.shape[0]
        np.testing.assert_allclose(np.asarray(row["embedding"], np.float32), emb.float().mean(0).numpy(),
                                   atol=1e-5, rtol=0)
    return rows


def test_kill_driver_and_resume_exactly_once(photos, videos, s3, env, tiny_ckpt, ray_local):
    """`raypipe batch` killed with its Ray mid-job (like a preempted node), then the same job again carries
    on: every input in the output exactly once. The re-run is `run_batch` with the options the command
    parses (the CLI's own runs to the end are `test_model_from_s3`'s), on this module's warm Ray: a second
    cold command cost ~50 s on 2 cores for no more proof, the killed run's state being only its part files."""
    out = "s3://results/killed/"
    args = ["--model", str(tiny_ckpt), "--input", "s3://photos/in/", "--output", out, "--rows-per-file", "2",
            "--batching", "count", "--batch-images", "1", "--read-batch", "2", "--json"]
    first = _batch_cli(args, env)
    fs, root = open_filesystem(out, s3)
    deadline = time.monotonic() + 600  # Ray start-up and model load first; the loop ends at the 2nd part
    while time.monotonic() < deadline and first.poll() is None:
        if len([i for i in list_files(fs, root) if i.base_name.startswith("part-")]) >= 2:
            break
        time.sleep(0.1)
    assert first.poll() is None, f"the job ended before it could be killed: {first.communicate()}"
    os.killpg(first.pid, signal.SIGKILL)  # driver and the Ray it started: like a preempted node
    first.wait()
    before = _read_output(out, s3)
    assert before is not None, "killed before any part file was written"
    done_before = before.num_rows
    total = len(photos) + len(videos) + len(BAD_FILES)
    assert 0 < done_before < total
    again = options_from_args(build_parser().parse_args(["batch", *args]))
    summary = run_batch(dataclasses.replace(again, s3=s3)).as_dict()  # s3: the keys `env` gives the command
    # >=: write tasks of the killed run may finish a part after we looked.
    assert done_before <= summary["skipped"] < total
    assert summary["processed"] == total - summary["skipped"]
    assert summary["rows_written"] == total - summary["skipped"]  # the re-run wrote only the rest
    assert summary["duplicates_removed"] == 0
    ids = _read_output(out, s3).column("id").to_pylist()
    assert len(ids) == len(set(ids)) == total  # every input exactly once


def test_encoder_actor_killed_mid_job(tmp_path, tiny_ckpt, ray_local):
    from ray._private.state import actors  # the GCS actor table; the state API needs the dashboard

    def encoders():
        return [a for a in actors().values() if a["ActorClassName"] == "MapWorker(MapBatches(EncodeStage))"
                and a["State"] == "ALIVE" and a["Pid"]]

    images = _images(30, seed=9)
    for name, data in images.items():
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_bytes(data)
    options = BatchOptions(input=str(tmp_path / "in"), output=str(tmp_path / "out"), batching="count",
                           batch_images=1, read_batch=2, rows_per_file=2, model=ModelConfig(str(tiny_ckpt)))
    before = {a["ActorID"] for a in encoders()}
    result = {}
    job = threading.Thread(target=lambda: result.update(summary=run_batch(options)))
    job.start()
    killed = None
    deadline = time.monotonic() + 300
    while killed is None and time.monotonic() < deadline and job.is_alive():
        written = len(list((tmp_path / "out").glob("part-*.parquet"))) if (tmp_path / "out").exists() else 0
        alive = [a for a in encoders() if a["ActorID"] not in before]
        if written >= 1 and alive:
            os.kill(alive[0]["Pid"], signal.SIGKILL)
            killed = alive[0]
        time.sleep(0.05)
    assert killed is not None, "no encoder actor was killed while the job ran"
    written_at_kill = len(list((tmp_path / "out").glob("part-*.parquet")))
    job.join(timeout=300)
    assert not job.is_alive()
    assert written_at_kill < len(images) // 2  # the kill came part-way (2 rows per file)
    ids = _read_output(str(tmp_path / "out"), None).column("id").to_pylist()
    assert sorted(ids) == sorted(images) and result["summary"].processed == len(images)


def test_model_from_s3(photos, s3, env, tiny_ckpt, tmp_path, pipe):
    _put(s3, "s3://models/checkpoints/tiny", {p.name: p.read_bytes() for p in pathlib.Path(tiny_ckpt).iterdir()
                                               if p.is_file()})
    cache = tmp_path / "cache"
    args = ["--model", "s3://models/checkpoints/tiny/", "--input", "s3://photos/in/sub/", "--output",
            "s3://results/s3model/", "--json"]
    # Without RAY_AUTH_MODE (which the session's own Ray exported), as a user's shell starts it: a new Ray.
    fresh = {key: value for key, value in env.items() if key != "RAY_AUTH_MODE"}
    run = subprocess.run([sys.executable, "-m", "raypipe.cli", "batch", *args], capture_output=True, text=True,
                         env={**fresh, "RAYPIPE_CACHE": str(cache)}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    # Issue 44: no token-authentication notice, no Ray Data progress bars, plans or timings, no deprecation warning.
    for noise in ("Token authentication", "Progress bars", "Execution plan", "execution finished", "Deprecation"):
        assert noise not in run.stderr, run.stderr
    copies = [p for p in (cache / "models").iterdir() if p.is_dir()]
    assert len(copies) == 1 and (copies[0] / ".raypipe-remote.json").is_file()  # one copy on this node
    assert (copies[0] / "model.safetensors").read_bytes() == (pathlib.Path(tiny_ckpt) / "model.safetensors").read_bytes()
    rows = {"sub/" + r["id"]: r for r in _read_output("s3://results/s3model/", s3).to_pylist()}
    names = sorted(n for n in photos if n.startswith("sub/"))
    assert sorted(rows) == names
    for name, emb in zip(names, pipe.encode([photos[n] for n in names])):
        assert rows[name]["model"] == "s3://models/checkpoints/tiny/"
        np.testing.assert_allclose(rows[name]["embedding"], emb.float().mean(0).numpy(), atol=1e-5, rtol=0)


def test_fetch_model_copies_once_and_repairs(s3, tiny_ckpt, tmp_path, monkeypatch):
    from raypipe.models.remote import MANIFEST, fetch_model

    monkeypatch.setenv("RAYPIPE_CACHE", str(tmp_path))
    source = {p.name: p.read_bytes() for p in pathlib.Path(tiny_ckpt).iterdir() if p.is_file()}
    _put(s3, "s3://models/fetch/tiny", source)
    folder = fetch_model("s3://models/fetch/tiny/", s3)
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name != MANIFEST} == source
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert fetch_model("s3://models/fetch/tiny", s3) == folder  # reused: no second copy
    assert (folder / "config.json").stat().st_mtime_ns == stamp
    (folder / "model.safetensors").write_bytes(b"truncated")  # a damaged copy is detected and replaced
    assert fetch_model("s3://models/fetch/tiny/", s3) == folder
    assert (folder / "model.safetensors").read_bytes() == source["model.safetensors"]
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_a_lost_pool_actor_is_retried_around_exactly_once(tmp_path, pipe, tiny_ckpt, monkeypatch):
    """Ray Data may give up on a pool actor (Ray 2.60 fails a dataset on the first one that dies while
    starting, e.g. on a preempted node): the job carries on with what is not yet written."""
    from raypipe.batch import job

    images = _images(6, seed=7)
    for name, data in images.items():
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_bytes(data)
    real, calls = job._dataset, []

    class DiesAfterTwoRows:  # the first attempt: two inputs' rows written, then an actor is lost
        def __init__(self, dataset):
            self.dataset = dataset

        def iter_batches(self, **kwargs):
            yield from self.dataset.iter_batches(**kwargs)
            raise ray.exceptions.ActorDiedError()

    def dataset(options, todo, *rest):  # rest: the address, checkpoint and adapters, passed on
        calls.append(todo.num_rows)
        if len(calls) == 1:
            return DiesAfterTwoRows(real(options, todo.slice(0, 2), *rest))
        return real(options, todo, *rest)

    monkeypatch.setattr(job, "_dataset", dataset)
    summary = run_batch(BatchOptions(input=str(tmp_path / "in"), output=str(tmp_path / "out"), read_batch=2,
                                     rows_per_file=2, model=ModelConfig(str(tiny_ckpt), num_encoders=1)))
    assert calls == [6, 4]  # the second attempt ran only the inputs the first had not written
    table = _read_output(str(tmp_path / "out"), None)
    assert sorted(table.column("id").to_pylist()) == sorted(images)  # every input exactly once
    assert summary.processed == len(images)
    names = sorted(images)
    rows = {r["id"]: r for r in table.to_pylist()}
    for name, emb in zip(names, pipe.encode([images[n] for n in names])):
        np.testing.assert_allclose(np.asarray(rows[name]["embedding"], np.float32), emb.mean(0).numpy(),
                                   atol=1e-5, rtol=0)
