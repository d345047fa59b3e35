"""Compare grammar engines on this engine's tokenizers: compile time and next-token mask fill per step.

Why it exists: `raypipe.decode.grammar` had to pick one engine (see its docstring); this is the
measurement behind that choice, kept so it can be re-run when a version changes. It walks a
valid JSON document token by token (mask fill, then advance), as the decode loop does.

    python -m raypipe.bench.grammar_engines [--tokenizer FOLDER]   # outlines-core is optional

llguidance is a project dependency; outlines-core is measured only when installed
(`pip install outlines-core`). xgrammar is not measured here: its wheel pulls triton and
apache-tvm-ffi, which the CPU machines do not otherwise need.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "tags": ["a", "ccc"], "address": {"zip": "12345"}}


def llguidance_run(tokenizer, ids: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer)
    tok_s = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - start
    mask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    steps = []
    for token in ids:
        t = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        steps.append(time.perf_counter() - t)
        assert (mask[0, token // 32] >> (token % 32)) & 1, "valid token masked"
        assert matcher.consume_token(token), matcher.get_error()
    return {"tokenizer_s": tok_s, "compile_s": compile_s, "fill_ms": _ms(steps)}


def outlines_run(tokenizer, ids: list[int]) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    start = time.perf_counter()
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    eos = tokenizer.eos_token_id
    special = set(tokenizer.all_special_ids)
    tokens: dict[bytes, list[int]] = {}
    for text, i in tokenizer.get_vocab().items():
        if i not in special:
            tokens.setdefault(bytes(to_byte[c] for c in text), []).append(i)
    vocabulary = Vocabulary(eos, tokens)
    tok_s = time.perf_counter() - start
    start = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?"), vocabulary)
    guide = Guide(index)
    compile_s = time.perf_counter() - start
    mask = torch.zeros((len(tokenizer) + 31) // 32, dtype=torch.int32)
    steps = []
    for token in ids:
        t = time.perf_counter()
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        steps.append(time.perf_counter() - t)
        guide.advance(token)
    return {"tokenizer_s": tok_s, "compile_s": compile_s, "fill_ms": _ms(steps)}


def _ms(steps: list[float]) -> dict:
    return {"mean": 1e3 * statistics.mean(steps), "p50": 1e3 * statistics.median(steps), "max": 1e3 * max(steps),
            "steps": len(steps)}


def main() -> None:
    from transformers import AutoTokenizer

    from raypipe.models.registry import tiny_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", action="append", default=[], help="extra tokenizer folder(s)")
    args = parser.parse_args()
    text = json.dumps(DOCUMENT, separators=(",", ":"))
    for folder in [str(tiny_checkpoint()), *args.tokenizer]:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        row = {"tokenizer": folder, "vocab": len(tokenizer), "llguidance": llguidance_run(tokenizer, ids)}
        try:
            row["outlines_core"] = outlines_run(tokenizer, ids[:-1])
        except ImportError:
            row["outlines_core"] = "not installed"
        print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
