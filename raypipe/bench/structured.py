"""What structured outputs cost: decode tokens/s of a batch with 0 / 25 / 100% constrained rows at K=1 and K=8,
what admitting a constraint takes (cold and cached), and a short request's latency with and without one.

Why: a constrained row gets its mask every step of a K-step round (host work per step for that row: a mask
fill, a bitmask expand and add, and one host read of its sampled ids), and its constraint is compiled before
it is admitted. Every row runs with `ignore_eos` and the same `max_tokens`, so plain and constrained rows
generate exactly the same number of tokens (a constrained row whose grammar has ended may only sample EOS,
which `ignore_eos` keeps going); the constraint, 1000 lowercase letters, never ends within the run, so
every step of a constrained row fills a real mask. Compile times are medians over the tests' schemas
(`raypipe.testing.structured_schemas`) on the tiny preset's tokenizer: "cold" is the engine's whole
admission of a new constraint (static limits, the trial compile in a worker process and its round
trip, the decoder's own matcher build), "in-process" what a compile cost before compiles were
isolated (llguidance's validate + matcher build in this process), "cached" a later request's copy.
A worker's start (process start, llguidance import, tokenizer build) is paid once per worker, off
the request path. Request latency: 16 greedy tokens from a short prompt, unconstrained, with a new
constraint (cold) and with one already compiled.

    raypipe bench structured [--quick] [--json]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import llguidance

from raypipe import SamplingParams, StructuredOutput
from raypipe.bench.common import print_table
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.decode.grammar import constraint_value
from raypipe.decode.grammar_pool import CompilerPool
from raypipe.decode.grammar_worker import grammar_text
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


def _distinct(i: int) -> list[StructuredOutput]:
    """The tests' schemas, made distinct from every earlier call's by a title (so each compiles cold)."""
    return [StructuredOutput(json={**schema, "title": f"run{i}"}) for schema in SCHEMAS.values()]


def _ms(call) -> float:
    start = time.perf_counter()
    call()
    return 1e3 * (time.perf_counter() - start)


def compile_ms(engine: LLMEngine, repeats: int) -> dict:
    """Median ms over `SCHEMAS` (x repeats) of a new constraint's admission, of the same build in-process
    (validate + matcher, the pre-isolation path) and of a cached one's copy; and a worker's start."""
    grammars = engine.grammars
    cold, cached, in_process = [], [], []
    for i in range(repeats):
        for structured in _distinct(i):
            cold.append(_ms(lambda: grammars.matcher(structured)))
            cached.append(_ms(lambda: grammars.matcher(structured)))
            text = grammar_text(structured.kind, constraint_value(structured))
            in_process.append(_ms(lambda: (llguidance.LLMatcher.validate_grammar(text, grammars.tokenizer),
                                           llguidance.LLMatcher(grammars.tokenizer, text))))
    starts = []
    for _ in range(repeats):
        start = time.perf_counter()
        pool = CompilerPool(grammars.pool.setup, workers=1, timeout_s=60.0)
        pool.compile("regex", "a")
        starts.append(1e3 * (time.perf_counter() - start))
        pool.close()
    return {"schemas": len(SCHEMAS), "cold_ms": statistics.median(cold), "in_process_ms": statistics.median(in_process),
            "cached_ms": statistics.median(cached), "worker_start_ms": statistics.median(starts)}


def request_ms(engine: LLMEngine, repeats: int) -> dict:
    """Median ms of one 16-token greedy request: unconstrained, with a new constraint, with a compiled one."""
    prompt = engine.tokenizer.encode("Reply in JSON.")

    def run(structured) -> float:
        params = SamplingParams(max_tokens=16, ignore_eos=True, structured=structured)
        return _ms(lambda: asyncio.run(engine.generate_output("latency", prompt, params=params)))

    plain, cold, cached = [], [], []
    for i in range(repeats):
        for structured in _distinct(1000 + i):
            plain.append(run(None))
            cold.append(run(structured))
            cached.append(run(structured))
    return {"plain_ms": statistics.median(plain), "cold_ms": statistics.median(cold),
            "cached_ms": statistics.median(cached)}


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
                result["compile"] = compile_ms(engine, repeats)
                result["request"] = request_ms(engine, repeats)
        finally:
            engine.shutdown()
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print_table(f"decode tokens/s, batch {BATCH}, {tokens} tokens per row (tiny preset, median of {repeats})",
                ["K", *(f"{f:.0%} constrained" for f in FRACTIONS), "100% / 0%"],
                [[k, *rates.values(), f"{rates[1.0] / rates[0.0]:.2f}"]
                 for k, rates in result["tokens_per_s"].items()])
    c, r = result["compile"], result["request"]
    print_table(f"constraint admission, median over {c['schemas']} schemas x {repeats} (ms)",
                ["cold (isolated)", "in-process (before)", "cached", "worker start (once)"],
                [[c["cold_ms"], c["in_process_ms"], c["cached_ms"], c["worker_start_ms"]]])
    print_table(f"one request, 16 greedy tokens, K={KS[0]} (ms)", ["unconstrained", "new constraint", "compiled one",
                                                                 "new / unconstrained"],
                [[r["plain_ms"], r["cold_ms"], r["cached_ms"], f"{r['cold_ms'] / r['plain_ms']:.2f}"]])
    return 0
