"""`raypipe bench cluster`: Serve autoscaling on a fake multi-node cluster, timed and failure-counted.

One run: a fake cluster (`fake_cluster.FakeCluster`: a CPU head with no GPUs, a 1-GPU node type
with max 4) gets the GPU-cluster Serve config that KubeRay and cluster.yaml deploy
(`raypipe.serve.kuberay.gpu_serve_config`, i.e. deployments/config.yaml with GPU requests),
with replica targets and delays scaled down to fit a 2-core machine and a few minutes. Then:

1. deploy: the GPU requests of the first EncoderGroup's worker and Decoder bring up GPU nodes;
2. high load (concurrent clients, bounded in time): Serve adds replicas, their GPU requests bring
   up more nodes, until every deployment is at its maximum;
3. low load (one client pausing after each answer): Serve removes replicas, the autoscaler
   removes the idle nodes.

`--quick` (one run; the CI test's cycle) keeps one EncoderGroup replica and scales the Decoder alone:
2 -> 3 -> 2 GPU nodes instead of 2 -> 4 -> 2.

Every request goes through the official `openai` client (no retries) to 127.0.0.1 and is counted
as ok or failed; failed requests must stay at zero through scale-up and scale-down. Fake GPU
nodes declare no CPUs and coordinators get a CPU share, so CPU-side replicas (Ingress,
EncoderGroup coordinators) live on the head and each GPU node holds exactly one GPU actor: node
counts follow replica counts.
"""

from __future__ import annotations

import asyncio
import base64
import io
import statistics
import threading
import time

from raypipe.bench.common import Sampler, gpu_nodes, print_table, write_json
from raypipe.testing.fake_cluster import FakeCluster, free_port, run_as_driver

APP = "raypipe"
GPU_NODE_TYPE = {"gpu_1x": {"resources": {"CPU": 0, "GPU": 1}, "max_workers": 4}}
# Deployments scaled for the test: small targets so a few clients exceed them, short delays.
AUTOSCALING = {
    "Ingress": {"min_replicas": 1, "max_replicas": 1},
    "EncoderGroup": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 0.25},  # encoding is brief
    "Decoder": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2},
    "ResponseStore": {"min_replicas": 1, "max_replicas": 1},
    "LoraRegistry": {"min_replicas": 1, "max_replicas": 1},
}
# downscale_delay_s 10: a replica that takes long to start on a busy machine is not cancelled by a lull
FAST = {"upscale_delay_s": 2, "downscale_delay_s": 10, "look_back_period_s": 2, "metrics_interval_s": 0.5}
# The light phase's client waits this long after each answer. Without a pause one client kept
# EncoderGroup above its 0.25 target on a quiet machine (decode is fast there, so encoding is over a
# quarter of each request), so it never scaled down; a loaded machine's slow decode hid that.
LIGHT_PAUSE_S = 1.0
BASE_GPU_NODES = 2  # one encoder worker + one decoder
# `--quick` (the test's cycle) scales the Decoder alone, 2 -> 3 GPU nodes: the same Serve and autoscaler path at
# one node and two replica starts (an EncoderGroup's coordinator and worker) less, ~30% of the cycle on 2 cores.
QUICK_AUTOSCALING = {**AUTOSCALING, "EncoderGroup": {**AUTOSCALING["EncoderGroup"], "max_replicas": 1}}


def max_gpu_nodes(autoscaling: dict) -> int:
    """GPU nodes with every deployment at its maximum: one per EncoderGroup worker (1 per group) and Decoder."""
    return sum(autoscaling[name]["max_replicas"] for name in ("EncoderGroup", "Decoder"))


def test_serve_config(model: str, port: int, autoscaling: dict = AUTOSCALING) -> dict:
    """config.yaml's GPU-cluster form, on loopback, one encoder per group, test-sized `autoscaling`."""
    from raypipe.serve.kuberay import gpu_serve_config, load_serve_config

    config = gpu_serve_config(load_serve_config(), model=model)
    config["http_options"].update(host="127.0.0.1", port=port)
    [app] = config["applications"]
    app["args"].update(num_encoders=1, batch_window_s=0.002)
    for deployment in app["deployments"]:
        deployment["autoscaling_config"].update(autoscaling[deployment["name"]], **FAST)
        if deployment["name"] == "EncoderGroup":
            # A coordinator needs a CPU share to be kept off the CPU-less GPU nodes (see above): a
            # zero-resource replica placed there would keep an otherwise idle node alive.
            deployment["ray_actor_options"]["num_cpus"] = 0.05
    return config


class Timeline(Sampler):
    """Samples GPU node and replica counts in a thread; records when each count first changed."""

    def latest(self) -> tuple[int, dict]:
        return (self.samples[-1][1], self.samples[-1][2]) if self.samples else (0, {})

    def sample(self) -> tuple[int, dict]:
        from ray import serve

        replicas = {}
        app = serve.status().applications.get(APP)
        if app is not None:
            # (running, running + starting): a starting replica already holds its GPUs and node
            replicas = {name: (d.replica_states.get("RUNNING", 0),
                               d.replica_states.get("RUNNING", 0) + d.replica_states.get("STARTING", 0))
                        for name, d in app.deployments.items()}
        return gpu_nodes(), replicas

    def wait_for(self, predicate, since: float, timeout_s: float, what: str) -> float:
        """Seconds from `since` until a sample satisfied `predicate(gpu_nodes, replicas)`."""
        while time.monotonic() - since < timeout_s:
            seconds = self.first(predicate, since)
            if seconds is not None:
                return seconds
            time.sleep(0.2)
        raise TimeoutError(f"{what} within {timeout_s:.0f} s; last sample: {self.latest()}; "
                           f"failed looks: {len(self.errors)} {self.errors[-1:]}")


def chat_body(model: str, max_tokens: int) -> dict:
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:112, 0:168]
    pixels = np.stack([x * 3 % 256, y * 4 % 256, (x + y) % 256], -1).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe it."}]}]}


class Load:
    """`clients` concurrent closed-loop clients (each waits `pause_s` after an answer) until `stop()`;
    counts ok and failed requests."""

    def __init__(self, base_url: str, body: dict):
        self.base_url, self.body = base_url, body
        self.ok = self.failed = 0
        self.errors: list[str] = []
        self._clients = 0
        self._pause_s = 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._tasks = []

    def start(self) -> "Load":
        self._thread.start()
        return self

    def set_clients(self, clients: int, pause_s: float = 0.0) -> None:
        """Grow or shrink the number of clients; a removed client finishes its request first."""
        self._clients, self._pause_s = clients, pause_s
        while len(self._tasks) < clients:
            self._tasks.append(asyncio.run_coroutine_threadsafe(self._client(len(self._tasks)), self._loop))

    def stop(self) -> None:
        self.set_clients(0)
        for task in self._tasks:
            task.result(timeout=120)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    async def _client(self, index: int) -> None:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=120)
        while index < self._clients:
            try:
                reply = await client.chat.completions.create(**self.body)
                assert reply.choices[0].finish_reason in ("stop", "length"), reply
                self.ok += 1
            except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
                self.failed += 1
                self.errors.append(f"{type(exc).__name__}: {exc}"[:300])
            await asyncio.sleep(self._pause_s)
        await client.close()


def run_cycle(clients: int = 6, max_tokens: int = 24, phase_timeout_s: float = 300.0, autoscaling: dict = AUTOSCALING,
              log=print) -> dict:
    """One deploy / scale-up / scale-down cycle on a fresh fake cluster, the deployments sized by `autoscaling`;
    times in seconds."""
    import ray
    from ray.serve._private import api as serve_api
    from ray.serve.schema import ServeDeploySchema

    from raypipe.models.registry import resolve_model

    model = str(resolve_model("tiny"))  # written once here; every fake node shares this machine's disk
    port = free_port()
    config = ServeDeploySchema.model_validate(test_serve_config(model, port, autoscaling))
    most_nodes = max_gpu_nodes(autoscaling)
    result = {"clients": clients, "max_tokens": max_tokens}
    with FakeCluster(GPU_NODE_TYPE, head_resources={"CPU": 2}) as cluster:
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
        timeline = Timeline().start()
        load = None
        try:
            start = time.monotonic()
            client = serve_api.serve_start(http_options=config.http_options.model_dump(),
                                           proxy_location=config.proxy_location)
            client.deploy_apps(config)
            result["first_gpu_node_s"] = timeline.wait_for(lambda n, r: n >= 1, start, phase_timeout_s,
                                                           "no GPU node came up after deploying")
            result["cold_start_s"] = timeline.wait_for(lambda n, r: _all_at(r, autoscaling, "min_replicas", running=True), start,
                                                       phase_timeout_s, "the app did not get its minimum replicas")
            result["gpu_nodes_after_deploy"] = timeline.latest()[0]
            log(f"deployed: {result['gpu_nodes_after_deploy']} GPU nodes (first after {result['first_gpu_node_s']:.1f} s), "
                f"cold start {result['cold_start_s']:.1f} s")

            load = Load(f"http://127.0.0.1:{port}/v1", chat_body(model, max_tokens)).start()
            load.set_clients(clients)
            result["scale_up_s"] = timeline.wait_for(lambda n, r: n >= most_nodes and _all_at(r, autoscaling, "max_replicas"),
                                                     time.monotonic(), phase_timeout_s, "not scaled up")
            result["max_gpu_nodes"] = max(n for _, n, _ in timeline.samples)
            result["requests_during_scale_up"], result["failed_during_scale_up"] = load.ok, load.failed
            log(f"scaled up to {result['max_gpu_nodes']} GPU nodes in {result['scale_up_s']:.1f} s")

            load.set_clients(1, pause_s=LIGHT_PAUSE_S)  # light traffic goes on while replicas and nodes go away
            before_ok, before_failed = load.ok, load.failed
            result["scale_down_s"] = timeline.wait_for(lambda n, r: n <= BASE_GPU_NODES and _all_at(r, autoscaling, "min_replicas"),
                                                       time.monotonic(), phase_timeout_s, "not scaled down")
            load.stop()
            result["requests_during_scale_down"] = load.ok - before_ok
            result["failed_during_scale_down"] = load.failed - before_failed
            result["gpu_nodes_after_scale_down"] = timeline.latest()[0]
            result["errors"] = load.errors[:5]
            log(f"scaled down to {result['gpu_nodes_after_scale_down']} GPU nodes in {result['scale_down_s']:.1f} s")
        finally:
            if load is not None and load._thread.is_alive():
                load.stop()
            timeline.stop()
            ray.shutdown()
    return result


def _all_at(replicas: dict, autoscaling: dict, bound: str, running: bool = False) -> bool:
    """Every deployment has `bound` replicas: running ones, or (default) running + starting.

    Scale-up counts starting replicas: on a busy 2-core machine a new EncoderGroup's model load can
    take minutes after Serve added it and the autoscaler gave its worker a node.
    """
    return all(replicas.get(name, (0, 0))[0 if running else 1] == limits[bound] for name, limits in autoscaling.items())


def main(args) -> int:
    run_as_driver()
    runs = 1 if args.quick else 3
    autoscaling = QUICK_AUTOSCALING if args.quick else AUTOSCALING
    results = [run_cycle(autoscaling=autoscaling) for _ in range(runs)]
    keys = ["first_gpu_node_s", "cold_start_s", "scale_up_s", "scale_down_s"]
    medians = {key: statistics.median(r[key] for r in results) for key in keys}
    counts = {phase: (sum(r[f"requests_during_{phase}"] for r in results), sum(r[f"failed_during_{phase}"] for r in results))
              for phase in ("scale_up", "scale_down")}  # (requests, failed) per phase, over all runs
    requests, failed = (sum(c[i] for c in counts.values()) for i in (0, 1))
    summary = {"runs": results, "median": medians, "requests": requests, "failed": failed}
    if args.json:
        import json

        print(json.dumps(summary, indent=2))
    else:
        print_table(f"Serve on a fake cluster ({runs} runs; 1-GPU nodes: {BASE_GPU_NODES} -> {max_gpu_nodes(autoscaling)} -> "
                    f"{BASE_GPU_NODES}; shared 2-core machine)", ["measure", "median s", "runs"],
                    [[key, medians[key], ", ".join(f"{r[key]:.1f}" for r in results)] for key in keys])
        print(f"\nrequests: {requests}, failed: {failed} (" + "; ".join(
            f"during {phase.replace('_', '-')}: {bad} failed of {n}" for phase, (n, bad) in counts.items()) + ")")
    write_json(args.out, "cluster", summary)
    return 0 if failed == 0 else 1
