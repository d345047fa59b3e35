"""How many blocks the paged KV pools get, and the refusal of a pool too small for one sequence.

The pools are sized once, when the engine starts: `EngineConfig.kv_cache_memory` bytes if given; else on
CUDA `kv_cache_free_memory_fraction` of the device memory free once the weights are loaded; else (CPU)
room for `max_num_seqs` sequences of `max_model_len` tokens, each in whole blocks (a sequence of 24
tokens takes two 16-token blocks, not 1.5; there the budget grows by the snapshots' share below). A
model with per-row state (linear attention) and prefix caching gives `state_fraction` of the bytes to
state snapshots (`snapshot_pool.py`); the rest become whole blocks, rounded down, plus the null block.

A model with sliding-window layers (`sliding_window.py`) splits those blocks' bytes between two
pools: the full-attention pool and the window pool. One running sequence needs `seq_blocks` full
blocks at most (`max_model_len`) but only `window_blocks_per_seq` window blocks (its window and a
round's decode steps), so the budget buys full blocks and window blocks in that ratio: the window
pool holds as many windows as the full pool holds `max_model_len` sequences (so cached windows last
about as long as cached prefixes do), plus `window_headroom_blocks` for the one prefill chunk of a
round that writes more than a window (the chunk's tokens before the window are written to be cached,
then freed).

A pool that cannot hold one `max_model_len` sequence is refused at start (vLLM refuses the same way,
naming the largest model length that would fit), not request by request: otherwise requests that
`max_model_len` admits would be refused (or, alone in the engine, run out of blocks with nobody to
preempt) depending on their length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PoolShape:
    """A runner's pools as sized: full-attention blocks and window blocks (null blocks included) and state
    snapshot slots. A decode group's other ranks take rank 0's (on CUDA free memory differs per device)."""

    num_blocks: int
    window_blocks: int
    num_snapshots: int


def pool_blocks(*, device: torch.device, bytes_per_token: int, block_size: int, max_num_seqs: int,
                max_model_len: int, kv_cache_memory: int | None, kv_cache_free_memory_fraction: float,
                state_fraction: float = 0.0, window_bytes_per_token: int = 0, window_blocks_per_seq: int = 0,
                window_headroom_blocks: int = 0) -> tuple[int, int, int]:
    """Blocks of the paged pool (the null block included), the bytes left to state snapshots and the
    window pool's blocks (null block included; 0 without sliding layers); `ValueError` if one
    `max_model_len` sequence would not fit in the blocks."""
    block_bytes = max(bytes_per_token * block_size, 1)
    seq_blocks = -(-max_model_len // block_size)
    window_block_bytes = window_bytes_per_token * block_size
    # bytes of `seq_blocks` full blocks with their window share, and of the chunk headroom
    unit = seq_blocks * block_bytes + window_blocks_per_seq * window_block_bytes
    headroom = window_headroom_blocks * window_block_bytes if window_block_bytes else 0
    sequence_bytes = unit + headroom  # one max_model_len sequence, whole blocks
    if kv_cache_memory is not None:
        source = f"EngineConfig.kv_cache_memory = {kv_cache_memory} bytes"
    elif device.type == "cuda":  # after the weights are loaded
        kv_cache_memory = int(torch.cuda.mem_get_info(device)[0] * kv_cache_free_memory_fraction)
        source = (f"EngineConfig.kv_cache_free_memory_fraction = {kv_cache_free_memory_fraction} of the free "
                  f"device memory: {kv_cache_memory} bytes")
    else:  # the blocks for that many sequences, and the snapshots' share on top
        kv_cache_memory = math.ceil((max_num_seqs * unit + headroom) / (1 - state_fraction))
        source = f"max_num_seqs x max_model_len = {max_num_seqs} x {max_model_len} tokens"
    state_bytes = int(kv_cache_memory * state_fraction)
    if state_bytes:
        source += f", {state_fraction:g} of it for state snapshots"
    full = max(kv_cache_memory - state_bytes - headroom, 0) * seq_blocks // unit
    num_blocks = full + 1
    window_blocks = -(-full * window_blocks_per_seq // seq_blocks) + window_headroom_blocks + 1 if window_block_bytes else 0
    holds = (num_blocks - 1) * block_size
    if holds < max_model_len:
        shorter = f" or lower EngineConfig.max_model_len to at most {holds}" if holds >= 2 else ""
        raise ValueError(f"the KV cache ({source}) holds {holds} tokens in blocks of {block_size}, fewer than "
                         f"one sequence of EngineConfig.max_model_len = {max_model_len} tokens needs "
                         f"({sequence_bytes} bytes): raise EngineConfig.kv_cache_memory to at least "
                         f"{math.ceil(sequence_bytes / (1 - state_fraction))} bytes (on CUDA, or "
                         f"kv_cache_free_memory_fraction){shorter}")
    return num_blocks, state_bytes, window_blocks


def budget_for(full_blocks: int, *, bytes_per_token: int, block_size: int, max_model_len: int,
               state_fraction: float = 0.0, window_bytes_per_token: int = 0, window_blocks_per_seq: int = 0,
               window_headroom_blocks: int = 0) -> int:
    """The smallest `kv_cache_memory` for which `pool_blocks` gives `full_blocks` full-attention blocks
    (the null block not counted): what a caller who wants a pool of that size asks for."""
    seq_blocks = -(-max_model_len // block_size)
    window_block_bytes = window_bytes_per_token * block_size
    unit = seq_blocks * max(bytes_per_token * block_size, 1) + window_blocks_per_seq * window_block_bytes
    blocks_bytes = -(-full_blocks * unit // seq_blocks) + window_headroom_blocks * window_block_bytes
    budget = math.ceil(blocks_bytes / (1 - state_fraction))
    while int(budget * state_fraction) > budget - blocks_bytes:  # the snapshots' share is rounded down
        budget += 1
    return budget
