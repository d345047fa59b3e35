"""The block pool under the scheduler, by random events: sequences join (many sharing prefixes), run
rounds (prefill chunks, decode steps), finish, are aborted waiting or running, and are preempted
when the small pool runs dry. After every event: each block's reference count is the number of live
block tables holding it, a block in two tables is a registered prefix block holding the same tokens
in both, and every block is in exactly one of free / cached-unreferenced / referenced. At the end,
with every sequence gone, every block is available again (no leak)."""

from __future__ import annotations

import random
from collections import Counter

import torch

from raypipe.decode.block_pool import NULL_BLOCK, BlockPool
from raypipe.decode.scheduler import Scheduler
from raypipe.decode.sequence import Sequence
from raypipe.inputs.sampling import SamplingParams

EVENTS = 1000
BLOCK = 4
MAX_OUTPUT = 12


def new_sequence(rng: random.Random, i: int, prefixes: list[list[int]]) -> Sequence:
    prompt = rng.choice(prefixes)[: rng.randint(1, 20)] + [rng.randrange(50) for _ in range(rng.randint(0, 10))]
    return Sequence(f"r{i}", prompt, torch.zeros((3, len(prompt)), dtype=torch.long), 0, None,
                    SamplingParams(max_tokens=MAX_OUTPUT), lambda item: None)


def left(seq: Sequence) -> int:
    return MAX_OUTPUT - len(seq.output_ids)


def run_round(rng: random.Random, scheduler: Scheduler) -> None:
    """One round as the engine runs it, with random tokens for the model's."""
    plan = scheduler.schedule(lambda seq: min(3, left(seq)))
    for seq in plan.decode:
        seq.output_ids += [rng.randrange(50) for _ in range(min(3, left(seq)))]
        seq.num_computed = seq.cache_len
    for seq in (s for group in plan.prefill for s in group):
        seq.num_computed += seq.chunk_len
        seq.chunk_len = 0
        if seq.num_computed == seq.prompt_len and not seq.output_ids:
            seq.output_ids.append(rng.randrange(50))
        scheduler.cache_blocks(seq)
    done = [s for s in scheduler.running if s.decoding and left(s) <= 0]
    scheduler.release(done)


def check(pool: BlockPool, scheduler: Scheduler) -> None:
    tables = [s.block_table for s in scheduler.running]
    held = Counter(b for table in tables for b in table)
    assert NULL_BLOCK not in held
    for block in range(1, pool.num_blocks):
        assert pool.refs[block] == held[block], f"block {block}"
    for block, count in held.items():
        if count > 1:
            assert block in pool.hash_of, f"block {block} shared but not a cached prefix block"
            owners = [(s, s.block_table.index(block)) for s in scheduler.running if block in s.block_table]
            (first, j), *rest = owners
            for other, k in rest:  # the same tokens up to and including the block, at the same index
                assert k == j and other.token_ids[: (j + 1) * BLOCK] == first.token_ids[: (j + 1) * BLOCK]
    free, unreferenced = set(pool.free), set(pool.unreferenced)
    assert len(free) == len(pool.free) and not free & unreferenced and not free & set(held)
    assert not unreferenced & set(held) and all(b in pool.hash_of for b in unreferenced)
    assert not free & set(pool.hash_of)
    assert len(free) + len(unreferenced) + len(held) == pool.num_blocks - 1
    assert all(pool.cached[h] == b for b, h in pool.hash_of.items())
    for seq in scheduler.waiting:
        assert seq.block_table == [] and seq.row is None
    assert [s.row for s in scheduler.running] == list(range(len(scheduler.running)))


def test_random_join_finish_abort_preempt_keeps_the_pool_consistent():
    rng = random.Random(24)
    pool = BlockPool(num_blocks=24, block_size=BLOCK)  # 92 tokens: a handful of sequences at most
    scheduler = Scheduler(max_num_seqs=6, max_num_batched_tokens=16, pool=pool, chunked_prefill=True,
                          prefix_caching=True)
    prefixes = [[rng.randrange(50) for _ in range(20)] for _ in range(3)]
    events = Counter()
    for i in range(EVENTS):
        event = rng.choices(["join", "round", "abort_waiting", "abort_running"], weights=[3, 5, 1, 1])[0]
        if event == "join":
            scheduler.add(new_sequence(rng, i, prefixes))
        elif event == "round":
            run_round(rng, scheduler)
        elif event == "abort_waiting" and scheduler.waiting:
            assert scheduler.remove_waiting(rng.choice(list(scheduler.waiting)))
        elif event == "abort_running" and scheduler.running:
            scheduler.release([rng.choice(scheduler.running)])
        else:
            continue
        events[event] += 1
        check(pool, scheduler)
    assert scheduler.counters["preemptions"] > 10 and scheduler.counters["prefix_cache_hit_tokens"] > 0
    assert scheduler.counters["chunked_prefills"] > 0 and pool.evictions > 0
    assert min(events.values()) > 20
    scheduler.release(list(scheduler.running))
    scheduler.waiting.clear()
    check(pool, scheduler)
    assert all(r == 0 for r in pool.refs) and pool.num_available == pool.num_blocks - 1
