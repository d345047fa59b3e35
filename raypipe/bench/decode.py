"""`raypipe bench decode`: engine throughput vs transformers' generate(), and K=8 vs K=1 through Ray.

On the `small` preset by default (Qwen2.5-VL shape scaled to ~70M parameters, random weights; `--model
tiny-step3` for Step3), text prompts of
varied length, greedy, `max_tokens` per request:
(a) tokens/s of `LLMEngine` (in process, K=8, compiled decode step) with 1, 8 and 32 concurrent
    requests, against transformers' `generate()` run one request at a time and on one left-padded
    static batch, and against the same engine with eager decode steps; then where the time goes:
    prefill (the same FLOPs one by one or batched: on a CPU it cannot get cheaper per token) and
    decode (the part continuous batching speeds up), from the engine's own timers;
(b) one decode step (forward + logits) at batch 1, 8 and 32: eager vs the static-shape compiled step; for a
    hybrid model (`text_config.layer_types`: Qwen3.5, MiniCPM-V 4.6) also each layer kind's share of the
    eager step (its decoder layers' time, mixer and MLP, over the whole step's);
(c) tokens/s through Ray (`Pipeline.generate_stream`, all requests concurrent) with K=1 and K=8.
Every engine output is checked token for token against the one-at-a-time `generate()` output.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import statistics
import time

import numpy as np
import torch

from raypipe.bench.common import median_seconds, print_table, write_json

CONCURRENCY = (1, 8, 32)
STEP_BATCHES = (1, 8, 32)
# Static-shape buckets for the compiled step: few, so that compiling them stays within minutes on CPU.
BUCKETS = dict(decode_batch_buckets=(1, 8, 16, 32), decode_kv_buckets=(128, 512))


def make_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    words = ["the", "image", "shows", "a", "cat", "on", "red", "sofa", "near", "window", "light", "and", "blue"]
    prompts = []
    for _ in range(count):
        text = " ".join(rng.choice(words, size=int(rng.integers(4, 24))))
        messages = [{"role": "user", "content": text}]
        prompts.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False)))
    return prompts


def hf_sequential(model, prompts, max_tokens: int, eos: int) -> tuple[list[list[int]], float]:
    outputs, start = [], time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
        outputs.append(_cut(out[0, len(prompt):].tolist(), eos))
    return outputs, time.perf_counter() - start


def hf_static_batch(model, prompts, max_tokens: int, eos: int, pad: int) -> tuple[list[list[int]], float]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False)
    seconds = time.perf_counter() - start
    return [_cut(row[width:].tolist(), eos) for row in out], seconds


def _cut(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def engine_run(engine, prompts, max_tokens: int) -> tuple[list[list[int]], float]:
    from raypipe import SamplingParams

    async def all_requests():
        params = SamplingParams(max_tokens=max_tokens)
        return await asyncio.gather(*(engine.generate_output(f"r{time.monotonic_ns()}-{i}", p, [], params)
                                      for i, p in enumerate(prompts)))

    start = time.perf_counter()
    outs = asyncio.run(all_requests())
    return [o.token_ids for o in outs], time.perf_counter() - start


def ray_run(pipe, prompts, max_tokens: int) -> tuple[list[list[int]], float]:
    from raypipe import SamplingParams

    async def one(prompt):
        request = {"prompt_token_ids": prompt, "images": []}
        return [t async for d in pipe.generate_stream(request, SamplingParams(max_tokens=max_tokens))
                for t in d.token_ids]

    async def all_requests():
        return await asyncio.gather(*(one(p) for p in prompts))

    start = time.perf_counter()
    outs = asyncio.run(all_requests())
    return outs, time.perf_counter() - start


def step_times(runner, batch: int, kv_len: int, repeats: int) -> tuple[float, float]:
    """Median seconds of one decode step's forward + logits at `batch` rows: eager, then compiled."""
    tokens = torch.zeros(batch, dtype=torch.long)
    positions = torch.full((3, batch, 1), kv_len - 1, dtype=torch.long)
    write_index = torch.full((batch,), kv_len - 1, dtype=torch.long)
    tables = spread_block_tables(runner.cache, batch, kv_len)

    @torch.inference_mode()
    def eager():
        return eager_step(runner, tokens, positions, write_index, kv_len, tables)

    @torch.inference_mode()
    def compiled():
        return runner.static_step(tokens, positions, write_index, kv_len, tables)

    if runner.static_step is None:  # the cache has layer kinds the static step cannot run (engine says why)
        return median_seconds(eager, repeats), float("nan")
    return median_seconds(eager, repeats), median_seconds(compiled, repeats)


def layer_kind_shares(runner, batch: int, kv_len: int, repeats: int) -> dict[str, float]:
    """Each layer kind's share of one eager decode step at `batch` rows (`text_config.layer_types`; every
    layer one kind where it has none), from timers around its decoder layers: the median over `repeats` of
    (the kind's layers' seconds) / (the step's seconds); the rest (embedding, norm, lm_head) is "other"."""
    layers = runner.model.model.layers
    kinds = list(getattr(runner.model.model.config, "layer_types", None) or ["full_attention"] * len(layers))
    spent: dict[str, float] = {}
    started: list[float] = []
    hooks = [layer.register_forward_pre_hook(lambda *_: started.append(time.perf_counter())) for layer in layers]
    hooks += [layer.register_forward_hook(
        lambda *_, kind=kind: spent.__setitem__(kind, spent.get(kind, 0.0) + time.perf_counter() - started.pop()))
        for layer, kind in zip(layers, kinds)]
    tokens = torch.zeros(batch, dtype=torch.long)
    positions = torch.full((3, batch, 1), kv_len - 1, dtype=torch.long)
    write_index = torch.full((batch,), kv_len - 1, dtype=torch.long)
    tables = spread_block_tables(runner.cache, batch, kv_len)
    shares: dict[str, list[float]] = {}
    try:
        with torch.inference_mode():
            for i in range(repeats + 1):  # the first is a warm-up
                spent.clear()
                start = time.perf_counter()
                eager_step(runner, tokens, positions, write_index, kv_len, tables)
                total = time.perf_counter() - start
                if i:
                    for kind, seconds in {**spent, "other": total - sum(spent.values())}.items():
                        shares.setdefault(kind, []).append(seconds / total)
    finally:
        for hook in hooks:
            hook.remove()
    return {kind: statistics.median(values) for kind, values in shares.items()}


def eager_step(runner, tokens, positions, write_index, kv_len: int, tables) -> torch.Tensor:
    """One eager decode step's forward + logits over the runner's paged cache."""
    runner.cache.prepare_decode(len(tokens), write_index, kv_len, tables)
    hidden = runner.model(runner.model.embed(tokens[:, None]), positions, runner.cache.masks(runner.dtype),
                          runner.cache)
    return runner.model.logits(hidden[:, -1])


def spread_block_tables(cache, batch: int, kv_len: int) -> torch.Tensor:
    """`(batch, blocks)` tables of distinct blocks of the pool (reused round-robin if it has too few), so a
    timed step gathers from memory spread as a real batch's is."""
    blocks = -(-kv_len // cache.block_size)
    return (torch.arange(batch * blocks) % (cache.num_blocks - 1) + 1).view(batch, blocks)


def hf_prefill_seconds(model, prompts) -> float:
    """Seconds of the prompts' forwards alone, one at a time (the prefill inside `hf_sequential`)."""
    start = time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    return time.perf_counter() - start


def engine_split(engine, prompts, max_tokens: int) -> tuple[float, float, float]:
    """(wall, prefill, decode) seconds of one engine run, from its own timers (they may overlap)."""
    before = engine.stats()
    _, seconds = engine_run(engine, prompts, max_tokens)
    after = engine.stats()
    return seconds, *(after[k] - before[k] for k in ("prefill_seconds", "decode_seconds"))


def median_run(fn, repeats: int):
    """First outputs and median seconds, after one unmeasured run (first use of each batch shape is slow)."""
    fn()
    runs = [fn() for _ in range(repeats)]
    return runs[0][0], statistics.median(seconds for _, seconds in runs)


def main(args) -> int:
    from transformers import AutoModelForImageTextToText

    from raypipe.decode.config import EngineConfig
    from raypipe.decode.engine import LLMEngine
    from raypipe.models.registry import language_adapter, resolve_model
    from raypipe.pipeline import Pipeline

    checkpoint = resolve_model(getattr(args, "model", None) or "small")
    torch.set_num_threads(os.cpu_count() or 1)
    adapter = language_adapter(checkpoint)
    max_tokens = 16 if args.quick else 32
    repeats = 1 if args.quick else 3
    prompts = make_prompts(adapter.tokenizer, max(CONCURRENCY))
    eos, pad = adapter.eos_token_ids[0], adapter.tokenizer.pad_token_id
    config = EngineConfig(max_num_seqs=32, max_model_len=512, num_scheduler_steps=8, compiled_decode=True, **BUCKETS)

    hf = AutoModelForImageTextToText.from_pretrained(checkpoint).eval()  # the family's own class
    with torch.inference_mode():
        hf_sequential(hf, prompts[:1], 4, eos)  # warm-up
        reference, _ = hf_sequential(hf, prompts, max_tokens, eos)
    engine = LLMEngine(checkpoint, config)
    eager_engine = LLMEngine(checkpoint, dataclasses.replace(config, compiled_decode=False))
    for e in (engine, eager_engine):
        engine_run(e, prompts[:4], 4)  # warm-up
    rows, split_rows, result = [], [], {"model": str(checkpoint), "max_tokens": max_tokens, "repeats": repeats, "engine": {},
                        "decode_step": engine.stats()["decode_step"]}
    all_identical = True
    for c in CONCURRENCY:
        batch = prompts[:c]
        with torch.inference_mode():
            _, seq_s = median_run(lambda hf=hf: hf_sequential(hf, batch, max_tokens, eos), repeats)
            static_out, static_s = median_run(lambda hf=hf: hf_static_batch(hf, batch, max_tokens, eos, pad), repeats)
        engine_out, engine_s = median_run(lambda: engine_run(engine, batch, max_tokens), repeats)
        eager_out, eager_s = median_run(lambda: engine_run(eager_engine, batch, max_tokens), repeats)
        tokens = sum(len(o) for o in engine_out)
        identical = engine_out == reference[:c] and eager_out == reference[:c]
        all_identical &= identical
        static_same = sum(a == b for a, b in zip(static_out, reference[:c]))
        row = {"concurrency": c, "tokens": tokens, "engine_tok_s": tokens / engine_s,
               "eager_engine_tok_s": sum(len(o) for o in eager_out) / eager_s,
               "sequential_tok_s": sum(len(o) for o in reference[:c]) / seq_s,
               "static_batch_tok_s": sum(len(o) for o in static_out) / static_s,
               "identical_to_generate": identical, "static_batch_rows_identical": static_same}
        row["vs_sequential"] = row["engine_tok_s"] / row["sequential_tok_s"]
        row["eager_vs_sequential"] = row["eager_engine_tok_s"] / row["sequential_tok_s"]
        row["vs_static_batch"] = row["engine_tok_s"] / row["static_batch_tok_s"]
        row["compiled_vs_eager_engine"] = row["engine_tok_s"] / row["eager_engine_tok_s"]
        with torch.inference_mode():
            row["sequential_prefill_s"] = statistics.median(hf_prefill_seconds(hf, batch) for _ in range(repeats))
        row["sequential_s"] = seq_s
        # The split of the engine this device runs by default (eager on CPU, CUDA graphs on GPU).
        row["engine_wall_s"], row["engine_prefill_s"], row["engine_decode_s"] = engine_split(
            engine if engine.device.type == "cuda" else eager_engine, batch, max_tokens)
        sequential_decode = seq_s - row["sequential_prefill_s"]
        row["decode_phase_speedup"] = sequential_decode / row["engine_decode_s"]
        # Amdahl: even with free decode steps the engine still pays its prefill.
        row["speedup_bound_if_decode_were_free"] = seq_s / row["engine_prefill_s"]
        result["engine"][c] = row
        split_rows.append([c, seq_s, row["sequential_prefill_s"], sequential_decode, row["engine_wall_s"],
                           row["engine_prefill_s"], row["engine_decode_s"], row["decode_phase_speedup"],
                           row["eager_vs_sequential"], row["speedup_bound_if_decode_were_free"]])
        rows.append([c, tokens, row["sequential_tok_s"], row["static_batch_tok_s"], row["eager_engine_tok_s"],
                     row["engine_tok_s"], row["vs_sequential"], row["vs_static_batch"],
                     row["compiled_vs_eager_engine"], "yes" if identical else "NO", f"{static_same}/{c}"])
    result["engine_stats"] = engine.stats()
    eager_engine.shutdown()
    engine.shutdown()
    del hf

    step_rows = []
    result["step"] = {}
    for b in STEP_BATCHES:  # the engines are idle: their cache rows are free to write
        eager_s, compiled_s = step_times(engine.runner, b, 100, 5 if args.quick else 20)
        result["step"][b] = {"eager_ms": eager_s * 1e3, "compiled_ms": compiled_s * 1e3, "speedup": eager_s / compiled_s}
        step_rows.append([b, eager_s * 1e3, compiled_s * 1e3, eager_s / compiled_s])

    kinds = set(getattr(engine.runner.model.model.config, "layer_types", None) or ())
    share_rows = []
    if len(kinds) > 1:  # a hybrid model
        result["layer_kind_share"] = {}
        for b in STEP_BATCHES:
            shares = layer_kind_shares(engine.runner, b, 100, 5 if args.quick else 20)
            result["layer_kind_share"][b] = shares
            share_rows.append([b, *(100 * shares.get(kind, 0.0) for kind in (*sorted(kinds), "other"))])

    ray_rows = []
    ray_c = max(CONCURRENCY) if not args.quick else 8
    result["ray"] = {}
    for k in (1, 8):
        with Pipeline.from_pretrained(checkpoint, num_encoders=1, num_scheduler_steps=k,
                                      engine_config=config) as pipe:  # compiled step, as in (a)
            ray_run(pipe, prompts[:4], 4)  # warm-up: engine start and first forward
            out, seconds = median_run(lambda: ray_run(pipe, prompts[:ray_c], max_tokens), repeats)
            identical = out == reference[:ray_c]
            all_identical &= identical
            tokens = sum(len(o) for o in out)
            result["ray"][k] = {"concurrency": ray_c, "tok_s": tokens / seconds, "identical_to_generate": identical,
                                "engine_stats": pipe.engine_stats()}
            ray_rows.append([k, ray_c, tokens, tokens / seconds, "yes" if identical else "NO"])
    result["ray_k8_vs_k1"] = result["ray"][8]["tok_s"] / result["ray"][1]["tok_s"]
    result["all_identical"] = all_identical

    write_json(args.out, "decode", result)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print_table(f"decode tokens/s, {checkpoint.name}, greedy, max_tokens={max_tokens}, median of {repeats}",
                    ["requests", "tokens", "generate 1-by-1", "generate static batch", "engine K=8 eager",
                     "engine K=8 compiled", "x 1-by-1", "x static", "x eager engine", "identical",
                     "static rows identical"], rows)
        print_table("where the time goes, default engine (eager on CPU), seconds; its prefill and decode overlap, "
                    "so they may add up to more than its wall time", ["requests", "1-by-1 total", "1-by-1 prefill",
                                                                      "1-by-1 decode", "engine wall", "engine prefill",
                                                                      "engine decode", "decode x 1-by-1",
                                                                      "engine x 1-by-1", "bound: decode free"],
                    split_rows)
        step = result["decode_step"]
        if step["mode"] == "eager":
            print(f"compiled step: not used ({step['reason']}); the compiled columns repeat eager")
        else:
            print(f"compiled step: {step['mode']}, buckets {step['batch_buckets']} x {step['kv_buckets']}, "
                  f"warm-up (compile) {step['warmup_seconds']:.1f} s")
        print_table("one decode step (forward + logits), KV length 100, median", ["batch", "eager ms", "compiled ms",
                                                                                  "speed-up"], step_rows)
        if share_rows:
            print_table("share of one eager decode step by layer kind, KV length 100, median, %",
                        ["batch", *sorted(kinds), "other (embed, norm, lm_head)"], share_rows)
        print_table(f"through Ray (Pipeline.generate_stream, {ray_c} concurrent requests)",
                    ["K", "requests", "tokens", "tok/s", "identical"], ray_rows)
        print(f"\nK=8 / K=1 through Ray: {result['ray_k8_vs_k1']:.2f}x; all engine outputs identical to generate(): "
              f"{all_identical}")
    return 0 if all_identical else 1
