"""`raypipe bench serve-load`: large images through the endpoint, before and after resizing at the ingress.

One run, one local Ray, the same requests twice: first with `resize_images=False` (full-resolution
pixels travel ingress -> encoder group -> worker; the worker's processor resizes them), then with
the default (the ingress resizes to what the tower consumes). Each run: N requests, 4 distinct large
PNGs each, `CLIENTS` closed-loop clients; latency p50/p99; image bytes the encoder group received
(each such byte is written to the object store once ingress -> group and once group -> worker);
`/health` probed every 0.25 s during the load (status and latency). After the second run every
encoder worker is killed with SIGKILL and, with no request sent, the time until `/health` says 200
again (one worker back) and until all workers are back is measured.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import statistics
import time

import numpy as np

from raypipe.bench.common import print_table, write_json
from raypipe.bench.png_variants import distinct_pngs

CLIENTS = 8
IMAGES_PER_REQUEST = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_bodies(count: int, side: int) -> list[dict]:
    """`count` requests with IMAGES_PER_REQUEST distinct smooth `side`x`side` PNGs each."""
    y, x = np.mgrid[0:side, 0:side]
    base = np.stack([x % 256, y % 256, ((x + y) // 2) % 256], -1).astype(np.uint8)
    heads = []
    for k in range(count * IMAGES_PER_REQUEST):  # distinct pixels in the first rows: no embedding-cache hits
        head = base[:16].copy()
        head[:8, :64], head[8:16, :64] = k % 251, k // 251
        heads.append(head)
    pngs = iter(distinct_pngs(base, heads))
    bodies = []
    for i in range(count):
        content = [{"type": "text", "text": f"Describe pictures {i}."}]
        for _ in range(IMAGES_PER_REQUEST):
            content.append({"type": "image_url",
                            "image_url": {"url": "data:image/png;base64," + base64.b64encode(next(pngs)).decode()}})
        bodies.append({"model": "bench", "max_tokens": 8, "temperature": 0,
                       "messages": [{"role": "user", "content": content}]})
    return bodies


async def _load(base: str, bodies: list[dict]) -> dict:
    import httpx

    latencies, errors, health = [], [], []
    queue = list(bodies)
    done = asyncio.Event()

    async def client(http):
        while queue:
            body = queue.pop()
            start = time.perf_counter()
            try:
                response = await http.post(f"{base}/v1/chat/completions", json=body)
                if response.status_code != 200:
                    errors.append(response.status_code)
                    continue
            except httpx.HTTPError as exc:
                errors.append(type(exc).__name__)
                continue
            latencies.append(time.perf_counter() - start)

    async def probe(http):
        while not done.is_set():
            start = time.perf_counter()
            try:
                status = (await http.get(f"{base}/health")).status_code
            except httpx.HTTPError:
                status = 0
            health.append((status, time.perf_counter() - start))
            await asyncio.sleep(0.25)

    async with httpx.AsyncClient(timeout=600) as http, httpx.AsyncClient(timeout=60) as prober:
        start = time.perf_counter()
        probing = asyncio.ensure_future(probe(prober))
        await asyncio.gather(*(client(http) for _ in range(CLIENTS)))
        elapsed = time.perf_counter() - start
        done.set()
        await probing
    q = statistics.quantiles(latencies, n=100) if len(latencies) >= 2 else latencies * 99
    probe_times = [t for _, t in health]
    return {"requests": len(bodies), "ok": len(latencies), "errors": len(errors), "wall_s": elapsed,
            "latency_p50": statistics.median(latencies) if latencies else float("nan"),
            "latency_p99": q[98] if q else float("nan"),
            "health_probes": len(health), "health_200_fraction": sum(s == 200 for s, _ in health) / max(len(health), 1),
            "health_latency_p50": statistics.median(probe_times) if probe_times else float("nan"),
            "health_latency_max": max(probe_times, default=float("nan"))}


def _time_to_recover(base: str, group, num_workers: int) -> dict:
    """SIGKILL every encoder worker of `group` (processes on this machine), then poll /health only."""
    import httpx

    victims = [info["pid"] for info in group.worker_info.remote().result()]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    start = time.perf_counter()
    first_200 = all_back = None
    statuses = []
    while time.perf_counter() - start < 300:
        response = httpx.get(f"{base}/health", timeout=60)
        statuses.append(response.status_code)
        alive = response.json().get("encoder_workers", {}).get("alive", 0)
        if response.status_code == 200 and first_200 is None:
            first_200 = time.perf_counter() - start
        if response.status_code == 200 and alive == num_workers:
            all_back = time.perf_counter() - start
            break
        time.sleep(0.1)
    return {"workers_killed": len(victims), "seconds_to_first_200": first_200, "seconds_to_all_workers": all_back,
            "saw_503": 503 in statuses}


def main(args) -> int:
    import ray
    from ray import serve

    from raypipe.models.registry import resolve_model
    from raypipe.runtime.ray_cluster import connect_ray
    from raypipe.serve.app import build_app

    model = getattr(args, "model", None) or "tiny"
    count = getattr(args, "requests", None) or (20 if args.quick else 100)
    side = getattr(args, "side", None) or (2048 if args.quick else 4096)
    num_workers = 2
    print(f"making {count} requests x {IMAGES_PER_REQUEST} PNGs of {side}x{side} ...", flush=True)
    bodies = make_bodies(count, side)
    resolve_model(model)
    connect_ray()
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    limits = {"max_body_bytes": 256 * 1024 * 1024, "max_image_pixels": side * side,
              "max_images_per_request": IMAGES_PER_REQUEST}
    result = {"model": model, "requests": count, "images_per_request": IMAGES_PER_REQUEST, "side": side,
              "clients": CLIENTS, "encoder_workers": num_workers, "cores": os.cpu_count() or 1, "runs": {}}
    try:
        for name, resize in (("full resolution (before)", False), ("resized at ingress (after)", True)):
            serve.run(build_app({"model": model, "served_model_name": "bench", "num_encoders": num_workers,
                                 "limits": limits, "resize_images": resize}), name="load", route_prefix="/")
            group = serve.get_deployment_handle("EncoderGroup", app_name="load")
            run = asyncio.run(_load(base, bodies))
            run["image_bytes_to_encoders"] = group.stats.remote().result()["pixel_bytes_received"]
            if resize:
                result["recovery"] = _time_to_recover(base, group, num_workers)
            result["runs"][name] = run
            serve.delete("load")
    finally:
        serve.shutdown()
        ray.shutdown()
    before, after = result["runs"].values()
    result["ratios"] = {"latency_p50_before_over_after": before["latency_p50"] / after["latency_p50"],
                        "latency_p99_before_over_after": before["latency_p99"] / after["latency_p99"],
                        "bytes_before_over_after": before["image_bytes_to_encoders"] / max(after["image_bytes_to_encoders"], 1)}
    write_json(args.out, "serve_load", result)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _report(result)
    return 0 if all(run["errors"] == 0 for run in result["runs"].values()) else 1


def _report(result: dict) -> None:
    headers = ["run", "ok", "errors", "wall s", "p50 s", "p99 s", "image MB to encoders", "/health 200",
               "/health p50 s", "/health max s"]
    rows = [[name, r["ok"], r["errors"], r["wall_s"], r["latency_p50"], r["latency_p99"],
             r["image_bytes_to_encoders"] / 1e6, f"{r['health_probes'] and r['health_200_fraction']:.0%}",
             r["health_latency_p50"], r["health_latency_max"]] for name, r in result["runs"].items()]
    print_table(f"raypipe bench serve-load: {result['model']}, {result['requests']} requests x "
                f"{result['images_per_request']} PNGs of {result['side']}x{result['side']}, {result['clients']} clients, "
                f"{result['encoder_workers']} encoder workers, {result['cores']} cores", headers, rows)
    ratios = result["ratios"]
    print(f"\nbefore/after: p50 latency {ratios['latency_p50_before_over_after']:.2f}x, p99 latency "
          f"{ratios['latency_p99_before_over_after']:.2f}x, image bytes {ratios['bytes_before_over_after']:.1f}x "
          "(each byte goes through the object store twice: ingress -> group -> worker)")
    recovery = result["recovery"]
    print(f"after killing all {recovery['workers_killed']} encoder workers, no request sent: /health 200 again after "
          f"{recovery['seconds_to_first_200']} s, all workers back after {recovery['seconds_to_all_workers']} s")
