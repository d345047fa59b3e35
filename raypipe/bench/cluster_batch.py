"""`raypipe bench cluster-batch`: a batch job's encoder pool grows onto GPU nodes the autoscaler starts.

One run: a fake cluster (`fake_cluster.FakeCluster`: a CPU head with no GPUs, a 1-GPU node type with
max 3) runs `raypipe batch --task embed --num-encoders 1:3 --encoder-gpus 1` over a folder of images
(every fake node shares this machine's disk, as a shared volume would). Then:

1. the first encoder actor's GPU request brings up the first GPU node;
2. while inputs queue up, Ray Data's cluster autoscaler asks for more, the autoscaler starts
   nodes, and the pool adds encoder actors on them (each holds one node's only GPU);
3. when the job is done the pool shrinks to nothing and the idle nodes go away.

A thread samples GPU nodes and the encoder actors alive (from the GCS actor table) and records
when each count first changed. The fake GPU nodes declare no CPU, like the Serve bench's: every fake
node shares this machine's two cores, and with one CPU each Ray Data also ran read tasks on them, whose
worker processes' imports starved the encoder actor's start (a CPU encoder runs niced): the first
encoder came up after 117 s instead of 28 s. Real GPU instances have CPUs of their own.

What paces growth (Ray 2.60): the pool adds an actor when its tasks in flight reach 1.75 per actor
and its resource budget has room; the budget is what Ray Data's autoscaling coordinator reserved
from the nodes it saw at its last refresh (every 20 s); the cluster autoscaler asks for more nodes
every 10 s. Here both run every 2 s (`RAY_DATA_ENV`, `start_coordinator`), as the Serve bench
shortens Serve's delays, so the job needs work enough to outlast a node start and a second actor's
model load, not 30 s of fixed delays: 720 images at the tiny preset's largest size (with 360 the second
encoder came up 2-3 s before the job ended).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import statistics
import time

from raypipe.bench.common import Sampler, gpu_nodes, print_table, write_json
from raypipe.testing.fake_cluster import FakeCluster, run_as_driver

GPU_NODE_TYPE = {"gpu_1x": {"resources": {"CPU": 0, "GPU": 1}, "max_workers": 3}}
ENCODERS = (1, 3)  # the pool's min and max: it must grow to show anything
QUICK_ENCODERS = (1, 2)  # `--quick` (the CI test's run): growing to 2 shows the same at a node and a model load less
# Ray Data asks the cluster for resources at most every 10 s by default; 2 s fits a few minutes.
RAY_DATA_ENV = {"RAY_DATA_MIN_GAP_BETWEEN_AUTOSCALING_REQUESTS": "2"}
ENCODER_ACTOR = "MapWorker(MapBatches(EncodeStage))"  # how Ray Data names the pool's actors
COORDINATOR_REFRESH_S = 2
IMAGES = 720
SIDE = 448  # the tiny preset's largest image (longest_edge 200704 px): the most encoder work per decoded pixel


def write_images(folder: pathlib.Path, count: int, side: int = SIDE, seed: int = 0) -> list[str]:
    """`count` distinct PNGs (smooth patterns: small files, a full tower's work each); their names."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:side, 0:side]
    names = []
    for i in range(count):
        a, b, c = rng.integers(1, 9, 3)
        pixels = np.stack([(x * a + y) % 256, (y * b + i) % 256, (x + y * c) % 256], -1).astype("uint8")
        names.append(f"img{i:04d}.png")
        Image.fromarray(pixels).save(folder / names[-1])
    return names


class PoolTimeline(Sampler):
    """Samples GPU nodes and the encoder actors alive (actor id -> node id) in a thread."""

    def sample(self) -> tuple[int, dict[str, str]]:
        from ray._private.state import actors  # the GCS actor table; the state API needs the dashboard

        return gpu_nodes(), {a["ActorID"]: a["Address"]["NodeID"] for a in actors().values()
                             if a["ActorClassName"] == ENCODER_ACTOR and a["State"] == "ALIVE"}


def start_coordinator(refresh_s: float) -> None:
    """Start Ray Data's autoscaling coordinator (a named actor every job on the cluster shares)
    with its view of the nodes refreshed every `refresh_s` instead of its fixed 20 s.

    The coordinator class is private to Ray Data (Ray 2.60): this is the bench's only reach inside
    it. Ray Data's own `get_or_create` starts the subclass under the name it later looks up."""
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as coordinator

    base = coordinator._AutoscalingCoordinatorActor

    class RefreshingCoordinator(base):
        TICK_INTERVAL_S = refresh_s

    coordinator._AutoscalingCoordinatorActor = RefreshingCoordinator
    try:
        coordinator.get_or_create_autoscaling_coordinator()
    finally:
        coordinator._AutoscalingCoordinatorActor = base


def run_cycle(work: pathlib.Path, images: int = IMAGES, encoders: tuple[int, int] = ENCODERS,
              scale_down_timeout_s: float = 120.0, log=print) -> dict:
    """One batch job on a fresh fake cluster; inputs in `work/in`, Parquet in `work/out`; times in seconds."""
    for key, value in RAY_DATA_ENV.items():
        os.environ.setdefault(key, value)  # read when ray.data is imported: not yet, in a fresh process
    import ray

    from raypipe.batch import BatchOptions, run_batch
    from raypipe.config import ModelConfig
    from raypipe.models.registry import resolve_model

    shutil.rmtree(work, ignore_errors=True)
    write_images(work / "in", images)
    model = str(resolve_model("tiny"))  # written once here; every fake node shares this machine's disk
    options = BatchOptions(input=str(work / "in"), output=str(work / "out"), batching="count", batch_images=1,
                           read_batch=4, rows_per_file=16,
                           model=ModelConfig(model, num_encoders=encoders[0], max_encoders=encoders[1],
                                             encoder_gpus=1))
    result = {"images": images, "encoders": list(encoders)}
    with FakeCluster(GPU_NODE_TYPE, head_resources={"CPU": 2}) as cluster:
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
        start_coordinator(COORDINATOR_REFRESH_S)
        timeline = PoolTimeline().start()
        try:
            start = time.monotonic()
            summary = run_batch(options, ray_address=cluster.address)
            end = time.monotonic()
            result["job_s"] = end - start
            result["summary"] = summary.as_dict()
            result["first_gpu_node_s"] = timeline.first(lambda n, e: n >= 1, start)
            result["first_encoder_s"] = timeline.first(lambda n, e: len(e) >= 1, start)
            result["second_encoder_s"] = timeline.first(lambda n, e: len(e) >= 2, start)
            result["max_encoders_alive"] = max((len(e) for _, _, e in timeline.samples), default=0)
            result["max_gpu_nodes"] = max((n for _, n, _ in timeline.samples), default=0)
            result["gpu_node_s"] = [timeline.first(lambda n, e, k=k: n >= k, start)
                                    for k in range(1, result["max_gpu_nodes"] + 1)]  # when the k-th came up
            # every (actor, node) seen alive while the job ran; several alive at once on distinct nodes
            # is what "the pool spread onto new nodes" means
            result["encoder_nodes"] = sorted({node for at, _, e in timeline.samples if at <= end for node in e.values()})
            result["max_encoder_nodes_at_once"] = max(
                (len(set(e.values())) for at, _, e in timeline.samples if at <= end), default=0)
            log(f"job: {summary.describe()}")
            log(f"encoders alive: 1st after {result['first_encoder_s']} s, 2nd after {result['second_encoder_s']} s; "
                f"at most {result['max_encoders_alive']} at once on {result['max_encoder_nodes_at_once']} nodes; "
                f"GPU nodes at most {result['max_gpu_nodes']}")
            deadline = end + scale_down_timeout_s
            while time.monotonic() < deadline and timeline.samples[-1][1] > 0:
                time.sleep(0.5)
            result["scale_down_s"] = timeline.first(lambda n, e: n == 0, end)
            log(f"GPU nodes gone {result['scale_down_s']} s after the job")
        finally:
            timeline.stop()
            ray.shutdown()
    return result


def main(args) -> int:
    run_as_driver()
    runs = 1 if args.quick else 3
    encoders = QUICK_ENCODERS if args.quick else ENCODERS
    results = [run_cycle(pathlib.Path(args.out) / "cluster-batch" / f"run{i}", encoders=encoders) for i in range(runs)]
    keys = ["first_gpu_node_s", "first_encoder_s", "second_encoder_s", "job_s", "scale_down_s"]
    medians = {k: statistics.median(r[k] for r in results) if all(r[k] is not None for r in results) else None
               for k in keys}
    summary = {"runs": results, "median": medians}
    if args.json:
        import json

        print(json.dumps(summary, indent=2))
    else:
        print_table(f"Batch job on a fake cluster ({runs} runs; {IMAGES} images, encoder pool "
                    f"{encoders[0]}:{encoders[1]}, 1-GPU nodes from 0; shared 2-core machine)",
                    ["measure", "median s", "runs"],
                    [[k, medians[k], ", ".join(f"{r[k]:.1f}" if r[k] is not None else "-" for r in results)]
                     for k in keys])
        print("\nencoders alive at once (max): " + ", ".join(str(r["max_encoders_alive"]) for r in results))
    write_json(args.out, "cluster_batch", summary)
    grew = all(r["max_encoder_nodes_at_once"] >= 2 for r in results)
    return 0 if grew else 1
