"""LRU cache of image embeddings keyed by image content hash, bounded by bytes.

Values are Ray `ObjectRef`s, not tensors: a hit hands out the same stored object (no copy through
the process holding the cache), and the byte budget counts what those objects hold in the store.
"""

from __future__ import annotations

import collections
import threading
from typing import Any


class EmbeddingCache:
    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"cache max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[str, tuple[Any, int]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, key: str):
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: str, value, nbytes: int) -> None:
        if nbytes > self.max_bytes:
            return  # would evict everything else and still not fit
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            self._entries[key] = (value, nbytes)
            self.bytes += nbytes
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.bytes -= dropped
                self.evictions += 1

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict:
        lookups = self.hits + self.misses
        return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes,
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "hit_rate": self.hits / lookups if lookups else 0.0}
