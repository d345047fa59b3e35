"""`raypipe demo`: the main job on the embedded default (local Ray, tiny preset, 2 encoders).

Encodes a dozen generated images of very different sizes data-parallel, shows the balancer's
assignment, checks the sharded embeddings against the vision tower run in this process on the
whole batch, then generates text for a few images.
"""

from __future__ import annotations

import time

import torch

from raypipe.testing.sample_images import DEMO_SIZES, sample_images


def run_demo(args) -> int:
    from raypipe import Pipeline
    from raypipe.config import model_config_from_args
    from raypipe.inputs.images import load_images
    from raypipe.runtime.cpu_threads import torch_threads
    from raypipe.runtime.device import pick_device, resolve_dtype

    images = sample_images()
    t0 = time.perf_counter()
    with Pipeline.from_config(model_config_from_args(args)) as pipe:
        startup = time.perf_counter() - t0
        t1 = time.perf_counter()
        embeddings = pipe.encode(images)
        first_call = time.perf_counter() - t1
        report = pipe.coordinator.last_report
        t2 = time.perf_counter()
        pipe.encode(images)
        cached_call = time.perf_counter() - t2

        adapter = pipe.coordinator.adapter
        items = [adapter.make_item(decoded) for decoded in load_images(images)]
        _print_assignment(report, items, pipe.coordinator.cost_model)

        device = pick_device()
        tower = adapter.load_tower(device, resolve_dtype("auto", device))
        units = [adapter.units(item) for item in items]
        # On the workers' torch thread count: some CPUs' fp32 GEMMs round differently at another count.
        threads = pipe.coordinator.pool.options.num_threads
        with torch_threads(threads):
            t3 = time.perf_counter()
            flat = iter(tower.encode([unit for item_units in units for unit in item_units]))
            in_process = time.perf_counter() - t3
        reference = [adapter.join_units(item, [next(flat) for _ in item_units]) for item, item_units in zip(items, units)]
        exact = all(torch.allclose(a.float(), b.float(), atol=1e-5, rtol=1e-4) for a, b in zip(embeddings, reference))
        print(f"\nsharded embeddings equal the single-process vision tower: {'yes' if exact else 'NO'} "
              f"(atol=1e-5, rtol=1e-4; {len(images)} images)")
        print(f"timings: start-up {startup:.1f} s | encode {first_call * 1e3:.0f} ms on {len(report.loads)} workers "
              f"| same batch again (cache hits) {cached_call * 1e3:.0f} ms | one in-process tower "
              f"{in_process * 1e3:.0f} ms on {threads} thread(s), as each worker")
        generated = _demo_generate(pipe, images)
    return 0 if exact and generated else 1


def _demo_generate(pipe, images, picks=(3, 5, 9)) -> bool:
    """Greedy text for a few of the images (random tiny weights: the words mean nothing)."""
    from raypipe import SamplingParams

    requests = [[{"role": "user", "content": [{"type": "image", "image": images[i]},
                                              {"type": "text", "text": "Describe this image."}]}] for i in picks]
    start = time.perf_counter()
    outputs = pipe.generate(requests, SamplingParams(max_tokens=12))
    elapsed = time.perf_counter() - start
    print(f"\ngenerated for images {list(picks)} in one batch ({elapsed * 1e3:.0f} ms incl. decode-actor start):")
    for i, out in zip(picks, outputs):
        print(f"  image {i}: {out.num_image_tokens} image tokens, prompt {len(out.prompt_token_ids)} tokens -> "
              f"{len(out.token_ids)} tokens, finish={out.finish_reason}: {out.text!r}")
    return all(out.token_ids for out in outputs)


def _print_assignment(report, items, cost_model: str) -> None:
    print(f"{len(items)} images, {len(report.loads)} encoder workers, cost model {cost_model!r}\n")
    print(f"{'image':>5}  {'size (HxW)':>11}  {'grid':>22}  {'tokens':>6}  worker(s)")
    owners = {i: [w for w, shard in enumerate(report.assignment) if i in shard] for i in range(len(items))}
    for i, ((h, w), item) in enumerate(zip(DEMO_SIZES, items)):
        print(f"{i:>5}  {f'{h}x{w}':>11}  {str(item.grid):>22}  {item.num_tokens:>6}  "
              f"{','.join(map(str, owners[i]))}")
    print()
    for w, (shard, load) in enumerate(zip(report.assignment, report.loads)):
        print(f"worker {w}: images {shard}, load {load:g}")
    print(f"imbalance (max/mean load): {report.imbalance:.3f}")
