"""`raypipe bench serve`: closed-loop HTTP load on the raypipe endpoint vs a plain `generate()` endpoint.

Both run on the same local Ray, one after the other, in the same run: first the baseline
(`serve_baseline.TransformersBaseline`, one replica per core, one request at a time each), then
raypipe's Serve application. N clients each send a request, wait for the whole answer, send the
next, for a fixed duration. Every request carries a distinct image (mixed sizes, heavy-tailed
towards small ones), so raypipe's embedding cache gets no hits. raypipe is called with `stream`
so time to first token is measured; the baseline cannot stream, so its TTFT is its latency.
Greedy outputs of a few warm-up requests are compared between the two.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import socket
import statistics
import time

import numpy as np

from raypipe.bench.common import print_table, write_json

CLIENTS = 16
# (height, width) and how often each occurs: most requests carry small images, a few large ones.
IMAGE_MIX = [((56, 56), 4), ((112, 112), 4), ((168, 224), 3), ((224, 336), 2), ((336, 448), 2), ((448, 672), 1)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_bodies(count: int, max_tokens: int) -> list[dict]:
    """`count` chat requests with distinct smooth images (cheap to PNG-encode, unlike noise)."""
    from PIL import Image

    sizes = [size for size, weight in IMAGE_MIX for _ in range(weight)]
    rng = np.random.default_rng(0)
    bodies = []
    for i in range(count):
        h, w = sizes[int(rng.integers(len(sizes)))]
        y, x = np.mgrid[0:h, 0:w]
        pixels = np.stack([(x * (i % 7 + 1)) % 256, (y * 3 + i) % 256, ((x + y) // 2 + 17 * i) % 256], -1)
        buffer = io.BytesIO()
        Image.fromarray(pixels.astype(np.uint8)).save(buffer, "PNG")
        url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        bodies.append({"model": "bench", "max_tokens": max_tokens, "temperature": 0, "messages": [{
            "role": "user", "content": [{"type": "text", "text": f"Describe picture {i}."},
                                        {"type": "image_url", "image_url": {"url": url}}]}]})
    return bodies


async def _one(http, url: str, body: dict, stream: bool) -> tuple[float, float, int]:
    """(latency, ttft, completion tokens) of one request; raises on a non-200 answer."""
    start = time.perf_counter()
    if not stream:
        response = await http.post(url, json=body)
        response.raise_for_status()
        latency = time.perf_counter() - start
        return latency, latency, response.json()["usage"]["completion_tokens"]
    ttft, tokens = None, 0
    async with http.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    latency = time.perf_counter() - start
    return latency, ttft if ttft is not None else latency, tokens


async def run_load(url: str, bodies: list[dict], clients: int, duration_s: float, stream: bool) -> dict:
    import httpx

    next_body = iter(range(10**9))
    samples, errors = [], []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        start = time.perf_counter()
        deadline = start + duration_s

        async def client():
            while time.perf_counter() < deadline:
                body = bodies[next(next_body) % len(bodies)]
                try:
                    samples.append(await _one(http, url, body, stream))
                except Exception as exc:  # noqa: BLE001 - counted and reported, not fatal
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])

        await asyncio.gather(*(client() for _ in range(clients)))
        elapsed = time.perf_counter() - start
    latencies = sorted(s[0] for s in samples)
    ttfts = sorted(s[1] for s in samples)
    return {"requests": len(samples), "errors": len(errors), "error_examples": errors[:3], "seconds": elapsed,
            "req_per_s": len(samples) / elapsed, "tokens_per_s": sum(s[2] for s in samples) / elapsed,
            "latency_p50": _pct(latencies, 50), "latency_p99": _pct(latencies, 99),
            "ttft_p50": _pct(ttfts, 50), "ttft_p99": _pct(ttfts, 99),
            "mean_completion_tokens": statistics.fmean(s[2] for s in samples) if samples else 0.0}


def _pct(sorted_values: list[float], pct: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, round(pct / 100 * (len(sorted_values) - 1)))]


def _texts(base: str, path: str, bodies: list[dict]) -> list[str]:
    import httpx

    return [httpx.post(f"{base}{path}", json=body, timeout=300).json()["choices"][0]["message"]["content"]
            for body in bodies]


def _scrape(base: str) -> dict:
    import httpx

    text = httpx.get(f"{base}/raypipe/metrics", timeout=30).text
    wanted = ("raypipe_encoder_batch_max_requests_per_batch", "raypipe_encoder_batch_batches",
              "raypipe_encoder_batch_requests", "raypipe_decode_max_batch", "raypipe_decode_mean_batch",
              "raypipe_encoder_cache_hit_rate", "raypipe_encoder_load_imbalance")
    return {name: float(m.group(1)) for name in wanted
            if (m := re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M))}


def main(args) -> int:
    import ray
    from ray import serve

    from raypipe.models.registry import resolve_model
    from raypipe.runtime.ray_cluster import connect_ray

    model = getattr(args, "model", None) or "small"
    duration = 10.0 if args.quick else 30.0
    # Short answers leave image encoding and prefill (the same work on both sides) dominant;
    # long ones are decode-bound, where batching across requests pays.
    scenarios = [128] if args.quick else [32, 128, 256]
    resolve_model(model)
    connect_ray()
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    result = {"model": model, "clients": CLIENTS, "duration_s": duration, "cores": os.cpu_count() or 1,
              "image_mix": [[list(size), weight] for size, weight in IMAGE_MIX], "scenarios": {}}
    try:
        for max_tokens in scenarios:
            bodies = make_bodies(400 if args.quick else 1200, max_tokens)
            result["scenarios"][str(max_tokens)] = _compare(f"http://127.0.0.1:{port}", model, bodies, duration)
    finally:
        serve.shutdown()
        ray.shutdown()
    write_json(args.out, "serve", result)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _report(result)
    ok = all(s["baseline"]["errors"] == 0 and s["raypipe"]["errors"] == 0 and s["outputs_identical"]
             for s in result["scenarios"].values())
    return 0 if ok else 1


def _compare(base: str, model: str, bodies: list[dict], duration: float) -> dict:
    """Baseline, then raypipe, under the same load; each app is deleted before the next starts."""
    from ray import serve

    from raypipe.bench.serve_baseline import TransformersBaseline
    from raypipe.serve.app import build_app

    check, bodies = bodies[-4:], bodies[:-4]  # warm-up requests whose outputs are compared
    cores = os.cpu_count() or 1
    serve.run(TransformersBaseline.options(num_replicas=cores).bind(model, num_threads=1),
              name="baseline", route_prefix="/baseline")
    baseline_texts = _texts(base, "/baseline/v1/chat/completions", check)
    baseline = asyncio.run(run_load(f"{base}/baseline/v1/chat/completions", bodies, CLIENTS, duration, stream=False))
    serve.delete("baseline")

    serve.run(build_app({"model": model, "served_model_name": "bench", "num_encoders": cores,
                         "engine": {"max_num_seqs": 32, "num_scheduler_steps": 8}}),
              name="raypipe", route_prefix="/raypipe")
    raypipe_texts = _texts(base, "/raypipe/v1/chat/completions", check)
    raypipe = asyncio.run(run_load(f"{base}/raypipe/v1/chat/completions", bodies, CLIENTS, duration, stream=True))
    metrics = _scrape(base)
    serve.delete("raypipe")
    throughput = raypipe["req_per_s"] / baseline["req_per_s"] if baseline["req_per_s"] else float("inf")
    p99 = raypipe["latency_p99"] / baseline["latency_p99"] if baseline["latency_p99"] else float("nan")
    return {"max_tokens": bodies[0]["max_tokens"], "baseline": baseline, "raypipe": raypipe,
            "raypipe_metrics": metrics, "outputs_identical": baseline_texts == raypipe_texts,
            "throughput_ratio": throughput, "p99_ratio": p99, "targets_met": throughput >= 3.0 and p99 <= 1.0}


def _report(result: dict) -> None:
    headers = ["max_tokens", "endpoint", "requests", "errors", "req/s", "tok/s", "p50 s", "p99 s", "TTFT p50",
               "TTFT p99"]
    rows = [[s["max_tokens"], name, m["requests"], m["errors"], m["req_per_s"], m["tokens_per_s"], m["latency_p50"],
             m["latency_p99"], m["ttft_p50"], m["ttft_p99"]]
            for s in result["scenarios"].values()
            for name, m in (("generate() baseline", s["baseline"]), ("raypipe", s["raypipe"]))]
    print_table(f"raypipe bench serve: {result['model']}, {result['clients']} clients, {result['duration_s']:.0f} s "
                f"per run, {result['cores']} cores", headers, rows)
    for s in result["scenarios"].values():
        print(f"\nmax_tokens={s['max_tokens']}, {result['clients']} clients: throughput raypipe/baseline "
              f"{s['throughput_ratio']:.2f}x (target >= 3x), p99 latency raypipe/baseline {s['p99_ratio']:.2f} "
              f"(target <= 1): {'met' if s['targets_met'] else 'NOT met'}; greedy outputs identical: "
              f"{s['outputs_identical']}")
        print("  raypipe batching: " + ", ".join(f"{k.removeprefix('raypipe_')}={v:g}"
                                                 for k, v in s["raypipe_metrics"].items()))
