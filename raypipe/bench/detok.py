"""`raypipe bench detok`: the decode engine with incremental detokenization vs one full decode per round.

Until issue 8 the output processor decoded all of a sequence's output ids every round, so text cost
grew with the square of the output length (worst at K=1, one round per token). This runs the same
engine and requests twice per K, swapping only the output processor: `FullDecodeProcessor` (that
algorithm, kept here as the baseline) and the engine's own incremental one. It reports end-to-end
tokens/s and the CPU seconds the engine thread spent in output processing (`time.thread_time()`
around every `append`), and checks that both produce the same tokens and text.

Default: `tiny` preset (the decode forward is cheap, so text handling shows), 32 requests x 512
tokens, EOS ignored, K=1 and K=8. `--quick`: 8 requests x 128 tokens.
"""

from __future__ import annotations

import asyncio
import json
import time

from raypipe.bench.common import print_table, write_json
from raypipe.decode.output import REPLACEMENT_CHAR, OutputProcessor


class FullDecodeProcessor(OutputProcessor):
    """The pre-issue-8 detokenizer: every call decodes all output ids (the benchmark's baseline)."""

    def _detokenize(self, seq) -> bool:
        text = self._decode(seq.output_ids)
        if text.endswith(REPLACEMENT_CHAR):
            return False
        grew = len(text) > len(seq.text)
        seq.text, seq.read_offset, seq.prefix_chars = text, len(seq.output_ids), len(text)
        return grew


def timed(processor: OutputProcessor) -> OutputProcessor:
    """`processor` with `cpu_seconds`: engine-thread CPU time spent in its `append` calls."""
    append = processor.append
    processor.cpu_seconds = 0.0

    def timed_append(*args, **kwargs):
        start = time.thread_time()
        try:
            return append(*args, **kwargs)
        finally:
            processor.cpu_seconds += time.thread_time() - start

    processor.append = timed_append
    return processor


def run(engine, prompts, max_tokens: int) -> tuple[list, float]:
    from raypipe import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    async def all_requests():
        return await asyncio.gather(*(engine.generate_output(f"d{time.monotonic_ns()}-{i}", p, [], params)
                                      for i, p in enumerate(prompts)))

    start = time.perf_counter()
    outs = asyncio.run(all_requests())
    return [(o.token_ids, o.text) for o in outs], time.perf_counter() - start


def main(args) -> int:
    from raypipe.bench.decode import make_prompts
    from raypipe.decode.config import EngineConfig
    from raypipe.decode.engine import LLMEngine
    from raypipe.models.registry import language_adapter, resolve_model

    checkpoint = resolve_model(getattr(args, "model", None) or "tiny")
    requests, max_tokens = (8, 128) if args.quick else (32, 512)
    prompts = make_prompts(language_adapter(checkpoint).tokenizer, requests)
    rows, result, all_same = [], {"model": str(checkpoint), "requests": requests, "max_tokens": max_tokens}, True
    for k in (1, 8):
        engine = LLMEngine(checkpoint, EngineConfig(max_num_seqs=requests, num_scheduler_steps=k,
                                                    max_model_len=max_tokens + max(map(len, prompts))))
        run(engine, prompts[:2], 4)  # warm-up
        incremental = engine.output
        outputs = {}
        for name, processor in (("full decode per round (before)", FullDecodeProcessor(
                incremental.tokenizer, tuple(incremental.eos_token_ids), incremental.max_model_len)),
                                ("incremental (now)", incremental)):
            engine.output = timed(processor)
            outputs[name], seconds = run(engine, prompts, max_tokens)
            tokens = sum(len(ids) for ids, _ in outputs[name])
            row = {"k": k, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
                   "detok_cpu_s": processor.cpu_seconds}
            result[f"k{k} {name}"] = row
            rows.append([k, name, tokens, seconds, row["tok_s"], row["detok_cpu_s"]])
        before, now = outputs.values()
        all_same &= before == now
        names = list(outputs)
        result[f"k{k} tok_s ratio"] = result[f"k{k} {names[1]}"]["tok_s"] / result[f"k{k} {names[0]}"]["tok_s"]
        result[f"k{k} detok cpu ratio"] = (result[f"k{k} {names[0]}"]["detok_cpu_s"]
                                         / max(result[f"k{k} {names[1]}"]["detok_cpu_s"], 1e-9))
        engine.shutdown()
    result["identical_tokens_and_text"] = all_same
    write_json(args.out, "detok", result)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(f"decode engine text path, {checkpoint.name}, {requests} requests x {max_tokens} tokens, greedy",
                    ["K", "detokenizer", "tokens", "seconds", "tok/s", "detok CPU s"], rows)
        for k in (1, 8):
            print(f"K={k}: tokens/s x{result[f'k{k} tok_s ratio']:.2f}, "
                  f"detokenization CPU / {result[f'k{k} detok cpu ratio']:.1f}")
        print(f"same tokens and text: {all_same}")
    return 0 if all_same else 1
