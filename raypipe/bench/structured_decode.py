"""What constrained rows cost the decode loop: the same batch with and without a grammar on every row.

Why: constrained rows get their mask every step of a K-step round (host work per step for those rows:
a mask fill, a bitmask expand and `where`, and one host read of their sampled ids), so this measures
that against plain rows of the same length, and the sampler-side cost alone on a 64k vocabulary.

    python -m raypipe.bench.structured_decode [--rows 8] [--tokens 128] [--k 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch
from transformers import AutoTokenizer

from raypipe import SamplingParams, StructuredOutput
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.decode.grammar import GrammarCompiler, GrammarRows
from raypipe.models.registry import tiny_checkpoint


def engine_round(engine: LLMEngine, rows: int, tokens: int, structured: StructuredOutput | None) -> dict:
    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=1, ignore_eos=structured is None,
                            structured=structured)

    async def run():
        return await asyncio.gather(*(engine.generate_output(f"r{i}", [5 + i, 6, 7], params=params)
                                      for i in range(rows)))

    before = dict(engine.stats())
    start = time.perf_counter()
    outs = asyncio.run(run())
    wall = time.perf_counter() - start
    after = engine.stats()
    steps = after["decode_steps"] - before["decode_steps"]
    seconds = after["decode_seconds"] - before["decode_seconds"]
    return {"wall_s": wall, "decode_ms_per_step": 1e3 * seconds / steps, "steps": steps,
            "tokens": sum(len(o.token_ids) for o in outs), "finish": sorted({o.finish_reason for o in outs})}


def sampler_side(tokenizer, rows: int, structured: StructuredOutput, steps: int = 200) -> dict:
    """apply + advance alone for `rows` constrained rows over `tokenizer`'s vocabulary."""
    vocab = len(tokenizer)
    compiler = GrammarCompiler(tokenizer, vocab, (tokenizer.eos_token_id,), timeout_s=EngineConfig.grammar_compile_timeout_s)
    matchers = [compiler.matcher(structured) for _ in range(rows)]
    grammar = GrammarRows(list(range(rows)), matchers, vocab, torch.device("cpu"))
    logits = torch.randn(rows, vocab)
    start = time.perf_counter()
    for _ in range(steps):
        masked = grammar.apply(logits.clone())
        grammar.advance(masked.argmax(dim=-1))
    return {"rows": rows, "vocab": vocab, "ms_per_step": 1e3 * (time.perf_counter() - start) / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--tokenizer", action="append", default=[], help="also time the sampler side on this tokenizer")
    args = parser.parse_args()
    engine = LLMEngine(tiny_checkpoint(), EngineConfig(max_num_seqs=args.rows, max_model_len=512,
                                                       num_scheduler_steps=args.k))
    # Exactly `tokens` letters then EOS: the same number of decode steps as the unconstrained rows.
    structured = StructuredOutput(regex=f"[a-z]{{{args.tokens - 1}}}")
    engine_round(engine, args.rows, 8, None)  # warm-up
    result = {"k": args.k, "plain": engine_round(engine, args.rows, args.tokens, None),
              "constrained": engine_round(engine, args.rows, args.tokens, structured),
              "sampler_side": [sampler_side(AutoTokenizer.from_pretrained(folder), args.rows,
                                            StructuredOutput(regex="[a-z]{1000}"))
                               for folder in (str(tiny_checkpoint()), *args.tokenizer)]}
    engine.shutdown()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
