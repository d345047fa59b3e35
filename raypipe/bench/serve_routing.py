"""`raypipe bench serve --decoders N`: prefix-affinity routing vs Serve's default router, N Decoder replicas.

One Serve on a local Ray; the same application deployed twice, one after the other in the same run:
its Decoder with Serve's default router (power of two choices) and with raypipe's prefix-affinity
router (`serve/prefix_router.py`). Each deployment gets the same two loads:

(a) Multi-turn chat, interleaved: C conversations, in rounds; each round sends every conversation's
    next turn at once (a document and an image in turn 1, another passage of its own in every later
    turn; every turn re-sends the whole conversation, as chat clients do). Rounds, not C closed-loop
    clients: a client that resends the moment its answer ends finds its own replica one request
    less busy, so Serve's least-queue choice alone keeps it there while the load is even (measured:
    the same hit rate as affinity); rounds start every turn from equal queues, as conversations
    whose users pause between turns do. Reported: the prefix-cache hit rate (cached / prompt tokens, from each
    response's usage), and time to first token p50/p99 of turns >= 2 (the turns a cache can serve).
(b) Uniform load: distinct one-turn requests (nothing shared but the chat template's head) from K
    clients at once. Reported: each Decoder replica's share of the requests (from /metrics'
    `raypipe_decoder_requests_total`), as max / mean (1.0 = even; the target is <= 1.3).

Greedy outputs of (a) are compared between the two routers (the same conversation must get the same
answers wherever its turns run). Numbers taken while other work shares the machine are noise;
compare the ratios of a quiet run.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import statistics
import time

import numpy as np

from raypipe.bench.common import print_table, write_json
from raypipe.bench.serve import _free_port, _pct, make_bodies

ROUTERS = (("Serve default (two choices)", False), ("prefix affinity", True))
DOC_WORDS = ("river", "stone", "lamp", "orbit", "cedar", "violet", "engine", "harbor", "maple", "signal", "quartz",
             "meadow", "falcon", "copper", "lantern", "glacier")


def passage(rng: np.random.Generator, chars: int) -> str:
    words = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(DOC_WORDS[int(rng.integers(len(DOC_WORDS)))])
    return " ".join(words)


def conversation_starts(count: int, doc_chars: int) -> list[list[dict]]:
    """Per conversation its first user message: its own document (`doc_chars` of text) and its own image."""
    rng = np.random.default_rng(1)
    starts = []
    for c, body in enumerate(make_bodies(count, 1)):
        image = next(part for part in body["messages"][0]["content"] if part["type"] == "image_url")
        starts.append([{"role": "user", "content": [
            {"type": "text", "text": f"Document {c}: {passage(rng, doc_chars)}"}, image,
            {"type": "text", "text": "What is this document about?"}]}])
    return starts


async def _turn(http, url: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat request: its answer, time to first token and usage."""
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, text, usage = None, [], None
    async with http.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and (piece := chunk["choices"][0]["delta"].get("content")):
                ttft = ttft if ttft is not None else time.perf_counter() - start
                text.append(piece)
            usage = chunk.get("usage") or usage
    return {"ttft": ttft if ttft is not None else time.perf_counter() - start, "text": "".join(text),
            "prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


async def multi_turn(url: str, starts: list[list[dict]], turns: int, max_tokens: int,
                     turn_chars: int) -> list[list[dict]]:
    """`turns` rounds of every conversation's next turn at once (each later turn brings a passage of
    `turn_chars`); per conversation its turns' results."""
    import httpx

    rngs = [np.random.default_rng(100 + c) for c in range(len(starts))]
    conversations = [list(start) for start in starts]
    results: list[list[dict]] = [[] for _ in starts]
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=len(starts))) as http:
        for turn in range(turns):
            answers = await asyncio.gather(*(_turn(http, url, messages, max_tokens) for messages in conversations))
            for c, answer in enumerate(answers):
                results[c].append(answer)
                conversations[c] += [{"role": "assistant", "content": answer["text"]},
                                     {"role": "user", "content": f"Turn {turn + 2}: {passage(rngs[c], turn_chars)}"}]
    return results


async def uniform(url: str, bodies: list[dict], clients: int) -> int:
    """`bodies` sent by `clients` concurrent clients; the number that failed."""
    import httpx

    queue = list(bodies)
    failed = 0
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=clients)) as http:
        async def client():
            nonlocal failed
            while queue:
                response = await http.post(url, json=queue.pop())
                failed += response.status_code != 200

        await asyncio.gather(*(client() for _ in range(clients)))
    return failed


def replica_requests(base: str) -> dict[str, float]:
    import httpx

    text = httpx.get(f"{base}/metrics", timeout=30).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^raypipe_decoder_requests_total{replica="([^"]+)"} ([0-9.e+-]+)$', text, re.M)}


def run_router(base: str, model: str, decoders: int, affinity: bool, starts: list[list[dict]], turns: int,
               turn_chars: int, uniform_bodies: list[dict], clients: int, max_tokens: int) -> dict:
    from ray import serve

    from raypipe.serve.app import compose, deployment_options
    from raypipe.serve.kuberay import SERVE_CONFIG, load_serve_config

    options = deployment_options(load_serve_config(SERVE_CONFIG))
    for name, replicas in (("Ingress", 1), ("EncoderGroup", 1), ("Decoder", decoders)):
        options[name] = {**{k: v for k, v in options[name].items() if k != "autoscaling_config"},
                         "num_replicas": replicas}
    threads = max(1, (os.cpu_count() or 1) // decoders)
    serve.run(compose({"model": model, "served_model_name": "bench", "num_encoders": 1,
                       "engine": {"max_num_seqs": 32, "num_threads": threads},
                       "routing": {"enabled": affinity}}, options),
              name="routing", route_prefix="/routing")
    url = f"{base}/routing/v1/chat/completions"
    try:
        start = time.perf_counter()
        conversations = asyncio.run(multi_turn(url, starts, turns, max_tokens, turn_chars))
        chat_seconds = time.perf_counter() - start
        before = replica_requests(f"{base}/routing")
        failed = asyncio.run(uniform(url, uniform_bodies, clients))
        after = replica_requests(f"{base}/routing")
    finally:
        serve.delete("routing")
    later = [t for c in conversations for t in c[1:]]
    every = [t for c in conversations for t in c]
    split = [after[r] - before.get(r, 0.0) for r in after]
    split += [0.0] * (decoders - len(split))  # a replica that got nothing is not in /metrics
    ttfts = sorted(t["ttft"] for t in later)
    return {"texts": [[t["text"] for t in c] for c in conversations], "chat_seconds": chat_seconds,
            "hit_rate": sum(t["cached_tokens"] for t in every) / sum(t["prompt_tokens"] for t in every),
            "hit_rate_later_turns": sum(t["cached_tokens"] for t in later) / sum(t["prompt_tokens"] for t in later),
            "ttft_p50": _pct(ttfts, 50), "ttft_p99": _pct(ttfts, 99), "ttft_mean": statistics.fmean(ttfts),
            "uniform_split": split, "uniform_max_over_mean": max(split) / statistics.fmean(split),
            "uniform_failed": failed}


def main(args) -> int:
    import ray
    from ray import serve

    from raypipe.models.registry import resolve_model
    from raypipe.runtime.ray_cluster import connect_ray

    model = getattr(args, "model", None) or "small"
    decoders = args.decoders
    conversations, turns, turn_chars = (8, 4, 300) if args.quick else (16, 5, 400)
    uniform_count, clients, max_tokens = (32, 8, 8) if args.quick else (96, 16, 16)
    starts = conversation_starts(conversations, doc_chars=400 if args.quick else 800)
    uniform_bodies = [{**body, "model": "bench"} for body in make_bodies(uniform_count, max_tokens)]
    resolve_model(model)
    connect_ray()
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    result = {"model": model, "decoders": decoders, "conversations": conversations, "turns": turns,
              "uniform_requests": uniform_count, "clients": clients, "max_tokens": max_tokens,
              "cores": os.cpu_count() or 1, "routers": {}}
    try:
        for name, affinity in ROUTERS:
            result["routers"][name] = run_router(base, model, decoders, affinity, starts, turns, turn_chars,
                                                 uniform_bodies, clients, max_tokens)
    finally:
        serve.shutdown()
        ray.shutdown()
    default, affinity = (result["routers"][name] for name, _ in ROUTERS)
    result["outputs_identical"] = default["texts"] == affinity["texts"]
    write_json(args.out, "serve_routing", result)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _report(result)
    ok = result["outputs_identical"] and all(r["uniform_failed"] == 0 for r in result["routers"].values())
    return 0 if ok else 1


def _report(result: dict) -> None:
    default, affinity = (result["routers"][name] for name, _ in ROUTERS)

    def ratio(key: str) -> float:
        return affinity[key] / default[key] if default[key] else float("nan")

    rows = [[label, default[key], affinity[key], ratio(key)] for label, key in (
        ("prefix-cache hit rate, all turns", "hit_rate"),
        ("prefix-cache hit rate, turns >= 2", "hit_rate_later_turns"),
        ("TTFT p50 s, turns >= 2", "ttft_p50"),
        ("TTFT p99 s, turns >= 2", "ttft_p99"),
        ("multi-turn wall s", "chat_seconds"),
        ("uniform load: max / mean requests per replica", "uniform_max_over_mean"))]
    rows.append(["uniform load: requests per replica", "/".join(f"{n:g}" for n in default["uniform_split"]),
                 "/".join(f"{n:g}" for n in affinity["uniform_split"]), ""])
    print_table(f"raypipe bench serve --decoders {result['decoders']}: {result['model']}, {result['conversations']} "
                f"conversations x {result['turns']} turns interleaved; uniform load {result['uniform_requests']} requests "
                f"from {result['clients']} clients; {result['cores']} cores",
                ["", ROUTERS[0][0], ROUTERS[1][0], "affinity / default"], rows)
    print(f"\ngreedy outputs identical under both routers: {result['outputs_identical']}; uniform split within "
          f"1.3x of the mean (affinity): {affinity['uniform_max_over_mean'] <= 1.3}")
