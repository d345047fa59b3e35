"""Sliding-window layers over a paged pool of their own: K/V in blocks, blocks freed as they leave the window.

transformers' sliding layers (Step3's `sliding_attention`) let position q attend to keys k with
`q - window < k <= q`. So a sequence's sliding layers need only the blocks that hold its last
`window` positions (and the ones the round is about to write); older blocks can go back.

Why a pool and block table of their own (`Sequence.window_table`, `scheduler.py`'s window pool)
and not the full-attention table: a block id of the full-attention pool holds one token range in
every full-attention layer, which must stay as long as the sequence does. Had sliding layers kept
their K/V under the same ids, a block leaving the window could not be freed while the full layers
still need it, and sliding memory would grow with the sequence like full attention. vLLM's hybrid
KV cache manager keeps one block table per group of layers of one kind for the same reason
(`SlidingWindowManager` frees, and replaces by the null block, the blocks before the window). Here
each sliding layer's storage has `CacheLimits.window_blocks` blocks; a window-table entry is a block
id of that pool, or the null block for a block that has left the window (masked, never read as a
key the window sees).

Reads and writes go through the window tables exactly as full attention goes through its tables
(`WritePattern.window_slots` / `window_blocks`, same widths and token slots), and a decode round
gathers the rows' window blocks once like full attention (`PagedAttentionLayer.begin_round`). Only
the masks differ: they add `q - k < window`. A prefix hit (`scheduler.py`) needs, besides the
full-attention blocks, the window blocks before the hit point to be still cached.
"""

from __future__ import annotations

import torch

from raypipe.decode.cache_kinds import CacheLimits, WritePattern, additive
from raypipe.decode.paged_attention import PagedAttentionLayer


class SlidingWindowBlocks(PagedAttentionLayer):
    layer_type = "sliding_attention"
    continues_rounds = False  # a window's blocks change as it slides: every round gathers

    def __init__(self, text_config, limits: CacheLimits):
        self.window = text_config.sliding_window
        super().__init__(text_config, limits, num_blocks=limits.window_blocks)

    @staticmethod
    def access(pattern: WritePattern) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return pattern.window_slots, pattern.window_blocks

    def prefill_mask(self, pattern, width, dtype):
        """Full attention's prefill mask, restricted to keys inside each query's window."""
        pos = torch.arange(width, device=pattern.starts.device)
        if not pattern.has_past:  # the chunk's own fresh keys, key index = position
            allowed = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < self.window)
            allowed = allowed[None] & (pos[None, None, :] < pattern.lengths[:, None, None])
            return additive(allowed[:, None], dtype)
        query = pattern.starts[:, None] + pos[None, :]
        key = torch.arange(pattern.kv_len, device=pattern.starts.device)
        ends = pattern.starts + pattern.lengths
        allowed = ((key[None, None, :] <= query[:, :, None]) & (key[None, None, :] < ends[:, None, None])
                   & (query[:, :, None] - key[None, None, :] < self.window))
        return additive(allowed[:, None], dtype)

    def decode_mask(self, pattern, dtype):
        pos = torch.arange(pattern.kv_len, device=pattern.write_index.device)
        newest = pattern.write_index[:, None]
        allowed = (pos[None, :] <= newest) & (newest - pos[None, :] < self.window)
        return additive(allowed[:, None, None], dtype)


def window_bytes_per_token(text_config, dtype: torch.dtype) -> int:
    """K/V bytes one token takes in the window pool (every sliding layer)."""
    sliding = list(getattr(text_config, "layer_types", None) or []).count(SlidingWindowBlocks.layer_type)
    return sliding * PagedAttentionLayer.bytes_per_token(text_config, dtype)


def window_pool_shape(text_config, *, block_size: int, max_model_len: int, num_scheduler_steps: int,
                      max_num_batched_tokens: int) -> dict[str, int]:
    """What the window pool is sized by (`kv_pool_size.pool_blocks`): the window blocks one decoding
    sequence holds at most (the window's keys before its next token and the round's K new ones, from
    any offset inside a block), and the blocks one prefill chunk of a round writes beyond a window."""
    window = getattr(text_config, "sliding_window", None) or 0
    return dict(window_blocks_per_seq=-(-(window - 1 + num_scheduler_steps) // block_size) + 1,
                window_headroom_blocks=-(-min(max_num_batched_tokens, max_model_len) // block_size))
