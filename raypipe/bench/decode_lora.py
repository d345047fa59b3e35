"""`raypipe bench decode --loras N`: one batch mixing N LoRA adapters against the base model alone, in process.

For `--model` (a preset, `small` by default) it writes N random PEFT adapters (rank 8 on every attention
and MLP linear of the language model, or with `--lora-targets attention` on the attention projections only;
PEFT's own `save_pretrained`), starts one engine per N with
`max_loras = N`, and decodes 16 text requests (K=8, eager steps, `ignore_eos`) three ways:

- base: an engine without adapters (what LoRA serving is measured against);
- base rows on the LoRA engine: every row names no adapter (the price of merely serving LoRA);
- mixed: row i uses adapter i mod N, so N=16 puts 16 different adapters in every round.

Each engine runs alone in the process, as in a deployment (one engine per actor): two engines' threads would
put two OpenMP teams in one process, and more OpenMP threads than CPUs slow every parallel op of both
(`runtime/cpu_threads.py`). So each pass starts every engine in turn (the base engine, then one per N), warms it
up, runs it and shuts it down; three passes, each run with new prompt texts, and each ratio is the median of the
three passes' ratios, so load drift hits them alike. Memory per adapter is what its slot holds in every
wrapped linear (`max_lora_rank` padded A and B), beside the adapter file's bytes. The issue's target
is >= 0.8x of base at N=16 on CPU.

A decode step at these batch sizes reads every weight it uses once from memory, the N adapters' factors as
well as the base linears, so the table also gives N slots' bytes over the base linears' (`adapter bytes /
base`): what the adapters add to the part of a step that reads weights.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import tempfile
import time

REQUESTS = 16
RANK = 8
COUNTS = (1, 4, 16)
ATTENTION = "q_proj|k_proj|v_proj|o_proj|in_proj_qkv|in_proj_z|out_proj"  # full attention's and gated delta nets'
TARGETS = {"all": rf".*language_model.*\.({ATTENTION}|gate_proj|up_proj|down_proj)",
           "attention": rf".*language_model.*\.({ATTENTION})"}


def tok_s(engine, prompts, loras, max_tokens: int) -> float:
    """Tokens/s decoding every prompt at once, prompt i under adapter `loras[i]`."""
    from raypipe import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    async def every():
        return await asyncio.gather(*(engine.generate_output(f"l{time.monotonic_ns()}-{i}", p, [], params, lora)
                                      for i, (p, lora) in enumerate(zip(prompts, loras))))

    start = time.perf_counter()
    outputs = asyncio.run(every())
    return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)


def slot_bytes(engine) -> int:
    """Bytes one adapter slot takes across every wrapped linear (`max_loras` slots and the base model's)."""
    from raypipe.models.lora import LoraLinear

    layers = [m for m in engine.runner.model.modules() if isinstance(m, LoraLinear)]
    return sum(m.lora_a.nbytes + m.lora_b.nbytes for m in layers) // (engine.config.max_loras + 1)


def linear_weight_bytes(engine) -> int:
    """Bytes of the language model's linear weights (lm_head included), as a decode step reads them: the base
    engine's (no LoRA wrappers)."""
    return sum(m.in_features * m.out_features * engine.runner.dtype.itemsize for m in engine.runner.model.modules()
               if hasattr(m, "in_features") and hasattr(m, "out_features"))


def main(args) -> int:
    import os
    import pathlib

    from raypipe.bench.common import emit, print_table
    from raypipe.bench.decode import make_prompts
    from raypipe.decode.config import EngineConfig
    from raypipe.decode.engine import LLMEngine
    from raypipe.models.registry import language_adapter, resolve_model
    from raypipe.runtime.cpu_threads import single_threaded
    from raypipe.testing.lora_adapters import write_adapters

    name = args.model or "small"
    targets = args.lora_targets or "all"
    checkpoint = resolve_model(name)
    counts = [n for n in COUNTS if n <= args.loras] or [args.loras]
    max_tokens, repeats = (16, 1) if args.quick else (64, 3)
    tokenizer = language_adapter(checkpoint).tokenizer
    config = EngineConfig(max_num_seqs=REQUESTS, num_scheduler_steps=8, compiled_decode=False, max_model_len=256)
    load_before = os.getloadavg()
    fresh = iter(range(1, 10**6))  # a new prompt seed for every run: no run reuses another's prefix

    def one_engine(engine_config, runs: dict, weigh) -> tuple[dict, int]:
        """tok/s of each run (its rows' adapters) on an engine started for them, shut down after; `weigh(engine)`."""
        engine = LLMEngine(checkpoint, engine_config)
        try:
            for loras in runs.values():  # warm-up
                tok_s(engine, make_prompts(tokenizer, REQUESTS, seed=next(fresh)), loras, 4)
            return ({key: tok_s(engine, make_prompts(tokenizer, REQUESTS, seed=next(fresh)), loras, max_tokens)
                     for key, loras in runs.items()}, weigh(engine))
        finally:
            engine.shutdown()

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        fields = dict(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS[targets])
        with single_threaded():  # no OpenMP team on this thread beside the engines' (cpu_threads.py)
            adapters = {name: str(path) for name, path in write_adapters(
                checkpoint, pathlib.Path(folder), {f"bench{i}": fields for i in range(max(counts))}).items()}
        file_bytes = sum(f.stat().st_size for f in pathlib.Path(adapters["bench0"]).iterdir())
        lora_configs = {n: dataclasses.replace(config, lora_modules=dict(list(adapters.items())[:n]), max_loras=n,
                                               max_lora_rank=RANK) for n in counts}
        base_runs, speeds, slots = [], {n: {"base_rows": [], "mixed": []} for n in counts}, {}
        for _ in range(repeats):
            base, base_bytes = one_engine(config, {"base": [None] * REQUESTS}, linear_weight_bytes)
            base_runs.append(base["base"])
            for n in counts:
                runs, slots[n] = one_engine(lora_configs[n], {"base_rows": [None] * REQUESTS,
                                                              "mixed": [f"bench{i % n}" for i in range(REQUESTS)]},
                                            slot_bytes)
                for key, speed in runs.items():
                    speeds[n][key].append(speed)
        for n in counts:
            rows.append({"adapters": n, "slot_bytes": slots[n], "adapter_vs_base_bytes": n * slots[n] / base_bytes,
                         "base_tok_s": statistics.median(base_runs),
                         **{f"{key}_tok_s": statistics.median(v) for key, v in speeds[n].items()},
                         **{f"{key}_vs_base": statistics.median(s / b for s, b in zip(v, base_runs))
                            for key, v in speeds[n].items()}})
    result = {"model": name, "requests": REQUESTS, "max_tokens": max_tokens, "repeats": repeats, "rank": RANK,
              "targets": targets, "base_linear_bytes": base_bytes,
              "adapter_file_bytes": file_bytes, "rows": rows,
              "load_average_before": load_before, "load_average_after": os.getloadavg()}

    def describe(result: dict, path) -> None:
        on = "every linear" if result["targets"] == "all" else "the attention projections"
        print_table(f"{name}: {REQUESTS} requests x {max_tokens} tokens, K=8, eager, rank-{RANK} adapters on {on}; "
                    f"each engine alone in the process; medians of {repeats} passes; load average "
                    f"{result['load_average_before'][0]:.2f} -> {result['load_average_after'][0]:.2f}",
                    ["adapters in the batch", "base model tok/s", "base rows on the LoRA engine", "vs base",
                     "mixed tok/s", "vs base", "KiB per adapter slot", "adapter bytes / base"],
                    [[r["adapters"], r["base_tok_s"], r["base_rows_tok_s"], r["base_rows_vs_base"], r["mixed_tok_s"],
                      r["mixed_vs_base"], r["slot_bytes"] / 1024, r["adapter_vs_base_bytes"]]
                     for r in result["rows"]])
        print(f"adapter file: {result['adapter_file_bytes'] / 1024:.0f} KiB; base linear weights: "
              f"{result['base_linear_bytes'] / 2**20:.1f} MiB\n(JSON: {path})")

    return emit(args, "decode_lora", result, describe)
