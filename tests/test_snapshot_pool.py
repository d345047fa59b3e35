"""State snapshots under the scheduler, by random events (hypothesis draws the seeds): sequences join
(most sharing prefixes), run rounds (prefill chunks, decode steps whose rows run on past their stop),
finish, are aborted waiting or running, are preempted, and cached snapshots are evicted.

A fake model stands in for the rows' state: the tuple of tokens a row has consumed. Moves, restores,
chunk splits and decode captures move and copy it exactly as `ModelRunner` moves and copies row
state (swaps through the spare row included). So the checks below are the snapshot contract itself:
a restored snapshot holds exactly the tokens the sequence has at that position (never another prefix,
never another position, never the tokens a decode row ran on after its stop); every row holds exactly
its sequence's computed tokens before each forward, and the decoding sequences hold rows 0..n-1 (a
sequence still prefilling in chunks may not sit among them); each slot's reference count is what
sequences hold; and once every sequence is gone nothing is held (counts back to zero)."""

from __future__ import annotations

import random
from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe.decode.block_pool import BlockPool
from raypipe.decode.kv_pool_size import pool_blocks
from raypipe.decode.scheduler import Scheduler
from raypipe.decode.sequence import Sequence
from raypipe.decode.snapshot_pool import SnapshotPool
from raypipe.inputs.sampling import SamplingParams

EVENTS = 1000
BLOCK = 4
K = 3
MAX_OUTPUT = 10


class FakeState:
    """The rows' and slots' "state": the tokens consumed to get there."""

    def __init__(self):
        self.rows: dict[int, tuple] = {}
        self.slots: dict[int, tuple] = {}

    def apply(self, plan, scheduler: Scheduler) -> int:
        """Moves, then restores (checked: the exact tokens of the sequence up to its hit); restores seen."""
        for src, dst, _ in plan.moves:
            self.rows[dst] = self.rows.get(src, ())
        for slot, row in plan.restores:
            seq = scheduler.running[row]
            assert self.slots[slot] == tuple(seq.token_ids[: seq.num_computed]), "snapshot of another prefix"
            assert seq.num_computed % BLOCK == 0 and seq.num_computed > 0
            self.rows[row] = self.slots[slot]
        scheduler.restored(plan.restores)
        return len(plan.restores)


def new_sequence(rng: random.Random, i: int, prefixes: list[list[int]]) -> Sequence:
    prompt = rng.choice(prefixes)[: rng.randint(1, 24)] + [rng.randrange(50) for _ in range(rng.randint(0, 8))]
    return Sequence(f"r{i}", prompt, torch.zeros((3, len(prompt)), dtype=torch.long), 0, None,
                    SamplingParams(max_tokens=MAX_OUTPUT), lambda item: None)


def left(seq: Sequence) -> int:
    return MAX_OUTPUT - len(seq.output_ids)


def run_round(rng: random.Random, scheduler: Scheduler, state: FakeState) -> int:
    """One round as the engine runs it; the restores it made."""
    plan = scheduler.schedule(lambda seq: min(K, left(seq)))
    restores = state.apply(plan, scheduler)
    for seq in (s for group in plan.prefill for s in group):
        start, end = seq.num_computed, seq.num_computed + seq.chunk_len
        held = state.rows.get(seq.row, ()) if start else ()
        assert held == tuple(seq.token_ids[:start]), "a chunk continues from the wrong state"
        for point, slot in seq.snapshot_saves:
            assert start < point <= end and point % BLOCK == 0
            state.slots[slot] = tuple(seq.token_ids[:point])
        state.rows[seq.row] = tuple(seq.token_ids[:end])
        seq.num_computed, seq.chunk_len = end, 0
        if seq.num_computed == seq.prompt_len and not seq.output_ids:
            seq.output_ids.append(rng.randrange(50))
        scheduler.chunk_done(seq)
    # Decode runs over rows 0..n-1: the decoding sequences must hold them, whoever is still prefilling
    assert [seq.row for seq in plan.decode] == list(range(len(plan.decode)))
    if plan.decode:
        kept = {}
        for seq in plan.decode:  # a row stops early (a stop token) or takes its whole budget
            budget = min(K, left(seq))
            kept[seq] = rng.randint(1, budget) if rng.random() < 0.3 else budget
        steps = max(kept.values())
        for seq in plan.decode:
            assert state.rows[seq.row] == tuple(seq.token_ids[: seq.cache_len]), "decode from the wrong state"
            new = [rng.randrange(50) for _ in range(steps)]  # sampled; those past its stop are dropped
            stream = seq.token_ids + new  # what the row consumes: its newest token, then each step's
            for point, slot in seq.snapshot_saves:
                if point - seq.cache_len - 1 < steps:
                    state.slots[slot] = tuple(stream[:point])
            state.rows[seq.row] = tuple(stream[: seq.cache_len + steps])
            seq.output_ids += new[: kept[seq]]
            if kept[seq] < min(K, left(seq) + kept[seq]):
                seq.finish_reason = "stop"
            seq.num_computed = seq.cache_len
            scheduler.decoded(seq)
    done = [s for s in scheduler.running if s.finished or (s.decoding and left(s) <= 0)]
    state_moves(scheduler.release(done), state)
    return restores


def state_moves(moves, state: FakeState) -> None:
    for src, dst, _ in moves:
        state.rows[dst] = state.rows.get(src, ())


def check(scheduler: Scheduler, snapshots: SnapshotPool) -> None:
    held = Counter()
    for seq in scheduler.running:
        held.update(slot for _, slot in seq.snapshot_saves)
        if seq.boundary is not None:
            held[seq.boundary[1]] += 1
        assert seq.restore_slot is None  # restores are applied in the round that admits
    for seq in scheduler.waiting:
        assert not seq.snapshot_saves and seq.boundary is None and seq.restore_slot is None
    for slot in range(snapshots.num_slots):
        assert snapshots.refs[slot] == held[slot], f"slot {slot}"
    free, unreferenced = set(snapshots.free), set(snapshots.unreferenced)
    assert not free & unreferenced and not free & set(held) and not unreferenced & set(held)
    assert len(free) + len(unreferenced) + len(held) == snapshots.num_slots
    assert all(snapshots.cached[h] == s for s, h in snapshots.hash_of.items())
    assert all(s in snapshots.hash_of for s in unreferenced) and not free & set(snapshots.hash_of)


@settings(max_examples=3, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1))
def test_snapshots_are_restored_only_at_their_exact_prefix_and_counts_return_to_zero(seed):
    rng = random.Random(seed)
    pool = BlockPool(num_blocks=28, block_size=BLOCK)
    snapshots = SnapshotPool(num_slots=10, slot_bytes=1)
    pool.on_evict = snapshots.drop
    scheduler = Scheduler(max_num_seqs=5, max_num_batched_tokens=12, pool=pool, chunked_prefill=True,
                          prefix_caching=True, snapshots=snapshots, snapshot_every=2)
    state = FakeState()
    prefixes = [[rng.randrange(50) for _ in range(24)] for _ in range(3)]
    events, restores = Counter(), 0
    for i in range(EVENTS):
        event = rng.choices(["join", "round", "abort_waiting", "abort_running", "preempt", "evict"],
                            weights=[3, 6, 1, 1, 1, 1])[0]
        if event == "join":
            scheduler.add(new_sequence(rng, i, prefixes))
        elif event == "round":
            restores += run_round(rng, scheduler, state)
        elif event == "abort_waiting" and scheduler.waiting:
            assert scheduler.remove_waiting(rng.choice(list(scheduler.waiting)))
        elif event == "abort_running" and scheduler.running:
            state_moves(scheduler.release([rng.choice(scheduler.running)]), state)
        elif event == "preempt" and scheduler.running:
            moves: list = []
            scheduler._preempt(rng.choice(scheduler.running), moves, [])
            state_moves(moves, state)
        elif event == "evict" and snapshots.unreferenced:
            taken = [snapshots.allocate() for _ in range(len(snapshots.free) + 1)]  # the last one evicts
            for slot in taken:
                snapshots.release(slot)
        else:
            continue
        events[event] += 1
        check(scheduler, snapshots)
    counters = scheduler.counters
    assert min(events.values()) > 20 and restores > 20 and counters["preemptions"] > 10
    assert snapshots.counters["snapshot_evictions"] > 0 and pool.evictions > 0
    assert counters["chunked_prefills"] > 0 and counters["prefix_cache_hit_tokens"] > 0
    state_moves(scheduler.release(list(scheduler.running)), state)
    scheduler.waiting.clear()
    assert snapshots.num_held == 0 and all(r == 0 for r in snapshots.refs) and pool.num_used == 0
    assert len(snapshots.free) + len(snapshots.unreferenced) == snapshots.num_slots


def test_default_cpu_budget_adds_the_snapshot_share_to_the_blocks_of_max_num_seqs_sequences():
    # One max_model_len sequence must still fit in the blocks (it did not: the share came out of them).
    blocks, state_bytes, _ = pool_blocks(device=torch.device("cpu"), bytes_per_token=256, block_size=16, max_num_seqs=1,
                                      max_model_len=4096, kv_cache_memory=None, kv_cache_free_memory_fraction=0.8,
                                      state_fraction=0.2)
    assert (blocks - 1) * 16 >= 4096
    assert state_bytes >= 0.2 * (4096 * 256 + state_bytes) - 1
