"""`raypipe bench attention`: decode attention over the paged pool, the engine's ways against FlexAttention's.

Issue 41 asked for attention that does not copy every row's blocks each round, chosen by measurement
against a maintained paged kernel. The engine's two ways read the pool by gather (`decode/paged_attention.py`):
an eager round copies its rows' blocks once into contiguous rows and its steps run attention over them; a
static-shape step (compiled on a CPU, a CUDA graph on a GPU) gathers every step. The candidate reads the
pool in place: torch's FlexAttention over the pool as one long sequence of physical token slots, with a
`BlockMask` built from the rows' page tables (each query row sees its own slots below its length), compiled
by inductor (C++ on a CPU, Triton on a GPU). Its mask blocks are 128 slots by default, so a row whose 16-slot
pages lie scattered over the pool makes it read whole 128-slot blocks around each page; the bench also tries
mask blocks of one page, and records the error where the kernel refuses them.

At the attention shape of `--model` (default `small`: 8 query heads, 2 KV heads, head size 64), on the CUDA
device where there is one (bf16; fp32 on a CPU), for rows x table tokens (lengths half the table to all of
it), this prints milliseconds per decode step of each path, FlexAttention's over the faster gather path, the
seconds to build one round's block mask and to compile, and the largest difference from SDPA's output. A GPU's
times include launches, with 50 calls queued per sample.
"""

from __future__ import annotations

import os
import time

BLOCK_SIZE, ROUND_STEPS = 16, 8
SHAPES = {"cpu": ((32, 320),), "cuda": ((32, 320), (64, 2048), (128, 4096))}  # (rows, table tokens)
FLEX_MASK_BLOCKS = (128, BLOCK_SIZE)  # FlexAttention's default mask block, and one page


def median_ms(fn, device, calls: int = 50, repeats: int = 5) -> float:
    """Median over `repeats` samples of the mean milliseconds per call of `calls` calls, after a warm-up."""
    import torch

    from raypipe.bench.common import median_seconds

    def sample():
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()

    return median_seconds(sample, repeats, warmup=2) / calls * 1e3


def one_shape(rows: int, table_tokens: int, heads: int, kv_heads: int, dim: int, device, dtype) -> dict:
    """Every path's ms per step at one shape; a FlexAttention variant the kernel refuses carries its error."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    table_blocks = table_tokens // BLOCK_SIZE
    num_blocks = rows * table_blocks + 1  # block 0: the null block
    keys, values = (torch.randn(num_blocks, BLOCK_SIZE, kv_heads, dim, device=device, dtype=dtype) for _ in range(2))
    tables = (torch.randperm(num_blocks - 1, device=device)[: rows * table_blocks] + 1).view(rows, table_blocks)
    lengths = torch.randint(table_tokens // 2, table_tokens + 1, (rows,), device=device)
    query = torch.randn(rows, heads, 1, dim, device=device, dtype=dtype)
    mask = torch.where(torch.arange(table_tokens, device=device) < lengths[:, None], 0.0,
                       float("-inf")).to(dtype)[:, None, None, :]

    def gather():  # every row's blocks, in table order
        return [pool.index_select(0, tables.view(-1)).view(rows, table_tokens, kv_heads, dim).transpose(1, 2)
                for pool in (keys, values)]

    row_keys, row_values = gather()

    def sdpa(k=row_keys, v=row_values):
        return torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, enable_gqa=True)

    reference = sdpa()
    gather_ms, sdpa_ms = median_ms(gather, device), median_ms(sdpa, device)
    result = {"rows": rows, "table_tokens": table_tokens, "gather_ms": gather_ms, "sdpa_ms": sdpa_ms,
              "round_gather_ms_per_step": sdpa_ms + gather_ms / ROUND_STEPS,
              "step_gather_ms_per_step": sdpa_ms + gather_ms, "flex": []}

    slots = (tables[:, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=device)).view(rows, table_tokens)
    owner = torch.full((num_blocks * BLOCK_SIZE,), -1, device=device)  # physical slot -> its row, its position
    owner.scatter_(0, slots.view(-1), torch.arange(rows, device=device).repeat_interleave(table_tokens))
    position = torch.zeros(num_blocks * BLOCK_SIZE, dtype=torch.long, device=device)
    position.scatter_(0, slots.view(-1), torch.arange(table_tokens, device=device).repeat(rows))

    def own_slots(b, h, q, kv):
        return (owner[kv] == b) & (position[kv] < lengths[b])

    flat_keys, flat_values = (pool.view(-1, kv_heads, dim).transpose(0, 1)[None].expand(rows, -1, -1, -1)
                              for pool in (keys, values))
    for mask_block in FLEX_MASK_BLOCKS:
        row = {"mask_block": mask_block}
        try:
            start = time.perf_counter()
            block_mask = create_block_mask(own_slots, rows, None, 1, num_blocks * BLOCK_SIZE, device=device.type,
                                           BLOCK_SIZE=(128, mask_block))
            if device.type == "cuda":
                torch.cuda.synchronize()
            row["block_mask_s"] = time.perf_counter() - start
            # A mask block below the kernel's KV tile needs a tile of its size (Triton's BLOCK_N).
            options = {"BLOCK_N": mask_block} if device.type == "cuda" and mask_block < 64 else None
            flex = torch.compile(flex_attention, dynamic=False)

            def paged_flex():
                return flex(query, flat_keys, flat_values, block_mask=block_mask, enable_gqa=True,
                            kernel_options=options)

            start = time.perf_counter()
            row["max_difference"] = (paged_flex().float() - reference.float()).abs().max().item()
            row["compile_s"] = time.perf_counter() - start
            row["ms_per_step"] = median_ms(paged_flex, device)
            row["over_best_gather"] = row["ms_per_step"] / min(result["round_gather_ms_per_step"],
                                                                result["step_gather_ms_per_step"])
        except Exception as exc:  # noqa: BLE001 - a refused variant is a finding, reported beside the others
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        result["flex"].append(row)
    return result


def main(args) -> int:
    import torch

    from raypipe.bench.common import emit, print_table
    from raypipe.models.registry import language_adapter, resolve_model

    text = language_adapter(resolve_model(args.model or "small")).text_config
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = SHAPES[device.type][:1] if args.quick else SHAPES[device.type]
    load_before = os.getloadavg()
    shapes_out = [one_shape(rows, tokens, heads, kv_heads, dim, device, dtype) for rows, tokens in shapes]
    result = {"heads": heads, "kv_heads": kv_heads, "head_dim": dim, "device": device.type,
              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "dtype": str(dtype),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "shapes": shapes_out,
              "load_average": [load_before, os.getloadavg()]}

    def describe(result: dict, path) -> None:
        table = []
        for shape in result["shapes"]:
            flex = {f"flex_{r['mask_block']}": r.get("ms_per_step", "refused") for r in shape["flex"]}
            table.append([shape["rows"], shape["table_tokens"], shape["round_gather_ms_per_step"],
                          shape["step_gather_ms_per_step"], *flex.values()])
        where = result["gpu"] or f"CPU, {result['threads']} threads"
        print_table(f"decode attention, ms per step, {result['heads']}/{result['kv_heads']} heads x "
                    f"{result['head_dim']}, {result['dtype']}, {where}; load average "
                    f"{result['load_average'][0][0]:.2f} -> {result['load_average'][1][0]:.2f}",
                    ["rows", "table tokens", f"round gather / {ROUND_STEPS} + SDPA", "gather every step + SDPA",
                     *(f"Flex, {b}-slot mask blocks" for b in FLEX_MASK_BLOCKS)], table)
        for shape in result["shapes"]:
            for r in shape["flex"]:
                if "error" in r:
                    print(f"{shape['rows']} x {shape['table_tokens']}, Flex {r['mask_block']}-slot blocks: {r['error']}")
                else:
                    print(f"{shape['rows']} x {shape['table_tokens']}, Flex {r['mask_block']}-slot blocks: "
                          f"{r['over_best_gather']:.2f}x the faster gather path; block mask {r['block_mask_s']:.2f} s; "
                          f"compile + first call {r['compile_s']:.1f} s; largest difference {r['max_difference']:.1e}")
        print(f"(JSON: {path})")

    return emit(args, "attention", result, describe)
