"""Scheduler admission: prefill chunks run in length groups with bounded padding; joining sequences
take consecutive rows after the running batch, within the round's token budget and the pool's blocks;
rows sharing a prompt wait for the first to compute it, and (row state) for the state it keeps where
their prompts leave its own."""

from __future__ import annotations

from raypipe.decode.block_pool import BlockPool
from raypipe.decode.lora_pool import LoraPool
from raypipe.decode.scheduler import MAX_PADDING, PENDING_PREFIX_MIN_TOKENS, Scheduler, group_by_length
from raypipe.decode.sequence import Sequence
from raypipe.decode.snapshot_pool import SnapshotPool
from raypipe.inputs.sampling import SamplingParams
from raypipe.models.lora import LoraWeights


def _seq(length: int, output: int = 0, tokens: list[int] | None = None) -> Sequence:
    import torch

    tokens = tokens if tokens is not None else list(range(length))
    seq = Sequence(f"s{length}", tokens, torch.zeros((3, len(tokens)), dtype=torch.long), 0, None,
                   SamplingParams(), lambda item: None)
    seq.output_ids = list(range(output))
    return seq


def _scheduler(blocks=100, chunked=False, budget=1000, seqs=8) -> Scheduler:
    return Scheduler(max_num_seqs=seqs, max_num_batched_tokens=budget, pool=BlockPool(blocks, 16),
                     chunked_prefill=chunked, prefix_caching=False)


def test_groups_bound_padding_and_keep_every_sequence():
    seqs = [_seq(n) for n in [460, 82, 95, 270, 126, 83, 175, 271, 94, 127]]
    for seq in seqs:
        seq.chunk_len = seq.prompt_len
    groups = group_by_length(seqs, MAX_PADDING)
    assert sorted(id(s) for g in groups for s in g) == sorted(id(s) for s in seqs)
    for group in groups:
        real = sum(s.chunk_len for s in group)
        assert len(group) * max(s.chunk_len for s in group) <= (1 + MAX_PADDING) * real
    assert len(groups) < len(seqs)  # similar lengths do share a forward


def test_admitted_groups_take_consecutive_rows_after_the_running_batch():
    scheduler = _scheduler()
    for seq in [_seq(300), _seq(80), _seq(290), _seq(85)]:
        scheduler.add(seq)
    plan = scheduler.schedule(lambda seq: 1)
    rows = [s.row for g in plan.prefill for s in g]
    assert rows == [0, 1, 2, 3] and scheduler.running == [s for g in plan.prefill for s in g]
    # Each holds exactly the blocks of its prompt.
    assert [len(s.block_table) for s in scheduler.running] == [-(-s.prompt_len // 16) for s in scheduler.running]


def test_token_budget_counts_prompt_tokens_first_come_first_served():
    scheduler = _scheduler(budget=500)
    first, second, third = _seq(300), _seq(150), _seq(100)
    for seq in (first, second, third):
        scheduler.add(seq)
    joined = [s for g in scheduler.schedule(lambda seq: 1).prefill for s in g]
    assert joined == [second, first]  # 450 tokens fit; the third waits even though it is short
    assert list(scheduler.waiting) == [third]


def test_without_chunking_a_prompt_over_the_budget_runs_alone():
    scheduler = _scheduler(budget=100)
    long, short = _seq(300), _seq(10)
    scheduler.add(long)
    scheduler.add(short)
    plan = scheduler.schedule(lambda seq: 1)
    assert [s for g in plan.prefill for s in g] == [long] and long.chunk_len == 300
    assert list(scheduler.waiting) == [short]


def test_chunked_prefill_takes_the_budget_per_round():
    scheduler = _scheduler(budget=100, chunked=True)
    long = _seq(250)
    scheduler.add(long)
    chunks = []
    while not long.output_ids:
        plan = scheduler.schedule(lambda seq: 1)
        assert [s for g in plan.prefill for s in g] == [long] and not plan.decode
        chunks.append(long.chunk_len)
        assert len(long.block_table) == -(-(long.num_computed + long.chunk_len) // 16)  # blocks follow the chunks
        long.num_computed += long.chunk_len
        if long.num_computed == long.prompt_len:
            long.output_ids.append(7)
    assert chunks == [100, 100, 50] and scheduler.counters["chunked_prefills"] == 1
    assert scheduler.schedule(lambda seq: 1).decode == [long]


def test_a_dry_pool_preempts_the_newest_running_sequence():
    scheduler = _scheduler(blocks=5)  # 4 usable blocks of 16 tokens
    old, new = _seq(20), _seq(20)
    for seq in (old, new):
        scheduler.add(seq)
    scheduler.schedule(lambda seq: 1)
    for seq in (old, new):  # both prefilled: 2 blocks each, the pool is full
        seq.num_computed, seq.output_ids = 20, [1]
    assert scheduler.pool.num_available == 0
    for _ in range(20):  # decode until the old one needs a third block
        plan = scheduler.schedule(lambda seq: 1)
        if plan.preempted:
            break
        for seq in plan.decode:
            seq.output_ids.append(1)
            seq.num_computed = seq.cache_len
    assert plan.preempted == [new] and plan.decode == [old]
    assert new.block_table == [] and new.num_computed == 0 and list(scheduler.waiting) == [new]
    assert len(old.block_table) == 3 and scheduler.counters["preemptions"] == 1


def test_rows_sharing_a_prompt_wait_for_the_first_to_compute_it():
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=2000, pool=BlockPool(100, 16),
                          chunked_prefill=True, prefix_caching=True)
    shared = list(range(200))
    first, *followers = [_seq(0, tokens=shared + [300 + i] * 20) for i in range(4)]
    other = _seq(0, tokens=list(range(500, 560)))  # behind them, sharing nothing: it goes ahead
    for seq in (first, *followers, other):
        scheduler.add(seq)
    joined = [s for g in scheduler.schedule(lambda seq: 1).prefill for s in g]
    assert sorted(joined, key=lambda s: s.arrival) == [first, other]
    assert list(scheduler.waiting) == followers and scheduler.counters["deferred_admissions"] == 3
    for seq in joined:  # the chunk ran: its blocks are registered
        seq.num_computed += seq.chunk_len
        seq.output_ids.append(1)
        scheduler.chunk_done(seq)
    joined = [s for g in scheduler.schedule(lambda seq: 1).prefill for s in g]
    assert sorted(joined, key=lambda s: s.arrival) == followers
    assert [s.num_computed for s in followers] == [192] * 3  # the shared prompt's full blocks, computed once
    assert scheduler.counters["prefix_cache_hit_tokens"] == 3 * 192


def test_a_prompt_sharing_less_than_the_minimum_with_a_prefill_under_way_joins_now():
    # Random prompts of a burst can share a block by chance (the chat template's tail and the same first words):
    # waiting a round to save those 16 tokens left its row decoding alone at the end of the burst. One block
    # below `PENDING_PREFIX_MIN_TOKENS` is computed twice; two blocks are waited for.
    assert 16 < PENDING_PREFIX_MIN_TOKENS <= 32
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=2000, pool=BlockPool(100, 16),
                          chunked_prefill=True, prefix_caching=True)
    first = _seq(0, tokens=list(range(16)) + [100] * 60)
    one_block = _seq(0, tokens=list(range(16)) + [200] * 60)  # shares block 0 only
    two_blocks = _seq(0, tokens=list(range(16)) + [100] * 16 + [300] * 60)  # shares blocks 0 and 1
    for seq in (first, one_block, two_blocks):
        scheduler.add(seq)
    joined = [s for g in scheduler.schedule(lambda seq: 1).prefill for s in g]
    assert sorted(joined, key=lambda s: s.arrival) == [first, one_block]
    assert list(scheduler.waiting) == [two_blocks] and scheduler.counters["deferred_admissions"] == 1


def test_rows_waiting_for_a_shared_prompt_hit_its_state_where_they_leave_it():
    # Row state: a hit must end on a state snapshot. The first row's prefill keeps one every 5 blocks (80, 160)
    # and at its last boundary (208); the rows waiting for its blocks leave its prompt after 12 blocks (192),
    # so it keeps one there too, and every one of them joins with all 192 shared tokens (none from 160).
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=2000, pool=BlockPool(100, 16),
                          chunked_prefill=True, prefix_caching=True, snapshots=SnapshotPool(16, 1), snapshot_every=5)
    shared = list(range(200))
    first, *followers = [_seq(0, tokens=shared + [300 + i] * 20) for i in range(4)]
    for seq in (first, *followers):
        scheduler.add(seq)
    plan = scheduler.schedule(lambda seq: 1)
    assert [s for g in plan.prefill for s in g] == [first] and list(scheduler.waiting) == followers
    assert sorted(position for position, _ in first.snapshot_saves) == [80, 160, 192, 208]
    first.num_computed += first.chunk_len
    first.output_ids.append(1)
    scheduler.chunk_done(first)
    plan = scheduler.schedule(lambda seq: 1)
    assert sorted((s for g in plan.prefill for s in g), key=lambda s: s.arrival) == followers
    assert [s.num_computed for s in followers] == [192] * 3
    assert len(plan.restores) == 3 and len({slot for slot, _ in plan.restores}) == 1  # the one state at 192


def test_a_row_whose_adapter_finds_every_slot_busy_waits_and_only_base_rows_pass_it():
    """Two slots, three adapters: the third adapter's row waits (not refused) while both slots are in use; behind
    it base rows join, adapter rows do not (not even of an adapter in a slot: they would keep it busy); once a
    row leaves, its slot, least recently used, is given to the waiting row and written."""
    adapters = {name: LoraWeights(name, {}, fingerprint=name * 8) for name in "ABC"}
    pool = LoraPool(lambda name, path, where: adapters[name], max_loras=2, max_cpu_loras=2)
    for name in adapters:
        pool.load(name, f"/adapters/{name}")
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=1000, pool=BlockPool(100, 16), chunked_prefill=False,
                          prefix_caching=False, loras=pool)
    a, b, c, base, a2 = (_seq(20 + i) for i in range(5))
    for seq, name in ((a, "A"), (b, "B"), (c, "C"), (base, None), (a2, "A")):
        seq.lora = adapters.get(name)
        scheduler.add(seq)
    scheduler.schedule(lambda seq: 1)
    assert scheduler.running == [a, b, base] and list(scheduler.waiting) == [c, a2]
    assert [(slot, w.name) for slot, w in pool.take_writes()] == [(1, "A"), (2, "B")]
    scheduler.release([a])
    scheduler.schedule(lambda seq: 1)
    assert c.row is not None and c.lora_slot == 1 and list(scheduler.waiting) == [a2]  # A's slot was free
    assert [(slot, w.name) for slot, w in pool.take_writes()] == [(1, "C")]
    scheduler.release([b])
    scheduler.schedule(lambda seq: 1)
    assert a2.lora_slot == 2 and not scheduler.waiting and [w.name for _, w in pool.take_writes()] == ["A"]
