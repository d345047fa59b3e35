"""`raypipe bench step3`: balancing Step3's views (global view + crops) on measured per-view cost.

For a heavy-tailed image mix (thumbnails to 4K screenshots, as in `bench encode`), every view of
every image is a unit of work. Each unit's encode time is *measured* alone, as a worker runs it
(that includes running the image processor on its image). Then, for n = 2, 4, 8
simulated workers, each strategy's makespan (slowest worker's summed measured time) over the lower
bound max(total / n, largest unit) (timed in this process with the threads one of two encoder
workers gets, so no Ray start is needed):

- vLLM: views split evenly by count, in order (`run_dp_sharded_vision_model` over the crops);
- raypipe greedy on the `patches` and on the `attention` cost model (`get_load_balance_assignment`);
- whole images greedy by summed view cost: what balancing images instead of views would give.

Default model: `tiny-step3` (views scaled to 224/168 px); any Step3 checkpoint folder works.
"""

from __future__ import annotations

import json
import os

import torch

from raypipe.bench.common import median_seconds, print_table, write_json
from raypipe.bench.encode import STRATEGIES, balancer_quality, heavy_tailed_sizes
from raypipe.encode.balance import get_load_balance_assignment, split_by_counts
from raypipe.testing.sample_images import sample_image

WHOLE_IMAGES = "greedy: whole images"


def main(args) -> int:
    from raypipe.inputs.images import ImageLimits, load_images
    from raypipe.models.registry import resolve_model, vision_adapter

    model = getattr(args, "model", None) or "tiny-step3"
    checkpoint = resolve_model(model)
    adapter = vision_adapter(checkpoint)
    count = 16 if args.quick else 32
    sizes = heavy_tailed_sizes(count)
    decoded = load_images([sample_image(h, w, seed=i) for i, (h, w) in enumerate(sizes)],
                          ImageLimits(max_pixels=16_000_000))
    items = [adapter.make_item(d) for d in decoded]
    units_of = [adapter.units(item) for item in items]
    units = [unit for split in units_of for unit in split]
    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // 2))  # what each of two encoder workers gets here
    tower = adapter.load_tower(torch.device("cpu"), torch.float32)
    tower.encode(units[:2])  # warm-up
    seconds = [median_seconds(lambda unit=unit: tower.encode([unit]), 1 if args.quick else 3, warmup=0)
               for unit in units]

    quality = balancer_quality(adapter, [[unit] for unit in units], seconds, (2, 4, 8))  # each view balanced alone
    image_seconds, first = [], 0
    for split in units_of:
        image_seconds.append(sum(seconds[first: first + len(split)]))
        first += len(split)
    lower = {n: max(sum(seconds) / n, max(seconds)) for n in (2, 4, 8)}
    for row in quality:
        n = row["workers"]
        order, counts, _ = get_load_balance_assignment(image_seconds, n)
        loads = [sum(image_seconds[i] for i in shard) for shard in split_by_counts(order, counts)]
        row[WHOLE_IMAGES] = max(loads) / lower[n]  # same lower bound as the view strategies
        row["greedy attention vs vLLM"] = row[STRATEGIES[0]] / row[STRATEGIES[2]]
    global_s = [s for u, s in zip(units, seconds) if adapter.is_global_view(u)]
    crop_s = [s for u, s in zip(units, seconds) if not adapter.is_global_view(u)]
    result = {"model": str(model), "images": count, "sizes": sizes, "units": len(units),
              "crops_per_image": [len(s) - 1 for s in units_of], "unit_seconds": seconds,
              "median_global_view_s": sorted(global_s)[len(global_s) // 2],
              "median_crop_s": sorted(crop_s)[len(crop_s) // 2] if crop_s else None,
              "makespan_over_lower_bound": quality, "cores": cores}
    out = write_json(args.out, "step3", result)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"model {model}: {count} images -> {len(units)} views (crops per image: min "
          f"{min(result['crops_per_image'])}, max {max(result['crops_per_image'])}); measured median "
          f"{result['median_global_view_s'] * 1e3:.1f} ms per global view, "
          f"{(result['median_crop_s'] or 0) * 1e3:.1f} ms per crop")
    headers = ["n", "vLLM count split", "greedy: patches", "greedy: attention", WHOLE_IMAGES, "vLLM / greedy attn"]
    rows = [[r["workers"], r[STRATEGIES[0]], r[STRATEGIES[1]], r[STRATEGIES[2]], r[WHOLE_IMAGES],
             r["greedy attention vs vLLM"]] for r in quality]
    print_table("makespan / lower bound on measured per-view costs (1.000 = perfect)", headers, rows)
    print(f"results: {out}")
    return 0

