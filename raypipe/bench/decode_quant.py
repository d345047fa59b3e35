"""`raypipe bench decode --quant`: a preset and its quantized presets side by side, in process.

For `--model` (a base preset, `small` by default; `small-qwen3.5` for the hybrid) and each of its
quantized presets (`raypipe.models.quantized.presets`): the language model's weight bytes on the
device, the quantized layers' stored bytes over the same weights in bf16, the KV pool's tokens, and
decode tokens/s of 8 concurrent text requests (K=8, eager steps, `ignore_eos`). On a CPU the
quantized layers dequantize one weight per forward, so they trade speed for memory; the table says
how much. Numbers taken while other work shares the machine are noise; compare ratios from a quiet run.
"""

from __future__ import annotations

REQUESTS = 8


def measure(name: str, max_tokens: int) -> dict:
    from raypipe.bench.decode import make_prompts
    from raypipe.bench.detok import run
    from raypipe.decode.config import EngineConfig
    from raypipe.decode.engine import LLMEngine
    from raypipe.models.quantized.stored_linear import StoredWeightLinear
    from raypipe.models.registry import language_adapter, resolve_model

    checkpoint = resolve_model(name)
    prompts = make_prompts(language_adapter(checkpoint).tokenizer, REQUESTS)
    engine = LLMEngine(checkpoint, EngineConfig(max_num_seqs=REQUESTS, num_scheduler_steps=8, compiled_decode=False,
                                                max_model_len=max_tokens + max(map(len, prompts))))
    try:
        run(engine, prompts[:2], 4)  # warm-up
        outputs, seconds = run(engine, prompts, max_tokens)
        model = engine.runner.model
        layers = [m for m in model.modules() if isinstance(m, StoredWeightLinear)]
        stored = sum(getattr(m, n).nbytes for m in layers for n in m.stored)
        return {"model": name, "quantization": model.quantization, "weight_bytes": model.weight_bytes(),
                "quantized_layers": len(layers),
                "stored_over_bf16": stored / sum(2 * m.in_features * m.out_features for m in layers) if layers else None,
                "kv_tokens": (engine.runner.cache.num_blocks - 1) * engine.config.block_size,
                "dtype": str(engine.runner.dtype),
                "tok_s": sum(len(ids) for ids, _ in outputs) / seconds}
    finally:
        engine.shutdown()


def main(args) -> int:
    import os

    from raypipe.bench.common import emit, print_table
    from raypipe.models.quantized.presets import FORMATS

    base = args.model or "small"
    max_tokens = 32 if args.quick else 128
    rows = [measure(name, max_tokens) for name in (base, *(f"{base}-{fmt}" for fmt in FORMATS))]
    result = {"base": base, "max_tokens": max_tokens, "requests": REQUESTS, "load_average": os.getloadavg(),
              "rows": rows}

    def describe(result: dict, path) -> None:
        first = result["rows"][0]
        print_table(f"{base}: weights and decode speed per format ({first['dtype']}, K=8, {REQUESTS} requests x "
                    f"{max_tokens} tokens; load average {result['load_average'][0]:.1f})",
                    ["model", "weight MiB", "vs base", "quantized layers", "stored / bf16", "KV tokens", "tok/s",
                     "vs base"],
                    [[r["model"], r["weight_bytes"] / 2**20, r["weight_bytes"] / first["weight_bytes"],
                      r["quantized_layers"], r["stored_over_bf16"] or "-", r["kv_tokens"], r["tok_s"],
                      r["tok_s"] / first["tok_s"]] for r in result["rows"]])
        print(f"\n(JSON: {path})")

    return emit(args, "decode_quant", result, describe)
