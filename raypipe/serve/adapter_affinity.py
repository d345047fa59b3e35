"""Which Decoder replicas already hold a request's LoRA adapter: the rule `PrefixAffinityRouter` applies after the prefix.

A replica serves an adapter loaded while the app runs only after reading it (`serve/decoder.py` reads it
lazily on the first request that names it: a file or object-storage read, then a device slot), and an
adapter in use keeps one of the replica's `max_loras` slots. Sending an adapter's new conversations where it
was sent before reads it once per app instead of once per replica, and keeps the other replicas' slots for
other adapters: Ray Serve's model multiplexing makes the same choice (a multiplexed model id goes to a
replica that has it loaded, while one is not overloaded).

The rule, for a request under adapter key k (`LoraRef.routing_key`: its weights' fingerprint, or its name):
  1. the replicas this router sent k to, least recently used forgotten first (`max_tracked_adapters` each);
  2. of those, the ones whose queue exceeds the shortest queue of all candidates by at most
     `overload_threshold` (the prefix rule's own bound: waiting longer costs more than a read);
  3. none left: no affinity, the caller falls back to queue length (and the replica it picks reads k).
It runs after the prefix rule: a request that continues a conversation follows its blocks, which were
computed under the same adapter (the block keys chain from k). Like the prefix rule it is a hint kept per
router, never a promise: a wrong guess costs a read, never a wrong answer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping

from raypipe.serve.prefix_affinity import retain_replicas


class AdapterAffinity:
    """Per replica, an LRU of the adapter keys routed there; `holders` applies the module's rule."""

    def __init__(self, overload_threshold: int, max_tracked_adapters: int):
        self.overload_threshold = overload_threshold
        self.max_tracked_adapters = max_tracked_adapters
        self.adapters: dict[Hashable, OrderedDict[str, None]] = {}

    def holders(self, key: str, queue_lens: Mapping[Hashable, int]) -> list[Hashable]:
        """The replicas (keys of `queue_lens`, which holds every candidate) that were sent `key` and are not
        overloaded, shortest queue first; empty when there are none."""
        if not queue_lens:
            return []
        bound = min(queue_lens.values()) + self.overload_threshold
        held = [r for r, queue in queue_lens.items() if key in self.adapters.get(r, ()) and queue <= bound]
        return sorted(held, key=queue_lens.__getitem__)

    def record(self, replica: Hashable, key: str) -> None:
        held = self.adapters.setdefault(replica, OrderedDict())
        held[key] = None
        held.move_to_end(key)
        while len(held) > self.max_tracked_adapters:
            held.popitem(last=False)

    def retain(self, replicas: Iterable[Hashable]) -> None:
        """Forget every replica not in `replicas` (they left: scaled down, replaced, dead)."""
        retain_replicas(self.adapters, replicas)
