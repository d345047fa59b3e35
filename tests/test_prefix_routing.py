"""The prefix-affinity routing rule, without Serve: `PrefixAffinity` alone, then `PrefixAffinityRouter` (Serve's
own `RequestRouter` base, constructed here) driven through the calls Serve makes, with stand-in replicas.

Also: the hashes the Ingress keys a request by are the engine's own cache keys (an engine run here).
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from raypipe.serve.lora_registry import LoraRef
from raypipe.serve.prefix_affinity import PrefixAffinity, PrefixRouting
from raypipe.serve.prefix_router import HASHES_KWARG, LORA_KWARG, PrefixAffinityRouter

DEPLOYMENT = DeploymentID(name="Decoder", app_name="test")


def chain(tag: str, n: int) -> list[bytes]:
    """n block hashes of one prompt: a chain, so two prompts share a prefix iff their tags' chains do."""
    return [f"{tag}:{j}".encode() for j in range(n)]


def test_longest_prefix_wins_and_overload_falls_back():
    rule = PrefixAffinity(min_match_ratio=0.5, overload_threshold=2, max_tracked_blocks=100)
    conv = chain("a", 6)
    rule.record("A", conv[:2])
    assert rule.choose(conv, {"A": 0, "B": 0}) is None  # 2 of 6 blocks: a shared head, not worth following
    assert rule.choose(conv[:4], {"A": 0, "B": 0}) == "A"  # 2 of 4: half
    rule.record("B", conv[:4])
    assert rule.choose(conv, {"A": 0, "B": 0, "C": 0}) == "B"  # 4 leading blocks beat 2
    assert rule.choose(chain("z", 6), {"A": 0, "B": 0}) is None  # no match: the caller's fallback
    # B is 2 requests above the shortest queue: still B; 3 above: overloaded, no affinity.
    assert rule.choose(conv, {"A": 0, "B": 2}) == "B"
    assert rule.choose(conv, {"A": 0, "B": 3, "C": 1}) is None
    rule.record("C", conv[:4])  # equal matches: the shorter queue
    assert rule.choose(conv, {"B": 2, "C": 1}) == "C"
    assert rule.choose(conv[:4], {"A": 0}) == "A"  # only the candidates count (B and C gone)


def test_tracked_blocks_are_an_lru_that_keeps_heads_longest():
    rule = PrefixAffinity(min_match_ratio=1.0, overload_threshold=0, max_tracked_blocks=5)
    rule.record("A", chain("old", 4))
    rule.record("A", chain("new", 3))  # 7 > 5: the old prompt's two tail blocks go, its head stays
    assert len(rule.blocks.get("A", ())) == 5
    assert rule.matched("A", chain("old", 4)) == 2 and rule.matched("A", chain("new", 3)) == 3
    rule.retain(["B"])
    assert len(rule.blocks.get("A", ())) == 0


def test_routing_config_is_validated():
    with pytest.raises(ValueError, match="overload_threshold"):
        PrefixRouting(overload_threshold=-1)
    with pytest.raises(ValueError, match="min_match_ratio"):
        PrefixRouting(min_match_ratio=0)


class StandIn:
    """What a request router reads of a replica (`RunningReplica`): its id, capacity and queue length."""

    def __init__(self, name: str, queue_len: int = 0, max_ongoing_requests: int = 8):
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.max_ongoing_requests = max_ongoing_requests
        self.queue_len = queue_len

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


def request(hashes: list[bytes], lora: LoraRef | None = None) -> PendingRequest:
    """A pending `Decoder.generate` call as the Ingress makes it (hashes and adapter by keyword)."""
    metadata = RequestMetadata(request_id="r", internal_request_id="i", call_method="generate")
    return PendingRequest(args=["r", None, [], None], kwargs={LORA_KWARG: lora, "cache_salt": None,
                                                              HASHES_KWARG: tuple(hashes)}, metadata=metadata)


def router_with(replicas: list[StandIn], threshold: int = 4, adapters: int = 64) -> PrefixAffinityRouter:
    router = PrefixAffinityRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.REPLICA,
                                  use_replica_queue_len_cache=True)
    router.initialize_state(min_match_ratio=0.5, overload_threshold=threshold, max_tracked_blocks=1000,
                            max_tracked_adapters=adapters)
    router.update_replicas(replicas)
    return router


def names(ranks) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


async def ranks_of(router: PrefixAffinityRouter, pending: PendingRequest) -> list:
    """The ranks the router gives `pending`, as a look only: Serve sends nothing, so the choice is not counted."""
    ranks = await router.choose_replicas(router._replicas_list, pending)
    router.unsent.clear()
    return ranks


def is_fallback(ranks) -> bool:
    """Serve's two choices alone: two ranks of one replica each, two different replicas."""
    return len(ranks) == 2 and [len(rank) for rank in ranks] == [1, 1] and len(set(sum(names(ranks), []))) == 2


def test_router_ranks_the_prefix_holder_first_then_falls_back_to_two_choices():
    async def run():
        a, b, c = StandIn("A"), StandIn("B"), StandIn("C")
        router = router_with([a, b, c])
        conv = chain("conv", 8)
        # Nothing routed yet: two ranks of one, two distinct random replicas (Serve's power of two choices).
        assert is_fallback(await ranks_of(router, request(conv[:5])))
        router.on_request_routed(request(conv[:5]), b.replica_id, None)
        ranks = await ranks_of(router, request(conv))
        assert names(ranks)[0] == ["B"] and len(ranks) in (2, 3) and is_fallback(ranks[-2:])
        # B's queue (as Serve's cache knows it) 5 above the shortest: overloaded, only the fallback.
        router.on_new_queue_len_info(b.replica_id, 5)
        assert is_fallback(await ranks_of(router, request(conv)))
        router.on_new_queue_len_info(b.replica_id, 4)
        assert names(await ranks_of(router, request(conv)))[0] == ["B"]
        # A request without hashes (routing off at the ingress): the fallback only.
        assert is_fallback(await ranks_of(router, request([])))

    asyncio.run(run())


def test_new_conversations_arriving_one_at_a_time_alternate_over_idle_replicas():
    """Each first turn finds both queues empty (the one before it finished): Serve takes the first listed of equal
    queues, which must be the replica holding fewer blocks, not a random one (7 of 8 conversations once landed on
    one replica of two). So after every conversation the two replicas hold counts at most one apart."""
    async def run():
        a, b = StandIn("A"), StandIn("B")
        router = router_with([a, b])
        chosen = []
        for c in range(8):
            for replica in (a, b):
                router.on_new_queue_len_info(replica.replica_id, 0)  # Serve's cache: nothing running
            hashes = [b"head", *chain(f"conversation {c}", 3)]  # a shared template head, then its own blocks
            ranks = await router.choose_replicas(router._replicas_list, request(hashes))
            assert is_fallback(ranks)  # a first turn has no affinity: the fallback alone
            replica = await router._select_from_candidate_replicas(ranks[0], 0)  # Serve's pick of the first rank
            router.on_send_request(replica.replica_id)
            router.on_request_routed(request(hashes), replica.replica_id, None)
            chosen.append(replica.replica_id.unique_id)
        assert all(abs(chosen[:n].count("A") - chosen[:n].count("B")) <= 1 for n in range(9)), chosen

    for seed in range(20):  # the fallback's pair is random: every draw must stay balanced
        random.seed(seed)
        asyncio.run(run())


def test_a_burst_of_new_conversations_chosen_before_serve_sends_any_splits_evenly():
    """Serve routes a burst in concurrent tasks and counts a request in its queue lengths only when it sends it,
    after every task of the burst has chosen. Each choice counts until then, so 8 first turns chosen at once go 4
    and 4. Before, they all saw the same empty queues and went where the first went: the 7 of 8 conversations on
    one replica that tests/test_serve_routing.py saw."""
    async def run():
        a, b = StandIn("A"), StandIn("B")
        router = router_with([a, b])
        for replica in (a, b):
            router.on_new_queue_len_info(replica.replica_id, 0)
        chosen = []
        for c in range(8):
            ranks = await router.choose_replicas(router._replicas_list, request([b"head", *chain(f"c{c}", 3)]))
            chosen.append((await router._select_from_candidate_replicas(ranks[0], 0)).replica_id)
        assert sorted(r.unique_id for r in chosen) == ["A"] * 4 + ["B"] * 4, chosen
        for replica_id in chosen:  # Serve sends them: its cache counts them, the router's choices stop counting
            router.on_send_request(replica_id)
        assert router.queue_lens(router._replicas_list) == {a.replica_id: 4, b.replica_id: 4}

    for seed in range(20):
        random.seed(seed)
        asyncio.run(run())


def test_a_choice_serve_never_sends_stops_counting(monkeypatch):
    """A choice Serve drops (its replica was full, its caller left) must not skew the queue lengths for good."""
    from raypipe.serve import prefix_router

    async def run():
        a, b = StandIn("A"), StandIn("B")
        router = router_with([a, b])
        ranks = await router.choose_replicas(router._replicas_list, request(chain("x", 4)))
        assert router.queue_lens(router._replicas_list)[ranks[0][0].replica_id] == 1
        now = prefix_router.time.monotonic()
        monkeypatch.setattr(prefix_router.time, "monotonic", lambda: now + prefix_router.UNSENT_HORIZON_S + 0.1)
        assert router.queue_lens(router._replicas_list) == {a.replica_id: 0, b.replica_id: 0}

    asyncio.run(run())


def test_router_forgets_replicas_that_leave_and_routes_to_one_that_joins():
    async def run():
        a, b = StandIn("A"), StandIn("B")
        router = router_with([a, b])
        for i in range(6):
            router.on_request_routed(request(chain(f"c{i}", 4)), (a if i % 2 else b).replica_id, None)
        conv = chain("c1", 4)  # was sent to A
        assert names(await ranks_of(router, request(conv)))[0] == ["A"]
        c = StandIn("C")  # autoscaling adds C and removes A
        router.update_replicas([b, c])
        assert a.replica_id not in router.affinity.blocks
        ranks = await ranks_of(router, request(conv))
        assert is_fallback(ranks) and sorted(sum(names(ranks), [])) == ["B", "C"]  # no affinity left
        router.on_request_routed(request(conv), c.replica_id, None)
        assert names(await router.choose_replicas(router._replicas_list, request(conv)))[0] == ["C"]  # (not sent)
        router.on_replica_actor_died(c.replica_id)
        assert c.replica_id not in router.affinity.blocks and c.replica_id not in router.unsent
        assert names(await ranks_of(router, request(conv))) == [["B"]]

    asyncio.run(run())


def test_ingress_keys_are_the_engines_cache_keys(tiny_ckpt):
    """`prompt_block_hashes` (what the Ingress sends) equals the hashes the engine registered for the same
    prompt with an image; another image of the same size changes the key from its block on."""
    from raypipe import SamplingParams
    from raypipe.decode.config import EngineConfig
    from raypipe.decode.engine import LLMEngine
    from raypipe.decode.prefix_hash import prompt_block_hashes
    from raypipe.models.prompt import build_prompt
    from raypipe.models.registry import language_adapter, vision_adapter
    from tests import decode_reference as ref
    from tests.conftest import random_images

    block = 8
    vision, language = vision_adapter(tiny_ckpt), language_adapter(tiny_ckpt)
    first, other = random_images([(56, 84), (56, 84)], seed=3)
    prompt = build_prompt(ref.messages("What is in this picture?", [first]), language.tokenizer, vision)
    twin = build_prompt(ref.messages("What is in this picture?", [other]), language.tokenizer, vision)
    ids = prompt.prompt_token_ids
    keys = prompt_block_hashes(ids, prompt.visual_layouts, language, block, max_blocks=1000)
    assert len(keys) == (len(ids) - 1) // block and prompt_block_hashes(
        ids, prompt.visual_layouts, language, block, max_blocks=3) == keys[:3]
    image_block = ids.index(language.image_token_id) // block
    twin_keys = prompt_block_hashes(twin.prompt_token_ids, twin.visual_layouts, language, block, max_blocks=1000)
    assert twin.prompt_token_ids == ids and twin_keys[:image_block] == keys[:image_block]
    assert not set(twin_keys[image_block:]) & set(keys)

    engine = LLMEngine(tiny_ckpt, EngineConfig(max_num_seqs=1, max_model_len=512, block_size=block))
    try:  # the embedding's values do not enter the keys: random rows of the right shape
        rows = [torch.randn(language.tokens_per_image(layout.grid), language.embedding_width)
                for layout in prompt.visual_layouts]
        asyncio.run(engine.generate_output("k", prompt.without_pixels(), rows, SamplingParams(max_tokens=1)))
        assert set(keys) <= set(engine.pool.cached)
    finally:
        engine.shutdown()


def test_routing_is_on_by_default_where_the_decoder_may_scale_out():
    from raypipe.serve.app import compose
    from raypipe.serve.prefix_router import ROUTER_CLASS

    def routed(decoder_options: dict, routing: dict | None = None) -> tuple[bool, int]:
        """(the Decoder's router is ours, blocks the Ingress keys requests by)."""
        ingress = compose({"routing": routing or {}}, {"Decoder": decoder_options})._bound_deployment
        decoder = ingress.init_args[1]._bound_deployment
        router = decoder._deployment_config.request_router_config.request_router_class
        return router == ROUTER_CLASS, ingress.init_kwargs["prefix_key_blocks"]

    on = (True, PrefixRouting().max_key_blocks)
    assert routed({"num_replicas": 2}) == on
    assert routed({"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}}) == on
    assert routed({"num_replicas": 1}) == (False, 0) == routed({"autoscaling_config": {"max_replicas": 1}})
    assert routed({"num_replicas": 2}, {"enabled": False}) == (False, 0)
    assert routed({"num_replicas": 1}, {"enabled": True, "max_key_blocks": 7}) == (True, 7)
    with pytest.raises(ValueError, match="routing.enabled"):
        routed({"num_replicas": 2, "request_router_config": {"request_router_class": "my.Router"}})


def test_a_prompt_that_branches_off_another_has_no_affinity():
    """First turns that share only the head every prompt has (3 of 5 blocks in tests/test_serve_routing.py) do not
    follow the first conversation's replica; each conversation's next turn, which continues its own prompt, does."""
    rule = PrefixAffinity(min_match_ratio=0.5, overload_threshold=8, max_tracked_blocks=100)
    head = chain("system", 3)
    first, second = (head + chain(tag, 2) for tag in ("c0", "c1"))
    rule.record("A", first)
    assert rule.matched("A", second) == 0 and rule.choose(second, {"A": 0, "B": 0}) is None
    assert rule.choose(first + chain("c0-turn2", 3), {"A": 0, "B": 0}) == "A"  # continues where c0 stopped
    assert rule.choose(head, {"A": 0, "B": 0}) == "A"  # the whole key held: an identical prefix
    rule.record("A", head)  # a prompt that ends inside another keeps what followed there
    assert rule.matched("A", second) == 0


def test_an_adapters_new_requests_go_where_it_was_sent_unless_that_replica_is_overloaded():
    """Issue 46 item 5 (Serve's model multiplexing rule): a LoRA adapter's requests that share no prefix with
    anything sent go to the replica that was sent the adapter (it holds it read, in a slot), not to a random
    one that would read it again; after the prefix holder, before Serve's two choices."""
    async def run():
        a, b, c = StandIn("A"), StandIn("B"), StandIn("C")
        router = router_with([a, b, c], adapters=2)
        legal, support = LoraRef("legal", "/a/legal", "f" * 64), LoraRef("support")
        # Never sent: no holder, the fallback only (the chosen replica reads it).
        assert is_fallback(await ranks_of(router, request(chain("x", 4), legal)))
        router.on_request_routed(request(chain("x", 4), legal), b.replica_id, None)
        ranks = await ranks_of(router, request(chain("y", 4), legal))
        assert names(ranks)[0] == ["B"] and len(ranks) in (2, 3) and is_fallback(ranks[-2:])
        # Keyed by the weights' fingerprint: other weights loaded under the same name have no holder.
        relabelled = LoraRef("legal", "/a/legal-v2", "e" * 64)
        assert is_fallback(await ranks_of(router, request(chain("y", 4), relabelled)))
        # The base model and another adapter do not follow it.
        assert is_fallback(await ranks_of(router, request(chain("y", 4))))
        assert is_fallback(await ranks_of(router, request(chain("y", 4), support)))
        # A conversation's prefix holder first, then the adapter's other holders, shortest queue first.
        router.on_request_routed(request(chain("conv", 4), legal), a.replica_id, None)
        ranks = names(await ranks_of(router, request(chain("conv", 8), legal)))
        assert ranks[:2] == [["A"], ["B"]]
        # B 5 requests above the shortest queue (threshold 4): only A holds it usefully.
        router.on_new_queue_len_info(b.replica_id, 5)
        assert names(await ranks_of(router, request(chain("z", 4), legal)))[0] == ["A"]
        # Each replica remembers its 2 most recent adapters: a third sent to A forgets legal there.
        router.on_request_routed(request(chain("s", 4), support), a.replica_id, None)
        router.on_request_routed(request(chain("t", 4), LoraRef("third")), a.replica_id, None)
        router.on_new_queue_len_info(b.replica_id, 0)
        assert names(await ranks_of(router, request(chain("z", 4), legal)))[0] == ["B"]
        # A replica that leaves is forgotten.
        router.update_replicas([a, c])
        assert b.replica_id not in router.adapters.adapters
        assert is_fallback(await ranks_of(router, request(chain("z", 4), legal)))

    asyncio.run(run())
