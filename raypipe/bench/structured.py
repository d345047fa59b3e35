"""What structured outputs cost: decode tokens/s of a batch with 0 / 25 / 100% constrained rows at K=1 and K=8,
and what compiling a constraint takes, cold and cached.

Why: a constrained row gets its mask every step of a K-step round (host work per step for that row: a mask
fill, a bitmask expand and add, and one host read of its sampled ids), and its constraint is compiled before
it is admitted. Every row runs with `ignore_eos` and the same `max_tokens`, so plain and constrained rows
generate exactly the same number of tokens (a constrained row whose grammar has ended may only sample EOS,
which `ignore_eos` keeps going); the constraint, 1000 lowercase letters, never ends within the run, so
every step of a constrained row fills a real mask. Compile times are medians over the tests' schemas
(`raypipe.testing.structured_schemas`) on the tiny preset's tokenizer.

    raypipe bench structured [--quick] [--json]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

from raypipe import SamplingParams, StructuredOutput
from raypipe.bench.common import print_table
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.decode.grammar import GrammarCompiler
from raypipe.models.registry import tiny_checkpoint
from raypipe.testing.structured_schemas import SCHEMAS

BATCH = 32
FRACTIONS = (0.0, 0.25, 1.0)  # share of the batch's rows that are constrained
KS = (1, 8)
CONSTRAINT = StructuredOutput(regex="[a-z]{1000}")


def batch_tokens_per_s(engine: LLMEngine, fraction: float, tokens: int, repeats: int) -> float:
    """Median generated tokens per second of `BATCH` requests, the first `fraction` of them constrained."""
    constrained = round(BATCH * fraction)

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True,
                              structured=CONSTRAINT if i < constrained else None)

    async def run():
        return await asyncio.gather(*(engine.generate_output(f"r{i}", [5 + i, 6, 7], params=params(i))
                                      for i in range(BATCH)))

    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = asyncio.run(run())
        wall = time.perf_counter() - start
        assert all(len(o.token_ids) == tokens for o in outs), "rows generated different token counts"
        rates.append(BATCH * tokens / wall)
    return statistics.median(rates)


def compile_ms(engine: LLMEngine) -> dict:
    """Median ms over `SCHEMAS` of a first `matcher()` (compile) and of a second (a copy from the cache)."""
    compiler = GrammarCompiler(engine.tokenizer, engine.runner.vocab_size, engine.adapter.eos_token_ids,
                               timeout_s=engine.config.grammar_compile_timeout_s)
    cold, cached = [], []
    for schema in SCHEMAS.values():
        for times in (cold, cached):
            start = time.perf_counter()
            compiler.matcher(StructuredOutput(json=schema))
            times.append(1e3 * (time.perf_counter() - start))
    return {"schemas": len(SCHEMAS), "cold_ms": statistics.median(cold), "cached_ms": statistics.median(cached)}


def main(args) -> int:
    tokens = 16 if args.quick else 64
    repeats = 1 if args.quick else 3
    result = {"batch": BATCH, "tokens_per_row": tokens, "repeats": repeats, "tokens_per_s": {}}
    for k in KS:
        engine = LLMEngine(tiny_checkpoint(), EngineConfig(max_num_seqs=BATCH, max_model_len=512,
                                                           num_scheduler_steps=k))
        try:
            batch_tokens_per_s(engine, 1.0, 4, 1)  # warm-up: first batch shapes, the constraint's compile
            result["tokens_per_s"][k] = {f: batch_tokens_per_s(engine, f, tokens, repeats) for f in FRACTIONS}
            if k == KS[0]:
                result["compile"] = compile_ms(engine)
        finally:
            engine.shutdown()
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print_table(f"decode tokens/s, batch {BATCH}, {tokens} tokens per row (tiny preset, median of {repeats})",
                ["K", *(f"{f:.0%} constrained" for f in FRACTIONS), "100% / 0%"],
                [[k, *rates.values(), f"{rates[1.0] / rates[0.0]:.2f}"]
                 for k, rates in result["tokens_per_s"].items()])
    c = result["compile"]
    print_table(f"constraint compile, median over {c['schemas']} schemas (ms)", ["cold", "cached"],
                [[c["cold_ms"], c["cached_ms"]]])
    return 0
