"""`PrefixAffinityRouter`: a Serve request router for the Decoder that sends a prompt where its prefix is cached.

Serve's default router picks the shorter queue of two random replicas, so with several Decoder
replicas a conversation's next turn lands on a replica holding none of its blocks most of the time.
This router applies `prefix_affinity.py`'s rule first, then `adapter_affinity.py`'s (a LoRA adapter's
requests go where it was sent before) and Serve's rule as the fallback, through
Serve's public request-router API (`ray.serve.request_router`, set by `request_router_config` in
the Decoder's deployment options; `app.compose` does it when routing is on).

Ray's own `PrefixCacheAffinityRouter` (ray.serve.llm) is not used: its public module does not
import without vLLM or SGLang on Ray 2.60, and it matches the request's message text, so it cannot
tell two prompts with the same words and different images apart; it also keeps one tree in a
detached actor that every routing decision calls synchronously.

What the router reads: the Ingress computes the prompt's block hashes (`prompt_block_hashes`, the
engine's keys, visual items included, the first `max_key_blocks` of them) and passes them to
`Decoder.generate` as the keyword argument `prefix_hashes` (a tuple of 16-byte digests); the
router reads them from the pending request's kwargs, nothing else is computed on its path.

Each handle has its own router, so each Ingress replica's router knows only what that Ingress sent
where, and queue lengths from its own sends plus what replicas report back when they accept one.
That is still fine: the state is a hint (a miss costs a prefill, never a wrong answer), nothing is
shared so nothing can go stale across processes, and a conversation whose turns arrive at different
Ingress replicas only loses hits until each router has seen it once. Replicas that leave (scaled
down, dead) are forgotten in `update_replicas`/`on_replica_actor_died`; a replica that joins holds
nothing, so it takes new conversations through the fallback (idle, it has the shorter queue) while
the running ones stay where their blocks are.

Serve hands a chosen replica to the oldest request still waiting (`FIFOMixin`, as its default
router does). Without it Serve matches a replica to the request by its internal id, which the n
decoder calls of one HTTP request (n > 1) share, and all but the first of them waited forever. The
price: when routing tasks finish out of order (one waits for a queue-length probe), a request can
take the replica chosen for the one before it.

The fallback is Serve's power of two choices, decided here: two random replicas, the shorter queue first,
and on equal queues the one this router sent fewer blocks. Each rank returned holds one replica, so Serve
takes this router's order and only moves to the next rank when a replica is full (Serve checks it, probing
replicas whose length it does not know). A replica whose queue length this router does not know counts as empty.

The queue lengths are Serve's cache plus the choices this router made that Serve has not sent yet: Serve
routes a burst in concurrent tasks and counts a request in its cache only when it sends it, one event-loop
turn after the choice, so a burst of new conversations all saw the same lengths and went where the first
went (tests/test_serve_routing.py saw 7 of 8 on one replica of two). A choice not sent within
`UNSENT_HORIZON_S` (its replica was full, its caller left) stops counting.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Sequence

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from raypipe.serve.adapter_affinity import AdapterAffinity
from raypipe.serve.prefix_affinity import PrefixAffinity, retain_replicas

ROUTER_CLASS = "raypipe.serve.prefix_router:PrefixAffinityRouter"
HASHES_KWARG = "prefix_hashes"  # the keyword argument of Decoder.generate the router reads
LORA_KWARG = "lora"  # Decoder.generate's adapter (a `LoraRef` or None), passed by keyword for this router
UNSENT_HORIZON_S = 2.0  # Serve sends a chosen replica's request within an event-loop turn; older choices were dropped


def request_hashes(pending_request: PendingRequest | None) -> Sequence[bytes]:
    if pending_request is None:
        return ()
    return pending_request.kwargs.get(HASHES_KWARG) or ()


def request_adapter(pending_request: PendingRequest | None) -> str | None:
    """The routing key of the request's LoRA adapter; None for the base model."""
    lora = pending_request.kwargs.get(LORA_KWARG) if pending_request is not None else None
    return lora.routing_key if lora is not None else None


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, *, min_match_ratio: float, overload_threshold: int, max_tracked_blocks: int,
                         max_tracked_adapters: int):
        """Serve passes `request_router_kwargs` here (`PrefixRouting`'s fields, from `app.compose`)."""
        self.affinity = PrefixAffinity(min_match_ratio, overload_threshold, max_tracked_blocks)
        self.adapters = AdapterAffinity(overload_threshold, max_tracked_adapters)
        self.unsent: dict[ReplicaID, deque[float]] = {}  # per replica, when each choice Serve has not sent was made

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranks of one replica each, tried in order: the replica holding the prefix (`PrefixAffinity.choose`), the
        replicas holding the request's adapter (`AdapterAffinity.holders`, shortest queue first), then two random
        ones, shorter queue first. The first is counted as chosen until Serve sends to it."""
        if not candidate_replicas:
            return []
        queues = self.queue_lens(candidate_replicas)
        order: list[ReplicaID] = []
        hashes, adapter = request_hashes(pending_request), request_adapter(pending_request)
        best = self.affinity.choose(hashes, queues) if hashes else None
        if best is not None:
            order.append(best)
        order += [r for r in (self.adapters.holders(adapter, queues) if adapter else ()) if r not in order]
        # Serve's own rule, ties to the replica this router sent fewer blocks: conversations arriving one at a time
        # find every queue empty, and a random pick put 7 of 8 on one replica; this spreads them, and their caches.
        pair = [r.replica_id for r in random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        order += [r for r in sorted(pair, key=lambda r: (queues[r], self.affinity.held(r))) if r not in order]
        self.unsent.setdefault(order[0], deque()).append(time.monotonic())
        by_id = {r.replica_id: r for r in candidate_replicas}
        return [[by_id[r]] for r in order]

    def queue_lens(self, candidate_replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Per candidate: Serve's cached queue length (0 when unknown) plus this router's choices not sent yet."""
        cache, oldest = self.replica_queue_len_cache, time.monotonic() - UNSENT_HORIZON_S
        for choices in self.unsent.values():
            while choices and choices[0] < oldest:
                choices.popleft()
        return {r.replica_id: (cache.get(r.replica_id) or 0) + len(self.unsent.get(r.replica_id, ()))
                for r in candidate_replicas}

    def on_send_request(self, replica_id: ReplicaID) -> None:
        """Serve sent a request to `replica_id` and counts it in its cache now: one choice there stops counting."""
        super().on_send_request(replica_id)
        if self.unsent.get(replica_id):
            self.unsent[replica_id].popleft()

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.affinity.record(replica_id, request_hashes(pending_request))
        adapter = request_adapter(pending_request)
        if adapter is not None:
            self.adapters.record(replica_id, adapter)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._forget_gone()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget_gone()

    def _forget_gone(self) -> None:
        self.affinity.retain(self.curr_replicas)
        self.adapters.retain(self.curr_replicas)
        retain_replicas(self.unsent, self.curr_replicas)
