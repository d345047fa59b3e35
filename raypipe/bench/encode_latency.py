"""`raypipe bench encode --latency` (also section (d) of `raypipe bench encode`): per-request latency of
encoding new images, where an image is several units of work (MiniCPM-V slices, LLaVA-OneVision tiles,
Step3 crops) that are joined after encoding.

One `Pipeline` with the default encoder setup; requests go one after another, each a few images never
seen before (every one a cache miss), with a pause between requests longer than Ray keeps an idle task
worker (so whatever a request needs that an idle process held must be there again, or be started).
The first request after start-up is reported apart (cold); p50 / p99 are over the rest. The Ray worker
processes started while the requests ran are counted from the raylet's children: a request path that
starts processes (a join in a Ray task did: each start imports torch) shows there and in the p99.

Uses only `Pipeline.from_pretrained(...)`, `Pipeline.encode(images)` and `worker_info()`, so the same file
measures an older raypipe too.
"""

from __future__ import annotations

import time

import numpy as np

from raypipe.bench.common import emit, print_table
from raypipe.testing.node_processes import live_children, parent_pid
from raypipe.testing.sample_images import sample_image

# Photos and screenshots: each is several units in the sliced / tiled families.
SIZES = [(480, 640), (640, 480), (720, 1280), (600, 800)]
IMAGES_PER_REQUEST = 2  # default; --images 10 is the "batches of 8-12 new images"
DEFAULT_REQUESTS, QUICK_REQUESTS = 60, 8
ARRIVAL_GAP_S = 1.5  # > Ray's idle_worker_killing_time_threshold_ms (1 s)


def measure(model: str, requests: int, images_per_request: int = IMAGES_PER_REQUEST) -> dict:
    """Cold first request, then `requests` timed ones of `images_per_request` images; seconds each, and
    worker processes started."""
    from raypipe.inputs.images import load_images
    from raypipe.pipeline import Pipeline

    seconds, started = [], set()
    with Pipeline.from_pretrained(model) as pipe:
        adapter = pipe.coordinator.adapter
        units = {size: len(adapter.units(adapter.make_item(adapter.resize_for_tower(decoded))))
                 for size, decoded in zip(SIZES, load_images([sample_image(*size, seed=0) for size in SIZES]))}
        raylet = parent_pid(pipe.worker_info()[0]["pid"])  # the raylet starts every worker process
        before = live_children(raylet)
        for r in range(requests + 1):
            sizes = [SIZES[(r + i) % len(SIZES)] for i in range(images_per_request)]
            images = [sample_image(*size, seed=1000 * r + i) for i, size in enumerate(sizes)]  # never seen
            start = time.perf_counter()
            pipe.encode(images)
            seconds.append(time.perf_counter() - start)
            started |= live_children(raylet) - before
            time.sleep(ARRIVAL_GAP_S)
    warm = np.array(seconds[1:])
    return {"model": model, "requests": requests, "images_per_request": images_per_request,
            "units_per_request": images_per_request * float(np.mean(list(units.values()))),
            "arrival_gap_s": ARRIVAL_GAP_S, "first_s": seconds[0], "p50_s": float(np.percentile(warm, 50)),
            "p99_s": float(np.percentile(warm, 99)), "max_s": float(warm.max()), "seconds": seconds,
            "processes_started": len(started)}


def describe(result: dict, label: str = "") -> None:
    print_table(f"{label}per-request encode latency, {result['images_per_request']} new images a request "
                f"(~{result['units_per_request']:.0f} units), {result['arrival_gap_s']} s between requests",
                ["model", "requests", "first s", "p50 s", "p99 s", "max s", "processes started"],
                [[result["model"], result["requests"], result["first_s"], result["p50_s"], result["p99_s"],
                  result["max_s"], result["processes_started"]]])


def main(args) -> int:
    from raypipe.runtime.ray_cluster import connect_ray

    connect_ray()
    requests = args.requests or (QUICK_REQUESTS if args.quick else DEFAULT_REQUESTS)
    model = getattr(args, "model", None) or "small-llava-ov"  # a family of several units
    result = measure(model, requests, getattr(args, "images", None) or IMAGES_PER_REQUEST)
    return emit(args, "encode_latency", result, lambda r, out: (describe(r), print(f"results: {out}")))
