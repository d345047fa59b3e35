"""`WindowTables`: which blocks of the window pool each sequence's sliding-window layers hold.

A sliding layer's query at position q sees keys `q - window < k <= q` (`sliding_window.py`). A
sequence's window table has one entry per block of its tokens, like its full-attention block table,
but entries of blocks whose every position has left the window of the next query are given back
to the window pool (`trim`) and replaced by the null block. Blocks are registered under the same
prefix hashes as full-attention blocks before they go, so a released block stays cached in the
window pool's LRU until it is evicted.

A prefix hit of `L` blocks needs, besides full-attention blocks `0..L-1`, the window blocks the
first uncached query (position `L * block_size`) sees: blocks `first_needed(L * block_size)..L-1`.
The blocks before those are never read again, so a hit takes none of them (`cached_before` says
whether an `L` has them; vLLM's `SlidingWindowManager` finds its hits by the same rule, scanning for a
run of cached blocks as long as the window right before the hit point).
"""

from __future__ import annotations

from raypipe.decode.block_pool import NULL_BLOCK, BlockPool
from raypipe.decode.sequence import Sequence


class WindowTables:
    def __init__(self, pool: BlockPool, window: int):
        self.pool = pool
        self.window = window

    def first_needed(self, position: int) -> int:
        """The first block the query at `position` reads (keys after `position - window`)."""
        return max(position - self.window + 1, 0) // self.pool.block_size

    def cached_before(self, hashes: list[bytes], length: int) -> bool:
        """Whether the window blocks a hit of `length` blocks needs are cached."""
        first = self.first_needed(length * self.pool.block_size)
        return all(h in self.pool.cached for h in hashes[first:length])

    def take_hit(self, seq: Sequence, hashes: list[bytes], length: int) -> None:
        """`seq`'s window table for a hit of `length` blocks: the cached window blocks before it, referenced."""
        first = self.first_needed(length * self.pool.block_size)
        seq.window_table = [NULL_BLOCK] * first + self.pool.take_cached(hashes[first:length])

    def need(self, seq: Sequence, num_tokens: int) -> int:
        return self.pool.blocks_for(num_tokens) - len(seq.window_table)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.need(seq, num_tokens)
        if need > 0:
            seq.window_table += self.pool.allocate(need)

    def register(self, seq: Sequence, block: int, block_hash: bytes) -> None:
        if block < len(seq.window_table) and seq.window_table[block] != NULL_BLOCK:
            self.pool.register(seq.window_table[block], block_hash)

    def trim(self, seq: Sequence) -> None:
        """Give back `seq`'s blocks that the query at `seq.num_computed` (its next token) no longer sees."""
        out = self.first_needed(seq.num_computed)
        leaving = [b for b in seq.window_table[:out] if b != NULL_BLOCK]
        if leaving:
            self.pool.release(leaving)
            seq.window_table[:out] = [NULL_BLOCK] * min(out, len(seq.window_table))

    def release(self, seq: Sequence) -> None:
        self.pool.release([b for b in seq.window_table if b != NULL_BLOCK])
        seq.window_table = []
