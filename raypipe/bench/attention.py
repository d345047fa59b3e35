"""`raypipe bench attention`: decode attention over the paged pool, the engine's way against FlexAttention's.

Issue 41 asked for attention that does not copy every row's blocks each round, chosen by measurement
against a maintained paged kernel. On a CPU the candidates are the engine's own (each round gathers
its rows' blocks once into contiguous rows, `decode/paged_attention.py`, then every step runs torch's
SDPA over them) and torch's FlexAttention reading the pool in place: the pool as one long sequence of
physical token slots, a `BlockMask` built from the rows' page tables (each query row sees its own
slots below its length), compiled by inductor (FlexAttention has no eager CPU kernel worth timing).

At the attention shape of `--model` (default `small`: 8 query heads, 2 KV heads, head size 64), 32
rows, 320-token tables with lengths 160-319, an 8-step round, this prints per decode step: the
round's gather (amortized over its 8 steps), SDPA, FlexAttention, the ratio, the seconds to build
one round's block mask and to compile, and the largest difference between the two outputs.
"""

from __future__ import annotations

import time

ROWS, TABLE_TOKENS, BLOCK_SIZE, ROUND_STEPS = 32, 320, 16, 8


def median_ms(fn, calls: int = 50, repeats: int = 5) -> float:
    """Median over `repeats` samples of the mean milliseconds per call of `calls` calls, after a warm-up."""
    from raypipe.bench.common import median_seconds

    return median_seconds(lambda: [fn() for _ in range(calls)], repeats, warmup=5) / calls * 1e3


def main(args) -> int:
    import os

    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from raypipe.bench.common import emit, print_table
    from raypipe.models.registry import language_adapter, resolve_model

    text = language_adapter(resolve_model(args.model or "small")).text_config
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    torch.manual_seed(0)
    table_blocks = TABLE_TOKENS // BLOCK_SIZE
    num_blocks = ROWS * table_blocks + 1  # block 0: the null block
    keys, values = (torch.randn(num_blocks, BLOCK_SIZE, kv_heads, dim) for _ in range(2))
    tables = (torch.randperm(num_blocks - 1)[: ROWS * table_blocks] + 1).view(ROWS, table_blocks)
    lengths = torch.randint(TABLE_TOKENS // 2, TABLE_TOKENS, (ROWS,))
    query = torch.randn(ROWS, heads, 1, dim)

    def gather():  # what a round does once: every row's blocks, in table order
        return [pool.index_select(0, tables.view(-1)).view(ROWS, TABLE_TOKENS, kv_heads, dim).transpose(1, 2)
                for pool in (keys, values)]

    row_keys, row_values = gather()
    mask = torch.where(torch.arange(TABLE_TOKENS) < lengths[:, None], 0.0, float("-inf"))[:, None, None, :]

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(query, row_keys, row_values, attn_mask=mask,
                                                                enable_gqa=True)

    slots = (tables[:, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).view(ROWS, TABLE_TOKENS)
    owner = torch.full((num_blocks * BLOCK_SIZE,), -1)  # physical slot -> its row, and its position there
    owner.scatter_(0, slots.view(-1), torch.arange(ROWS).repeat_interleave(TABLE_TOKENS))
    position = torch.zeros(num_blocks * BLOCK_SIZE, dtype=torch.long)
    position.scatter_(0, slots.view(-1), torch.arange(TABLE_TOKENS).repeat(ROWS))

    def own_slots(b, h, q, kv):
        return (owner[kv] == b) & (position[kv] < lengths[b])

    start = time.perf_counter()
    block_mask = create_block_mask(own_slots, ROWS, None, 1, num_blocks * BLOCK_SIZE, device="cpu")
    mask_s = time.perf_counter() - start
    flat_keys, flat_values = (pool.view(-1, kv_heads, dim).transpose(0, 1)[None].expand(ROWS, -1, -1, -1)
                              for pool in (keys, values))
    flex = torch.compile(flex_attention, dynamic=False)

    def paged_flex():
        return flex(query, flat_keys, flat_values, block_mask=block_mask, enable_gqa=True)

    start = time.perf_counter()
    difference = (paged_flex() - sdpa()).abs().max().item()
    compile_s = time.perf_counter() - start
    load_before = os.getloadavg()
    gather_ms, sdpa_ms, flex_ms = median_ms(gather), median_ms(sdpa), median_ms(paged_flex)
    engine_ms = sdpa_ms + gather_ms / ROUND_STEPS
    result = {"heads": heads, "kv_heads": kv_heads, "head_dim": dim, "rows": ROWS, "table_tokens": TABLE_TOKENS,
              "threads": torch.get_num_threads(), "gather_ms_per_round": gather_ms, "sdpa_ms": sdpa_ms,
              "engine_ms_per_step": engine_ms, "flex_ms_per_step": flex_ms, "flex_over_engine": flex_ms / engine_ms,
              "block_mask_s": mask_s, "compile_s": compile_s, "max_difference": difference,
              "load_average": [load_before, os.getloadavg()]}

    def describe(result: dict, path) -> None:
        print_table(f"decode attention per step, {ROWS} rows x {TABLE_TOKENS}-token tables, {heads}/{kv_heads} heads "
                    f"x {dim}, {result['threads']} threads; load average {result['load_average'][0][0]:.2f} -> "
                    f"{result['load_average'][1][0]:.2f}",
                    ["path", "ms per step"],
                    [[f"round gather ({ROUND_STEPS} steps) / {ROUND_STEPS}", gather_ms / ROUND_STEPS],
                     ["SDPA over the gathered rows", sdpa_ms], ["engine (gather share + SDPA)", engine_ms],
                     ["FlexAttention over the pool (compiled)", flex_ms]])
        print(f"FlexAttention / engine: {result['flex_over_engine']:.2f}x; one round's block mask "
              f"{result['block_mask_s']:.2f} s; compile + first call {result['compile_s']:.1f} s; largest "
              f"difference {result['max_difference']:.1e}\n(JSON: {path})")

    return emit(args, "attention", result, describe)
