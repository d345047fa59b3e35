"""Which Decoder replica most likely holds a request's prompt prefix: the rule `PrefixAffinityRouter` applies.

Each Decoder replica has its own engine and KV pool, so a prompt is only cheap where its prefix
was computed before. A request is keyed by the hashes the engine keys its cached blocks by
(`decode/prefix_hash.py`: token ids chained with the visual items' identities), and the router
remembers, per replica, the hashes of the requests it sent there, each with the hash that followed
it: a bounded LRU, so memory stays fixed whatever the traffic (tail blocks are forgotten before head
blocks, as the engine's pool evicts them). It is a guess, never a promise: the engine may have evicted the blocks, and a wrong
guess costs one prefill, never a wrong answer.

The rule, for a request with block hashes h_0..h_n over the replicas that can take it:
  1. match(r) = how many leading hashes replica r holds (the chain makes h_j imply h_0..h_j-1), and
     0 where the match stops at a block after which r was sent something else: the request then
     branches off another prompt (the head every conversation shares: chat template, system prompt,
     a common document) rather than continuing one of its own (a conversation's next turn goes on
     where its previous prompt stopped). Without this, with short prompts the shared head alone was
     over `min_match_ratio` of a first turn, and every new conversation followed the first one to its
     replica (tests/test_serve_routing.py saw 40 of 40 requests on one of two replicas);
  2. the replica with the longest match wins (ties: the shorter queue),
  3. if the match covers at least `min_match_ratio` of the n + 1 hashes: a shorter one is mostly a
     head every prompt shares (chat template, system prompt), cheap to compute once per replica,
     and following it would pin every new conversation to the first replica that saw it;
  4. and if that replica is not overloaded: its queue exceeds the shortest queue by at most
     `overload_threshold` requests (waiting longer costs more than recomputing the prefix);
  5. otherwise no affinity: the caller falls back to queue length.
Ray's `PrefixCacheAffinityRouter` has the same two guards (`match_rate_threshold`, 0.1 of the
characters, and `imbalanced_threshold`); SGLang's cache-aware router too (a cache threshold and
balance thresholds).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixRouting:
    """Prefix-affinity routing of the Decoder deployment (`AppArgs.routing`, config.yaml's `routing:`)."""

    enabled: bool | None = None  # None: on when the Decoder may run more than one replica (max_replicas > 1)
    min_match_ratio: float = 0.5  # follow a prefix only where it covers at least this share of the key's blocks
    overload_threshold: int = 8  # the replica with the prefix is skipped when its queue exceeds the shortest by more
    max_tracked_blocks: int = 32768  # block hashes remembered per Decoder replica by each router (LRU; ~4 MB)
    max_key_blocks: int = 256  # a request is keyed by at most its first this many blocks (4,096 tokens at 16)
    max_tracked_adapters: int = 64  # LoRA adapter keys remembered per Decoder replica by each router (LRU)

    def __post_init__(self):
        if not 0 < self.min_match_ratio <= 1 or self.overload_threshold < 0 or min(
                self.max_tracked_blocks, self.max_key_blocks, self.max_tracked_adapters) < 1:
            raise ValueError(f"routing: min_match_ratio must be in (0, 1], overload_threshold >= 0 and the block and "
                             f"adapter counts >= 1, got {self}")


class PrefixAffinity:
    """Per replica, an LRU of the block hashes routed there; `choose` applies the module's rule."""

    def __init__(self, min_match_ratio: float, overload_threshold: int, max_tracked_blocks: int):
        self.min_match_ratio = min_match_ratio
        self.overload_threshold = overload_threshold
        self.max_tracked_blocks = max_tracked_blocks
        # replica -> block hash sent there -> the hash that followed it (None: the end of a prompt)
        self.blocks: dict[Hashable, OrderedDict[bytes, bytes | None]] = {}

    def matched(self, replica: Hashable, hashes: Sequence[bytes]) -> int:
        """How many of `hashes`, from the first, `replica` was sent; 0 where they branch off what it was sent."""
        held = self.blocks.get(replica, {})
        count = 0
        for h in hashes:
            if h not in held:
                break
            count += 1
        if 0 < count < len(hashes) and held[hashes[count - 1]] not in (None, hashes[count]):
            return 0  # (the same successor, evicted since: the same chain, its tail forgotten)
        return count

    def choose(self, hashes: Sequence[bytes], queue_lens: Mapping[Hashable, int]) -> Hashable | None:
        """The replica (a key of `queue_lens`, which holds every candidate) to send `hashes` to, or None."""
        best, best_match = None, 0
        for replica, queue in queue_lens.items():
            match = self.matched(replica, hashes)
            if match > best_match or (match == best_match > 0 and queue < queue_lens[best]):
                best, best_match = replica, match
        if best is None or best_match < self.min_match_ratio * len(hashes):
            return None
        if queue_lens[best] > min(queue_lens.values()) + self.overload_threshold:
            return None
        return best

    def held(self, replica: Hashable) -> int:
        """How many block hashes `replica` is remembered to hold: the fallback's tie-break (`PrefixAffinityRouter`)."""
        return len(self.blocks.get(replica, ()))

    def record(self, replica: Hashable, hashes: Sequence[bytes]) -> None:
        """`hashes` were sent to `replica`. Touched last-to-first, so a prompt's head stays longest."""
        held = self.blocks.setdefault(replica, OrderedDict())
        for j in reversed(range(len(hashes))):
            h = hashes[j]
            held[h] = hashes[j + 1] if j + 1 < len(hashes) else held.get(h)  # a prompt's end keeps what followed
            held.move_to_end(h)
        while len(held) > self.max_tracked_blocks:
            held.popitem(last=False)

    def retain(self, replicas: Iterable[Hashable]) -> None:
        """Forget every replica not in `replicas` (they left: scaled down, replaced, dead)."""
        retain_replicas(self.blocks, replicas)


def retain_replicas(per_replica: dict, replicas: Iterable[Hashable]) -> None:
    """Drop the entries of `per_replica` (a router's memory, by replica) whose replica is not in `replicas`."""
    keep = set(replicas)
    for replica in [r for r in per_replica if r not in keep]:
        del per_replica[replica]
