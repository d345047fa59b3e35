"""`raypipe bench decode --tp N`: one language model over N ranks (raypipe/parallel/) against one device.

On the `small` preset by default (Qwen2.5-VL's shape at ~70M parameters, random weights), both engines
eager, one torch thread per rank (the one-device engine gets one thread too), side by side in one run:
(a) decode step time at batch 1 and 16 (the engine's own decode timer over its decode steps, requests
    of equal short prompts and `max_tokens` each, EOS ignored), TP=N vs TP=1, and the share of rank 0's
    decode time spent inside collectives (all-reduces, the per-step ids and the round's plan; waiting
    for the slower rank counts there too);
(b) per rank, measured in its own process: parameter bytes of the decoder layers and of the rest, the
    paged pool's bytes and resident memory, next to the one-device engine's.
Outputs of the engines are compared token for token. On a 2-core machine TP=2 uses both cores and
TP=1 one: the step-time ratio shows whether the split pays for its collectives there, not GPU behaviour.
A model whose experts can also be split by width (Step3, `EngineConfig.expert_split` "tensor") gets a
third engine, TP=N with tensor-parallel experts, next to the default whole-experts split.
"""

from __future__ import annotations

import asyncio
import os
import statistics

from raypipe.bench.common import emit, print_table

BATCHES = (1, 16)


def run_batch(engine, prompts, max_tokens: int, tag: str) -> tuple[list[list[int]], float, float]:
    """(outputs, seconds per decode step, seconds in collectives per decode step on rank 0) of one batch."""
    from raypipe import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    before, coll_before = engine.stats(), _decode_collectives(engine)

    async def all_requests():
        return await asyncio.gather(*(engine.generate_output(f"{tag}-{i}", p, [], params)
                                      for i, p in enumerate(prompts)))

    outs = asyncio.run(all_requests())
    after = engine.stats()
    steps = after["decode_steps"] - before["decode_steps"]
    return ([o.token_ids for o in outs], (after["decode_seconds"] - before["decode_seconds"]) / steps,
            (_decode_collectives(engine) - coll_before) / steps)


def _decode_collectives(engine) -> float:
    return getattr(engine.runner, "decode_collective_seconds", 0.0)


def main(args) -> int:
    from raypipe.bench.decode import make_prompts
    from raypipe.decode.config import EngineConfig
    from raypipe.decode.engine import LLMEngine
    from raypipe.models.registry import language_adapter, resolve_model
    from raypipe.parallel import runner_factory
    from raypipe.parallel.rank_runner import OWN_RULES, rank_info
    from raypipe.runtime.ray_cluster import connect_ray

    connect_ray()
    tp = args.tp
    checkpoint = resolve_model(args.model or "small")
    max_tokens, repeats = (16, 1) if args.quick else (48, 3)
    text_config = language_adapter(checkpoint).text_config
    variants = [(1, "experts"), (tp, "experts")]  # (ranks, expert split); the key of each engine is its label
    if text_config.model_type in OWN_RULES and getattr(text_config, "n_routed_experts", 0):
        variants.append((tp, "tensor"))
    engines = {}
    for size, split in variants:
        config = EngineConfig(max_num_seqs=max(BATCHES), max_model_len=512, num_threads=1, compiled_decode=False,
                              tensor_parallel_size=size, expert_split=split)
        engines[_label(size, split)] = LLMEngine(checkpoint, config, runner_factory=runner_factory(config))
    one = _label(1, "experts")
    prompt = make_prompts(engines[one].tokenizer, 1)[0]
    result = {"model": str(checkpoint), "tensor_parallel_size": tp, "max_tokens": max_tokens, "repeats": repeats,
              "cpu_count": os.cpu_count(), "load_average": os.getloadavg(), "batches": {}}
    try:
        for engine in engines.values():
            run_batch(engine, [prompt], 4, "warmup")
        identical = True
        for batch in BATCHES:
            row = {}
            for label, engine in engines.items():
                runs = [run_batch(engine, [prompt] * batch, max_tokens, f"{label}-{batch}-{r}") for r in range(repeats)]
                row[label] = {"step_s": statistics.median(r[1] for r in runs),
                              "collective_s": statistics.median(r[2] for r in runs), "outputs": runs[0][0]}
            identical &= all(r["outputs"] == row[one]["outputs"] for r in row.values())
            result["batches"][batch] = {label: {"step_ms": r["step_s"] * 1e3, "speedup": row[one]["step_s"] / r["step_s"],
                                                "collective_share": r["collective_s"] / r["step_s"]}
                                        for label, r in row.items()}
        result["identical_outputs"] = identical
        result["ranks"] = {label: engine.runner.info() if label != one else [rank_info(0, engine.runner)]
                           for label, engine in engines.items()}
    finally:
        for engine in engines.values():
            engine.shutdown()
    return emit(args, f"decode_tp{tp}", result, lambda r, path: describe(r, path))


def _label(size: int, split: str) -> str:
    return f"TP={size}" if size == 1 or split == "experts" else f"TP={size} tensor experts"


def describe(result: dict, path) -> None:
    tp = result["tensor_parallel_size"]
    print(f"model {result['model']}, {result['max_tokens']} tokens per request, median of {result['repeats']}, "
          f"one torch thread per rank; {result['cpu_count']} CPUs, load average at start "
          f"{result['load_average'][0]:.2f}")
    print_table(f"(a) decode step, TP={tp} vs TP=1 (TP=1 / engine: > 1 is faster than one device)",
                ["batch", "engine", "step ms", "TP=1 / engine", "in collectives"],
                [[b, label, r["step_ms"], r["speedup"], f"{100 * r['collective_share']:.0f}%"]
                 for b, row in result["batches"].items() for label, r in row.items()])
    mib = 2.0**20
    rows = []
    for label, ranks in result["ranks"].items():
        for r in ranks:
            rows.append([label, r["rank"], r["parameter_bytes"]["decoder_layers"] / mib,
                         r["parameter_bytes"]["other"] / mib, r["kv_cache_bytes"] / mib, r["rss_bytes"] / mib])
    print_table("(b) per rank, measured in its process (MiB)", ["engine", "rank", "decoder layers", "embeddings+head",
                                                                "KV pool", "resident"], rows)
    print(f"\noutputs identical on every engine: {'yes' if result['identical_outputs'] else 'NO'}; JSON: {path}")
