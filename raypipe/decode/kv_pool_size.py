"""How many blocks the paged KV pool gets, and the refusal of a pool too small for one sequence.

The pool is sized once, when the engine starts: `EngineConfig.kv_cache_memory` bytes if given; else on
CUDA `kv_cache_free_memory_fraction` of the device memory free once the weights are loaded; else (CPU)
room for `max_num_seqs` sequences of `max_model_len` tokens, each in whole blocks (a sequence of 24
tokens takes two 16-token blocks, not 1.5; there the budget grows by the snapshots' share below). A
model with per-row state (linear attention, sliding window) and prefix caching gives `state_fraction`
of the bytes to state snapshots (`snapshot_pool.py`); the rest become whole blocks, rounded down,
plus the null block.

A pool that cannot hold one `max_model_len` sequence is refused at start (vLLM refuses the same way,
naming the largest model length that would fit), not request by request: otherwise requests that
`max_model_len` admits would be refused (or, alone in the engine, run out of blocks with nobody to
preempt) depending on their length.
"""

from __future__ import annotations

import math

import torch


def pool_blocks(*, device: torch.device, bytes_per_token: int, block_size: int, max_num_seqs: int,
                max_model_len: int, kv_cache_memory: int | None, kv_cache_free_memory_fraction: float,
                state_fraction: float = 0.0) -> tuple[int, int]:
    """Blocks of the paged pool (the null block included) and the bytes left to state snapshots;
    `ValueError` if one `max_model_len` sequence would not fit in the blocks."""
    block_bytes = max(bytes_per_token * block_size, 1)
    sequence_bytes = -(-max_model_len // block_size) * block_bytes  # one max_model_len sequence, whole blocks
    if kv_cache_memory is not None:
        source = f"EngineConfig.kv_cache_memory = {kv_cache_memory} bytes"
    elif device.type == "cuda":  # after the weights are loaded
        kv_cache_memory = int(torch.cuda.mem_get_info(device)[0] * kv_cache_free_memory_fraction)
        source = (f"EngineConfig.kv_cache_free_memory_fraction = {kv_cache_free_memory_fraction} of the free "
                  f"device memory: {kv_cache_memory} bytes")
    else:  # the blocks for that many sequences, and the snapshots' share on top
        kv_cache_memory = math.ceil(max_num_seqs * sequence_bytes / (1 - state_fraction))
        source = f"max_num_seqs x max_model_len = {max_num_seqs} x {max_model_len} tokens"
    state_bytes = int(kv_cache_memory * state_fraction)
    if state_bytes:
        source += f", {state_fraction:g} of it for state snapshots"
    num_blocks = (kv_cache_memory - state_bytes) // block_bytes + 1
    holds = (num_blocks - 1) * block_size
    if holds < max_model_len:
        shorter = f" or lower EngineConfig.max_model_len to at most {holds}" if holds >= 2 else ""
        raise ValueError(f"the KV cache ({source}) holds {holds} tokens in blocks of {block_size}, fewer than "
                         f"one sequence of EngineConfig.max_model_len = {max_model_len} tokens needs "
                         f"({sequence_bytes} bytes): raise EngineConfig.kv_cache_memory to at least "
                         f"{math.ceil(sequence_bytes / (1 - state_fraction))} bytes (on CUDA, or "
                         f"kv_cache_free_memory_fraction){shorter}")
    return num_blocks, state_bytes
