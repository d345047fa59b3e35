"""`BlockPool`: the paged KV cache's fixed-size blocks, who holds them, and which are cached prefixes.

A block holds `block_size` tokens' K/V in every full-attention layer (the storage itself lives in
`paged_attention.py`; this class only hands out block ids). A sequence's block table is the list
of ids it holds, in token order. Blocks are reference counted: a block whose tokens equal a prefix
of another request's prompt (same hash, `prefix_hash.py`) is shared, not copied.

Automatic prefix caching: a full block of computed tokens is registered under its hash. When its
last holder lets go, a registered block is not freed but parked in an LRU of cached blocks; a new
request that asks for the same hash takes it back (one more reference) and skips computing those
tokens. Allocation takes never-cached free blocks first and evicts the least recently released
cached block when there are none. So `num_available` (free + cached, unreferenced) is what a
sequence can still get. `on_evict(hash)` hears of each eviction (the state snapshot tied to that
block, `snapshot_pool.py`, leaves with it).

Block 0 is the null block: never handed out, it is where writes go that no sequence will read
(decode steps past a row's end, padding rows of a static-shape step), and what padding entries of
a block table point to.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks  # the null block included
        self.block_size = block_size
        self.refs = [0] * num_blocks
        self.free: deque[int] = deque(range(1, num_blocks))  # never cached, or evicted
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.hash_of: dict[int, bytes] = {}  # block id -> its hash, for registered blocks
        self.unreferenced: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest first
        self.evictions = 0
        self.on_evict: Callable[[bytes], None] | None = None

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool can hold for one sequence (every block but the null block)."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def num_available(self) -> int:
        return len(self.free) + len(self.unreferenced)

    @property
    def num_used(self) -> int:
        """Blocks some sequence holds."""
        return self.num_blocks - 1 - self.num_available

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks with one reference each (evicting cached blocks if needed)."""
        if n > self.num_available:
            raise RuntimeError(f"block pool exhausted: {n} blocks asked, {self.num_available} available")
        out = []
        for _ in range(n):
            if self.free:
                block = self.free.popleft()
            else:
                block, _ = self.unreferenced.popitem(last=False)
                evicted = self.hash_of.pop(block)
                del self.cached[evicted]
                self.evictions += 1
                if self.on_evict is not None:
                    self.on_evict(evicted)
            self.refs[block] = 1
            out.append(block)
        return out

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block. Last-to-first, so a sequence's tail blocks (the least
        likely to be shared again) are evicted before its head."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] < 0:
                raise RuntimeError(f"block {block} released more often than taken")
            if self.refs[block] == 0:
                if block in self.hash_of:
                    self.unreferenced[block] = None
                else:
                    self.free.append(block)

    def take_cached(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest run of `hashes` (from the first) that is cached, one reference each."""
        out = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            if self.refs[block] == 0:
                del self.unreferenced[block]
            self.refs[block] += 1
            out.append(block)
        return out

    def register(self, block: int, block_hash: bytes) -> None:
        """Record that full block `block` holds the tokens of `block_hash` (a no-op if that content is
        cached already, in this block or another one)."""
        if block in self.hash_of or block_hash in self.cached:
            return
        self.cached[block_hash] = block
        self.hash_of[block] = block_hash

    def stats(self) -> dict:
        return {"kv_blocks_total": self.num_blocks - 1, "kv_blocks_used": self.num_used,
                "kv_blocks_cached": len(self.cached), "kv_block_size": self.block_size,
                "kv_cache_evictions": self.evictions}
