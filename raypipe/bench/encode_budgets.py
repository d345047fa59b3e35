"""`raypipe bench encode --budgets`: the vision tower eager vs at token budgets, per request.

The heavy-tailed image mix of `bench encode` is cut into requests of 1 and 8 images; each request is
encoded as one worker encodes a shard, by each mode in turn, in-process on one device:

- CPU (fp32): eager (one forward per request, metadata inside the tower), packed (forwards at
  power-of-two budgets, metadata prepared outside), packed + `torch.compile` per budget;
- GPU (bf16): eager, packed, packed + one CUDA graph per budget (where the tower can be captured).

Per mode: images/s over the whole mix, per-request latency (median, p99), and the ratios to eager;
for compiled forwards and graphs also the one-off compile or capture time and the graphs' memory.
Every request is run once by each mode before timing (compiles happen there); then the modes take
turns on each request, so the load of a shared machine falls on all of them alike. Families whose tower has no
budgeted forwards are reported as such.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from raypipe.bench.common import emit, print_table
from raypipe.bench.encode import heavy_tailed_sizes
from raypipe.encode.budget_forwards import BudgetedForwards
from raypipe.encode.budgets import TokenBudgets
from raypipe.testing.sample_images import sample_image

REQUEST_SIZES = (1, 8)  # images per request


def _modes(tower, device: torch.device) -> dict:
    """Mode name -> (encode function, its stats or None), built (compiled / captured) here."""
    budgets = TokenBudgets()
    modes = {"eager": (tower.encode, None)}
    packed = BudgetedForwards(tower, dataclasses.replace(budgets, compile_cpu=False))
    if device.type == "cuda":  # the graphs are captured when graph_capturable; name the mode by what ran
        modes["packed + CUDA graphs" if packed.graphs else "packed (no graphs: tower not capturable)"] = \
            (packed.encode, packed.stats)
        return modes
    modes["packed"] = (packed.encode, packed.stats)
    compiled = BudgetedForwards(tower, dataclasses.replace(budgets, compile_cpu=True))
    modes["packed + compiled"] = (compiled.encode, compiled.stats)
    return modes


def _seconds(encode, request) -> float:
    start = time.perf_counter()
    encode(request)
    return time.perf_counter() - start


def _time(modes: dict, requests, repeats: int) -> tuple[dict, dict]:
    """Per mode: per-request seconds over `repeats` passes, and the seconds of its warm-up pass.

    The modes take turns on every request (round robin), so a slow phase of a shared machine
    slows every mode alike instead of whichever mode it happened to hit."""
    warmup = {mode: sum(_seconds(encode, r) for r in requests) for mode, (encode, _) in modes.items()}
    seconds = {mode: [] for mode in modes}
    for _ in range(repeats):
        for request in requests:
            for mode, (encode, _) in modes.items():
                seconds[mode].append(_seconds(encode, request))
    return seconds, warmup


def main(args) -> int:
    from raypipe.inputs.images import ImageLimits, load_images
    from raypipe.models.registry import resolve_model, vision_adapter
    from raypipe.runtime.device import pick_device

    model = getattr(args, "model", None) or "small"
    adapter = vision_adapter(resolve_model(model))
    device = pick_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tower = adapter.load_tower(device, dtype)
    result = {"model": str(model), "device": str(device), "dtype": str(dtype).removeprefix("torch."),
              "threads": torch.get_num_threads(), "rows": []}
    if not tower.packs_to_budgets:
        result["note"] = f"{type(tower).__name__} has no budgeted forwards"
        return emit(args, "encode_budgets", result, _describe)
    count = 16 if args.quick else 48
    decoded = load_images([sample_image(h, w, seed=i) for i, (h, w) in enumerate(heavy_tailed_sizes(count))],
                          ImageLimits(max_pixels=16_000_000))
    units = [adapter.units(adapter.make_item(d)) for d in decoded]
    repeats = 1 if args.quick else 3
    modes = _modes(tower, device)
    for per_request in REQUEST_SIZES:
        requests = [[u for image in units[i:i + per_request] for u in image] for i in range(0, count, per_request)]
        seconds, warmup = _time(modes, requests, repeats)
        for mode, (_, stats) in modes.items():
            result["rows"].append({
                "mode": mode, "images_per_request": per_request, "images_per_s": count * repeats / sum(seconds[mode]),
                "median_ms": float(np.median(seconds[mode])) * 1e3,
                "p99_ms": float(np.percentile(seconds[mode], 99)) * 1e3,
                "warmup_s": warmup[mode], "stats": dict(stats) if stats else None})
    return emit(args, "encode_budgets", result, _describe)


def _describe(result: dict, path) -> None:
    if "note" in result:
        print(f"model {result['model']}: {result['note']}")
        return
    eager = {r["images_per_request"]: r for r in result["rows"] if r["mode"] == "eager"}
    rows = []
    for r in result["rows"]:
        base = eager[r["images_per_request"]]
        stats = r["stats"] or {}
        rows.append([r["mode"], r["images_per_request"], r["images_per_s"], r["median_ms"], r["p99_ms"],
                     base["median_ms"] / r["median_ms"], base["p99_ms"] / r["p99_ms"], r["warmup_s"],
                     stats.get("graph_bytes", 0) / 2**20])
    print_table(f"model {result['model']} on {result['device']} ({result['dtype']}, {result['threads']} threads): "
                "heavy-tailed mix, per request", ["mode", "images/req", "images/s", "median ms", "p99 ms",
                                                  "eager/mode median", "eager/mode p99", "warm-up s", "graphs MiB"],
                rows)
    print(f"results: {path}")
