"""`SnapshotPool`: which state snapshots exist, who holds them, and which full-attention block each ends on.

A model with bounded per-row state (gated-delta-net conv + recurrent state; `cache_kinds.py`) cannot continue from cached K/V blocks alone: the rows' state at the hit point
must be restored too. A snapshot is a copy of one sequence's row state (every row-state layer's
`row_tensors`) taken when it had consumed exactly `P` tokens, `P` a multiple of the block size,
and registered under the prefix hash of the block ending at `P` (`prefix_hash.py`: the hash chains
every token and visual item before it). So a snapshot is found only by a prompt whose first `P`
tokens are the same tokens and items, and it is only ever restored at position `P`: the hash of a
different position is a different key. The storage (`slots` tensors per layer) lives in
`kv_cache.py`; this class hands out slot ids, as `block_pool.py` hands out block ids.

Slots are reference counted like blocks: a sequence holds a slot from the moment it is given one to
fill (until the fill is registered or dropped) or from a hit until the restore has been copied into
its row. A registered slot nobody holds sits in an LRU; `allocate` takes a never-used slot first,
else evicts the least recently used registered one. A snapshot is useless without its blocks, so
when the block pool evicts a block, the snapshot tied to it goes too (`drop`): blocks and snapshots
leave the cache together.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class SnapshotPool:
    def __init__(self, num_slots: int, slot_bytes: int):
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.refs = [0] * num_slots
        self.free: deque[int] = deque(range(num_slots))
        self.cached: dict[bytes, int] = {}  # block hash -> slot
        self.hash_of: dict[int, bytes] = {}  # slot -> block hash, for registered slots
        self.unreferenced: OrderedDict[int, None] = OrderedDict()  # registered, nobody holds them, oldest first
        self.counters = dict(snapshots_taken=0, snapshot_hits=0, snapshot_evictions=0)

    def allocate(self) -> int | None:
        """A slot to fill, held once; None when every slot is held."""
        if self.free:
            slot = self.free.popleft()
        elif self.unreferenced:
            slot, _ = self.unreferenced.popitem(last=False)
            del self.cached[self.hash_of.pop(slot)]
            self.counters["snapshot_evictions"] += 1
        else:
            return None
        self.refs[slot] = 1
        return slot

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self.cached

    def take(self, block_hash: bytes) -> int:
        """The slot registered under `block_hash`, held once more (KeyError if none is)."""
        slot = self.cached[block_hash]
        if self.refs[slot] == 0:
            del self.unreferenced[slot]
        self.refs[slot] += 1
        self.counters["snapshot_hits"] += 1
        return slot

    def register(self, slot: int, block_hash: bytes) -> None:
        """The held slot `slot` now holds the state at the end of block `block_hash`; the holder lets go.
        If that state is registered already (another sequence got there first), the slot is freed."""
        if block_hash in self.cached or slot in self.hash_of:
            self.release(slot)
            return
        self.cached[block_hash] = slot
        self.hash_of[slot] = block_hash
        self.counters["snapshots_taken"] += 1
        self.release(slot)

    def release(self, slot: int) -> None:
        self.refs[slot] -= 1
        if self.refs[slot] < 0:
            raise RuntimeError(f"snapshot slot {slot} released more often than taken")
        if self.refs[slot] == 0:
            if slot in self.hash_of:
                self.unreferenced[slot] = None
            else:
                self.free.append(slot)

    def drop(self, block_hash: bytes) -> None:
        """The block `block_hash` left the prefix cache: forget its snapshot unless someone holds it."""
        slot = self.cached.get(block_hash)
        if slot is not None and self.refs[slot] == 0:
            del self.cached[block_hash], self.hash_of[slot], self.unreferenced[slot]
            self.free.append(slot)
            self.counters["snapshot_evictions"] += 1

    @property
    def num_held(self) -> int:
        return sum(1 for r in self.refs if r)

    def stats(self) -> dict:
        return {"state_snapshots_total": self.num_slots, "state_snapshots_cached": len(self.cached),
                "state_snapshots_held": self.num_held, "state_snapshot_bytes": self.slot_bytes, **self.counters}
