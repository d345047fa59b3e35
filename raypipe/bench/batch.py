"""`raypipe bench batch`: images/s of `raypipe batch --task embed` against a naive Ray Data job.

One run, one Ray, the same mixed-size images (thumbnails to 4K screenshots; PNG and JPEG) from a
local folder and from S3 on loopback (moto):

- naive baseline: `read_binary_files` -> `map_batches` with transformers' vision tower and image
  processor (decode inside the actor, fixed batch of 8 images, torch's default threads) on the
  same number of actors -> `write_parquet`;
- `raypipe batch` with 2 encoders and cost-budget batches, with 1 encoder, and with 2 encoders and
  fixed-count batches (8 images).

Each job is timed from building the dataset to its last file written, actor start-up included
(for both). The pooled embeddings of the baseline and raypipe are compared, so the speed is for the
same output. The `small` preset (realistic shape, random weights) unless --model says otherwise.

Wall times on a machine shared with other work say little; so the CPU work per image of each job's
stages is also measured, in one process with one torch thread (`_cpu_work`). On a CPU-only
machine, where decoding and encoding share the same cores, the ratio of those CPU seconds bounds
how much faster raypipe's job can be than the baseline's.
"""

from __future__ import annotations

import io
import logging
import os
import pathlib
import tempfile
import time

import numpy as np

from raypipe.bench.common import print_table, write_json
from raypipe.bench.encode import heavy_tailed_sizes
from raypipe.testing.sample_images import sample_image

NAIVE_BATCH = 8


class NaiveVisionEncoder:
    """What one writes without raypipe: decode, process and encode inside one actor, fixed batches."""

    def __init__(self, checkpoint: str):
        import torch
        from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
        self.visual = model.model.visual
        self.merge = model.config.vision_config.spatial_merge_size
        self.processor = AutoImageProcessor.from_pretrained(checkpoint)

    def __call__(self, batch: dict) -> dict:
        import torch
        from PIL import Image

        images = [np.asarray(Image.open(io.BytesIO(data)).convert("RGB")) for data in batch["bytes"]]
        processed = self.processor(images=images, return_tensors="pt")
        grid = processed["image_grid_thw"]
        with torch.inference_mode():
            out = self.visual(processed["pixel_values"], grid_thw=grid).pooler_output
        pooled = [chunk.mean(0).numpy() for chunk in torch.split(out, (grid.prod(-1) // self.merge**2).tolist())]
        return {"path": batch["path"], "embedding": np.stack(pooled)}


def _cpu_work(checkpoint: str, folder: str) -> dict[str, float]:
    """CPU seconds for every image in `folder`: the baseline's actor (decode, process, encode in batches
    of NAIVE_BATCH) and raypipe's two stages (decode+resize+pack; encode), one torch thread each."""
    import torch

    from raypipe.batch import BatchOptions, stages
    from raypipe.batch.inputs import list_inputs
    from raypipe.config import ImageLimits, ModelConfig
    from raypipe.inputs.video import VideoLimits

    torch.set_num_threads(1)
    todo = list_inputs(folder)
    uris = todo.column("uri").to_pylist()
    data = [pathlib.Path(uri).read_bytes() for uri in uris]
    naive = NaiveVisionEncoder(checkpoint)
    naive({"bytes": data[:NAIVE_BATCH], "path": uris[:NAIVE_BATCH]})  # warm-up (first calls into torch), untimed
    start = time.process_time()
    for i in range(0, len(data), NAIVE_BATCH):
        naive({"bytes": data[i:i + NAIVE_BATCH], "path": uris[i:i + NAIVE_BATCH]})
    naive_s = time.process_time() - start
    # The options the timed raypipe jobs run with.
    options = BatchOptions(input=folder, output="", batch_images=NAIVE_BATCH, model=ModelConfig(checkpoint))
    encoder = stages.EncodeStage(checkpoint, options.model.dtype, num_threads=1, budgets=options.model.encoder_budgets)
    cost_model = options.model.cost_model
    budget = options.batch_cost * stages.max_image_cost(checkpoint, cost_model)
    start = time.process_time()
    packs = [stages.read_and_pack(todo.slice(i, options.read_batch), model=checkpoint, image_limits=ImageLimits(),
                                  video_limits=VideoLimits(), s3=None, cost_model=cost_model, budget=budget,
                                  per_pack=options.batch_images)
             for i in range(0, todo.num_rows, options.read_batch)]
    decode_s = time.process_time() - start
    start = time.process_time()
    for table in packs:
        for k in range(table.num_rows):
            encoder(table.slice(k, 1))
    return {"naive": naive_s, "raypipe_decode": decode_s, "raypipe_encode": time.process_time() - start}


def _write_images(folder: pathlib.Path, sizes) -> list[str]:
    from PIL import Image

    names = []
    for i, (h, w) in enumerate(sizes):
        fmt, ext = ("JPEG", "jpg") if i % 2 else ("PNG", "png")
        name = f"{'docs/' if h * w > 2_000_000 else ''}img{i:04d}.{ext}"
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(sample_image(h, w, seed=i)).save(folder / name, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        names.append(name)
    return names


def _upload(folder: pathlib.Path, s3, uri: str) -> None:
    from raypipe.storage import open_filesystem

    fs, root = open_filesystem(uri, s3)
    for path in folder.rglob("*"):
        if path.is_file():
            with fs.open_output_stream(f"{root}/{path.relative_to(folder)}") as out:
                out.write(path.read_bytes())


def _naive(checkpoint: str, input_uri: str, output_uri: str, s3, workers: int) -> float:
    import ray

    from raypipe.storage import open_filesystem

    fs, root = open_filesystem(input_uri, s3)
    out_fs, out_root = open_filesystem(output_uri, s3)
    start = time.perf_counter()
    ds = ray.data.read_binary_files(root, filesystem=fs, include_paths=True)
    ds = ds.map_batches(NaiveVisionEncoder, fn_constructor_kwargs={"checkpoint": checkpoint}, batch_size=NAIVE_BATCH,
                        compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=0)
    ds.write_parquet(out_root, filesystem=out_fs)
    return time.perf_counter() - start


def _read_embeddings(uri: str, s3, key: str) -> dict[str, np.ndarray]:
    import pyarrow.parquet as pq

    from raypipe.storage import list_files, open_filesystem

    fs, root = open_filesystem(uri, s3)
    rows = {}
    for info in list_files(fs, root, recursive=False):
        if info.base_name.endswith(".parquet"):
            for row in pq.read_table(info.path, filesystem=fs).to_pylist():
                if row.get("embedding") is not None:
                    rows[os.path.basename(row[key])] = np.asarray(row["embedding"], np.float32)
    return rows


def main(args) -> int:
    import pyarrow.fs as pafs
    from moto.server import ThreadedMotoServer

    from raypipe.batch import BatchOptions, run_batch
    from raypipe.config import ModelConfig
    from raypipe.models.registry import resolve_model
    from raypipe.runtime.ray_cluster import connect_ray
    from raypipe.storage import S3Options

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    model = getattr(args, "model", None) or "small"
    checkpoint = str(resolve_model(model))
    count = 200 if args.quick else 400
    sizes = heavy_tailed_sizes(count, seed=7)
    if args.quick:  # the same mix at 1/16 of the pixels: a smoke run on a busy 2-core machine
        sizes = [(max(28, h // 4), max(28, w // 4)) for h, w in sizes]
    work = pathlib.Path(tempfile.mkdtemp(prefix="raypipe-bench-batch-"))
    _write_images(work / "in", sizes)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = S3Options(endpoint_url=f"http://{host}:{port}", region="us-east-1", access_key="bench", secret_key="bench")
    pafs.S3FileSystem(endpoint_override=f"{host}:{port}", scheme="http", region="us-east-1", access_key="bench",
                      secret_key="bench", allow_bucket_creation=True).create_dir("bench")
    _upload(work / "in", s3, "s3://bench/in")
    connect_ray()

    def raypipe_run(input_uri: str, output_uri: str, encoders: int, batching: str) -> float:
        summary = run_batch(BatchOptions(input=input_uri, output=output_uri, s3=s3, batching=batching,
                                         batch_images=NAIVE_BATCH, model=ModelConfig(checkpoint, num_encoders=encoders)))
        assert summary.processed == count and not summary.errors, summary
        return summary.seconds

    runs = [  # (name, storage, workers, run)
        ("naive Ray Data (fixed 8)", "local", 2, lambda: _naive(checkpoint, str(work / "in"), str(work / "naive"), s3, 2)),
        ("raypipe batch (cost)", "local", 2, lambda: raypipe_run(str(work / "in"), str(work / "rp2"), 2, "cost")),
        ("raypipe batch (count 8)", "local", 2, lambda: raypipe_run(str(work / "in"), str(work / "rp2c"), 2, "count")),
        ("raypipe batch (cost)", "local", 1, lambda: raypipe_run(str(work / "in"), str(work / "rp1"), 1, "cost")),
        ("raypipe batch (cost)", "s3", 2, lambda: raypipe_run("s3://bench/in", "s3://bench/rp2", 2, "cost")),
    ]
    if not args.quick:
        runs.append(("naive Ray Data (fixed 8)", "s3", 2,
                     lambda: _naive(checkpoint, "s3://bench/in", "s3://bench/naive", s3, 2)))
    results = []
    for name, storage, workers, run in runs:
        seconds = run()
        results.append({"job": name, "storage": storage, "workers": workers, "seconds": seconds,
                        "images_per_s": count / seconds})
        print(f"  {name} [{storage}, {workers} workers]: {seconds:.1f} s", flush=True)
    server.stop()
    import ray

    # Its own process: EncodeStage renices the process it runs in.
    cpu = ray.get(ray.remote(num_cpus=0)(_cpu_work).remote(checkpoint, str(work / "in")))
    cpu_rows = [["naive actor: decode + process + encode", cpu["naive"]],
                ["raypipe: decode, resize, pack (CPU tasks)", cpu["raypipe_decode"]],
                ["raypipe: encode (actors)", cpu["raypipe_encode"]],
                ["raypipe: total", cpu["raypipe_decode"] + cpu["raypipe_encode"]]]
    naive = _read_embeddings(str(work / "naive"), None, "path")
    ours = _read_embeddings(str(work / "rp2"), None, "path")
    max_diff = max(float(np.abs(naive[k] - ours[k]).max()) for k in ours)

    def rate(job, storage, workers):
        return next(r["images_per_s"] for r in results if (r["job"], r["storage"], r["workers"]) == (job, storage, workers))

    ratios = {
        "raypipe(cost, 2) / naive(2), local": rate("raypipe batch (cost)", "local", 2) / rate("naive Ray Data (fixed 8)", "local", 2),
        "raypipe 2 workers / 1 worker (cost), local": rate("raypipe batch (cost)", "local", 2) / rate("raypipe batch (cost)", "local", 1),
        "cost-budget / fixed-count batches (2 workers), local": rate("raypipe batch (cost)", "local", 2) / rate("raypipe batch (count 8)", "local", 2),
    }
    if not args.quick:
        ratios["raypipe(cost, 2) / naive(2), s3"] = (rate("raypipe batch (cost)", "s3", 2)
                                                     / rate("naive Ray Data (fixed 8)", "s3", 2))
    ratios["naive CPU s / raypipe CPU s (one thread, in-process)"] = cpu["naive"] / cpu_rows[-1][1]
    result = {"model": model, "images": count, "quick": bool(args.quick), "cpus": os.cpu_count(), "runs": results,
              "ratios": ratios, "cpu_seconds": cpu, "max_abs_diff_pooled_embedding_vs_naive": max_diff}
    if args.json:
        import json

        print(json.dumps(result, indent=2))
    else:
        print_table(f"raypipe bench batch: {count} mixed-size images, model {model!r}, {os.cpu_count()} CPUs "
                    "(job time incl. actor start-up)", ["job", "storage", "workers", "seconds", "images/s"],
                    [[r["job"], r["storage"], r["workers"], r["seconds"], r["images_per_s"]] for r in results])
        print_table(f"CPU seconds for the {count} images, one process, one torch thread (independent of other load)",
                    ["work", "CPU s", "ms/image"], [[name, sec, 1000 * sec / count] for name, sec in cpu_rows])
        print_table("ratios (images/s; last: CPU work)", ["comparison", "ratio"], [[k, v] for k, v in ratios.items()])
        print(f"\nsame output: max |pooled embedding (raypipe) - (naive)| = {max_diff:.2e}")
    write_json(args.out, "batch", result)
    return 0
