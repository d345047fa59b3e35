"""Which sequences run this round and which blocks of the paged pool hold their tokens.

A round (see engine.py) decodes the running sequences K steps and prefills the joining ones.
`schedule` decides both, in this order:

1. Every decoding sequence gets the blocks its K/V of this round need (oldest first). When the
   pool runs dry, the newest running sequences are preempted: their blocks go back (full blocks
   stay in the prefix cache, so a resume may find them there), and they return to the front of the
   waiting queue, to be recomputed from their tokens so far (`Sequence.token_ids`). A resumed
   sequence's prefill samples nothing: its last output token is the next decode input, as if it
   had never left, so its output is unchanged.
2. Prefills already under way (chunked prefill) get their next chunk.
3. Waiting sequences join, first come first served, while rows and the per-round prompt-token
   budget (`max_num_batched_tokens`) allow and the pool has blocks for their chunk; a sequence
   that does not fit waits (a long prompt is never starved). With prefix caching a joining
   sequence first takes the cached blocks of its longest cached prefix and computes only the rest.
   Where the cache kinds allow a prefill to continue from a past (`chunked_prefill`), a prompt
   longer than what is left of the budget is prefilled over several rounds; elsewhere it runs
   whole, alone in its round.

Row i of the running batch is row i of the bounded cache kinds; the batch stays compact: a
sequence leaving (finished or preempted) hands its row to the last running sequence, whose row
state the runner then moves (`Round.moves`).

Prefill chunks are run in groups of similar length: one right-padded forward per group. Image
prompts vary several-fold in length, and padding a whole admission to its longest prompt spent a
large share of prefill compute on padding (batching prompts buys nothing on a CPU, and only a
little on a GPU once the batch is a few hundred tokens), so a group's padding is capped at
`MAX_PADDING` of its real tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Callable

from raypipe.decode.block_pool import BlockPool
from raypipe.decode.prefix_hash import extend_block_hashes
from raypipe.decode.sequence import Sequence

MAX_PADDING = 0.1  # a prefill group's padded tokens may exceed its real tokens by this fraction


@dataclasses.dataclass(slots=True)
class Round:
    decode: list[Sequence]  # decoding sequences, in row order
    prefill: list[list[Sequence]]  # groups; each sequence computes `chunk_len` tokens from `num_computed`
    moves: list[tuple[int, int, int]]  # `(src_row, dst_row, cache_len)` row moves to apply first
    preempted: list[Sequence]


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, pool: BlockPool, *,
                 chunked_prefill: bool, prefix_caching: bool):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pool = pool
        self.chunked_prefill = chunked_prefill
        self.prefix_caching = prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._arrivals = itertools.count()
        self.counters = dict(prefill_tokens_asked=0, prefix_cache_hit_tokens=0, preemptions=0, chunked_prefills=0)

    def add(self, seq: Sequence) -> None:
        seq.arrival = next(self._arrivals)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, decode_tokens: Callable[[Sequence], int]) -> Round:
        """This round's work; `decode_tokens(seq)` is how many tokens a decoding `seq` may still keep
        this round (K, or fewer near its end): the blocks it gets cover them."""
        moves: list[tuple[int, int, int]] = []
        preempted: list[Sequence] = []
        for seq in sorted((s for s in self.running if s.decoding), key=lambda s: s.arrival):
            if seq.row is not None and not self._grow(seq, seq.cache_len + decode_tokens(seq), moves, preempted):
                self._preempt(seq, moves, preempted)
        decode = [s for s in self.running if s.decoding]
        budget = self.max_num_batched_tokens
        prefill: list[Sequence] = []
        for seq in sorted((s for s in self.running if not s.decoding), key=lambda s: s.arrival):
            if seq.row is None or budget == 0:
                continue
            seq.chunk_len = min(seq.cache_len - seq.num_computed, budget)
            if self._grow(seq, seq.num_computed + seq.chunk_len, moves, preempted):
                budget -= seq.chunk_len
                prefill.append(seq)
            else:
                self._preempt(seq, moves, preempted)
        joining = self._admit(budget, scheduled=bool(prefill))
        groups = group_by_length(prefill + joining, MAX_PADDING)
        for seq in (s for group in groups for s in group if s.row is None):
            seq.row = len(self.running)
            self.running.append(seq)
        return Round(decode, groups, moves, preempted)

    def _admit(self, budget: int, scheduled: bool) -> list[Sequence]:
        joining: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) + len(joining) < self.max_num_seqs:
            seq = self.waiting[0]
            target = seq.cache_len  # a resumed sequence recomputes all but its newest token
            hit = self._cached_prefix(seq, target)
            chunk = target - len(hit) * self.pool.block_size
            if chunk > budget:
                if self.chunked_prefill:
                    chunk = budget
                elif scheduled or joining:
                    self.pool.release(hit)
                    break
            need = self.pool.blocks_for(len(hit) * self.pool.block_size + chunk)
            if need - len(hit) > self.pool.num_available:
                self.pool.release(hit)
                break
            self.waiting.popleft()
            seq.block_table = hit + self.pool.allocate(need - len(hit))
            seq.num_computed = len(hit) * self.pool.block_size
            seq.num_registered = len(hit)
            seq.chunk_len = chunk
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = seq.num_computed
            self.counters["prefill_tokens_asked"] += target
            self.counters["prefix_cache_hit_tokens"] += seq.num_computed
            self.counters["chunked_prefills"] += chunk < target - seq.num_computed
            budget -= chunk
            joining.append(seq)
        return joining

    def _cached_prefix(self, seq: Sequence, target: int) -> list[int]:
        """Cached blocks of `seq`'s longest cached prefix, referenced; at least one token is left to
        compute (a prefill needs a last position, and the block it writes must be its own)."""
        if not self.prefix_caching:
            return []
        full = (target - 1) // self.pool.block_size
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.pool.block_size, full, seq.placeholder_runs)
        return self.pool.take_cached(seq.block_hashes[:full])

    def _grow(self, seq: Sequence, num_tokens: int, moves: list, preempted: list) -> bool:
        """Blocks for `num_tokens` of `seq`, preempting newer sequences while the pool is short."""
        need = self.pool.blocks_for(num_tokens) - len(seq.block_table)
        while need > self.pool.num_available:
            newer = [s for s in self.running if s.arrival > seq.arrival]
            if not newer:
                return False
            self._preempt(max(newer, key=lambda s: s.arrival), moves, preempted)
        if need > 0:
            seq.block_table += self.pool.allocate(need)
        return True

    def _preempt(self, seq: Sequence, moves: list, preempted: list) -> None:
        moves += self.release([seq])
        seq.num_computed = 0
        seq.chunk_len = 0
        self.waiting.appendleft(seq)
        preempted.append(seq)
        self.counters["preemptions"] += 1

    def cache_blocks(self, seq: Sequence) -> None:
        """Register `seq`'s full computed blocks in the prefix cache (with prefix caching on)."""
        if not self.prefix_caching:
            return
        full = min(seq.num_computed // self.pool.block_size, len(seq.block_table))
        if full > seq.num_registered:
            extend_block_hashes(seq.block_hashes, seq.token_ids, self.pool.block_size, full, seq.placeholder_runs)
            for j in range(seq.num_registered, full):
                self.pool.register(seq.block_table[j], seq.block_hashes[j])
            seq.num_registered = full

    def remove_waiting(self, seq: Sequence) -> bool:
        try:
            self.waiting.remove(seq)
        except ValueError:
            return False
        return True

    def release(self, leaving: list[Sequence]) -> list[tuple[int, int, int]]:
        """Drop `leaving` from the running batch and give their blocks back (full computed blocks stay
        cached); returns `(src_row, dst_row, cache_len)` row moves to apply."""
        moves = []
        # Highest rows first: a row freed at the end never needs a move, and earlier rows stay valid.
        for seq in sorted(leaving, key=lambda s: s.row, reverse=True):
            self.cache_blocks(seq)
            self.pool.release(seq.block_table)
            seq.block_table, seq.num_registered = [], 0
            last = self.running.pop()
            if last is not seq:
                self.running[seq.row] = last
                moves.append((last.row, seq.row, last.cache_len))
                last.row = seq.row
            seq.row = None
        return moves


def group_by_length(seqs: list[Sequence], max_padding: float) -> list[list[Sequence]]:
    """`seqs` sorted by chunk length and cut into groups whose padding to their longest chunk is at
    most `max_padding` of their real tokens."""
    groups: list[list[Sequence]] = []
    tokens = 0
    for seq in sorted(seqs, key=lambda s: s.chunk_len):
        # Sorted ascending, so `seq` would be the group's longest chunk.
        if groups and (len(groups[-1]) + 1) * seq.chunk_len <= (1 + max_padding) * (tokens + seq.chunk_len):
            groups[-1].append(seq)
            tokens += seq.chunk_len
        else:
            groups.append([seq])
            tokens = seq.chunk_len
    return groups
