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
   With `chunked_prefill` a prompt longer than what is left of the budget is prefilled over several
   rounds; without it, it runs whole, alone in its round. A waiting sequence whose next block (or,
   with row state, a better restore point) a prefill under way is computing waits for it instead of
   computing it too (`_would_recompute_pending`): rows sharing a long prompt that arrive together
   compute it once, in the first row, and join with the hit; the sequences behind it go ahead.
   A sequence served with a LoRA adapter joins only if its adapter holds, or can be given, one of the
   model's adapter slots (`lora_pool.py`: a slot no running or joining sequence uses); else it waits,
   keeping its place, and behind it only base-model rows join this round, so slots do free up for it
   (adapters of later requests cannot keep every slot busy forever) while base rows never wait for slots.

Models with sliding-window layers also have a window pool (`window_tables.py`): a sequence takes
window blocks as it takes full-attention blocks, gives back those that have left the window after
each chunk and each decode round (registered first: they stay cached), and a prefix hit is the
longest cached run of full-attention blocks whose window blocks right before its end are cached
too. Models with per-row state (linear attention; `cache_kinds.py`) also have a
`SnapshotPool`: a prefix hit for them is the longest cached run of blocks whose last block has a
state snapshot (`snapshot_pool.py`); that snapshot is restored into the sequence's row
(`Round.restores`) and the rest is prefilled from it. Which states are kept (`_plan_snapshots`,
`_plan_capture`), each at a block boundary `P` and registered under the hash of the block ending there:
   (a) the last block boundary a sequence's decode crossed, registered when it leaves (finished,
       aborted or preempted): the next turn of a chat repeats prompt + output, so it continues from
       there, recomputing less than a block;
   (b) branch points: where a joining prompt's cached run of blocks ends, so the next prompt
       sharing that prefix (a system prompt) finds a state there; and where a prompt waiting for a
       prefill's blocks leaves that prefill's prompt (`_wait_for_branch_point`), so that prompts
       sent together join at their branch point, not at the periodic state before it;
   (c) every `snapshot_every` blocks of a prefill, and the prompt's last block boundary.
A state inside a chunk is handed over by the chunk's one forward (`ModelRunner.prefill`).

Row i of the running batch is row i of the bounded cache kinds; the batch stays compact: a
sequence leaving (finished or preempted) hands its row to the last running sequence, whose row
state the runner then moves (`Round.moves`). Decode runs over rows `0..n-1`, so the decoding
sequences are put first (`_decoding_first`): with chunked prefill a sequence still prefilling can
hold a lower row than one that finished its prompt sooner; their row state is swapped through the
spare row (`max_num_seqs`).

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
from raypipe.decode.lora_pool import LoraPool
from raypipe.decode.prefix_hash import extend_block_hashes
from raypipe.decode.sequence import Sequence
from raypipe.decode.snapshot_pool import SnapshotPool
from raypipe.decode.window_tables import WindowTables

MAX_PADDING = 0.1  # a prefill group's padded tokens may exceed its real tokens by this fraction
# A waiting prompt waits for a prefill under way only to take at least this many of its tokens from it; a shorter
# shared run (a block two prompts happen to share) is computed twice. Waiting costs the prompt a round: at the end
# of a burst, a round of decode steps for the rows that waited alone (SGLang's in-batch prefix caching likewise
# puts a request back only from a 32-token match).
PENDING_PREFIX_MIN_TOKENS = 32


@dataclasses.dataclass(slots=True)
class Round:
    decode: list[Sequence]  # decoding sequences, in row order
    prefill: list[list[Sequence]]  # groups; each sequence computes `chunk_len` tokens from `num_computed`
    moves: list[tuple[int, int, int]]  # `(src_row, dst_row, cache_len)` row moves to apply first
    preempted: list[Sequence]
    restores: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # `(slot, row)`, after the moves


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, pool: BlockPool, *,
                 chunked_prefill: bool, prefix_caching: bool, snapshots: SnapshotPool | None = None,
                 snapshot_every: int = 1, window: WindowTables | None = None, loras: LoraPool | None = None):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pool = pool
        self.chunked_prefill = chunked_prefill
        self.prefix_caching = prefix_caching
        # None: every layer is paged; else the model's row state must be restored at a hit
        self.snapshots = snapshots
        self.snapshot_every = snapshot_every  # blocks between snapshots of a long prefill
        self.window = window  # None: no sliding-window layers
        self.loras = loras  # None: no LoRA adapters (every sequence runs the base model)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._arrivals = itertools.count()
        self.counters = dict(prefill_tokens_asked=0, prefix_cache_hit_tokens=0, preemptions=0, chunked_prefills=0,
                             deferred_admissions=0, lora_slot_waits=0)

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
        self._decoding_first(moves)  # after every preemption (a prefill's growth may preempt a newer decoder)
        decode = [s for s in self.running if s.decoding]  # rows 0..n-1
        joining = self._admit(budget, scheduled=bool(prefill))
        groups = group_by_length(prefill + joining, MAX_PADDING)
        restores = []
        for seq in (s for group in groups for s in group if s.row is None):
            seq.row = len(self.running)
            self.running.append(seq)
            if seq.restore_slot is not None:
                restores.append((seq.restore_slot, seq.row))
                seq.restore_slot = None
        if self.snapshots is not None and self.prefix_caching:
            for seq in decode:
                self._plan_capture(seq, decode_tokens(seq))
            planned: set[bytes] = set()  # one fill per state, however many prompts of the round pass it
            for seq in prefill + joining:
                self._plan_snapshots(seq, planned)
        return Round(decode, groups, moves, preempted, restores)

    def _decoding_first(self, moves: list[tuple[int, int, int]]) -> None:
        """Reorder the running batch so decoding sequences hold rows `0..n-1` (stable), appending the
        row moves: each cycle of the permutation goes through the spare row `max_num_seqs`."""
        order = sorted(self.running, key=lambda s: not s.decoding)
        if order == self.running:
            return
        spare, at = self.max_num_seqs, {s.row: s for s in self.running}
        source = {row: seq.row for row, seq in enumerate(order)}  # new row -> the row its state is in now
        done: set[int] = set()
        for start in range(len(order)):
            if start in done or source[start] == start:
                continue
            moves.append((start, spare, at[start].cache_len))
            row = start
            while source[row] != start:
                moves.append((source[row], row, at[source[row]].cache_len))
                done.add(row)
                row = source[row]
            moves.append((spare, row, at[start].cache_len))
            done.add(row)
        for row, seq in enumerate(order):
            seq.row = row
        self.running = order

    def _admit(self, budget: int, scheduled: bool) -> list[Sequence]:
        joining: list[Sequence] = []
        deferred: list[Sequence] = []
        pending = self._pending_blocks_and_states(self.running)
        busy = {s.lora_slot for s in self.running if s.lora_slot}  # adapter slots of running sequences
        slot_wait = False  # a sequence waits for an adapter slot: only base rows join behind it
        while self.waiting and budget > 0 and len(self.running) + len(joining) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.lora is not None:
                seq.lora_slot = 0 if slot_wait else self.loras.assign(seq.lora, busy) or 0
                if not seq.lora_slot:
                    self.counters["lora_slot_waits"] += not slot_wait
                    slot_wait = True
                    deferred.append(self.waiting.popleft())
                    continue
            target = seq.cache_len  # a resumed sequence recomputes all but its newest token
            hit, run = self._cached_prefix(seq, target)
            if self._would_recompute_pending(seq, len(hit), run, pending):
                self._give_back(seq, hit)
                deferred.append(self.waiting.popleft())
                continue
            chunk = target - len(hit) * self.pool.block_size
            if chunk > budget:
                if self.chunked_prefill:
                    chunk = budget
                elif scheduled or joining:
                    self._give_back(seq, hit)
                    break
            need = self.pool.blocks_for(len(hit) * self.pool.block_size + chunk)
            end = len(hit) * self.pool.block_size + chunk
            if need - len(hit) > self.pool.num_available or (
                    self.window is not None and self.window.need(seq, end) > self.window.pool.num_available):
                self._give_back(seq, hit)
                break
            self.waiting.popleft()
            seq.block_table = hit + self.pool.allocate(need - len(hit))
            if self.window is not None:
                self.window.grow(seq, end)
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
            busy.add(seq.lora_slot)
            self._add_pending(seq, pending)
        self.counters["deferred_admissions"] += len(deferred)
        self.waiting.extendleft(reversed(deferred))  # they keep their place at the front
        return joining

    def _pending_blocks_and_states(self, seqs: list[Sequence]) -> tuple[dict[bytes, Sequence], set[bytes]]:
        """Hashes of the blocks (with the prefill computing each) and of the state snapshots that the
        prefills among `seqs` will register as their prompts go on (this round's chunk and the ones after it)."""
        pending: tuple[dict[bytes, Sequence], set[bytes]] = ({}, set())
        if self.prefix_caching:
            for seq in seqs:
                if not seq.decoding and seq.row is not None:
                    self._add_pending(seq, pending)
        return pending

    def _add_pending(self, seq: Sequence, pending: tuple[dict[bytes, Sequence], set[bytes]]) -> None:
        if not self.prefix_caching:
            return
        size = self.pool.block_size
        blocks, states = pending
        extend_block_hashes(seq.block_hashes, seq.token_ids, size, seq.cache_len // size, seq.placeholder_runs, seq.prefix_root)
        blocks.update(dict.fromkeys(seq.block_hashes[seq.num_registered: seq.cache_len // size], seq))
        if self.snapshots is not None:
            states.update(seq.block_hashes[p // size - 1]
                          for p in self._snapshot_points(seq, seq.num_computed, seq.cache_len))

    def _would_recompute_pending(self, seq: Sequence, hit: int, run: int,
                                 pending: tuple[dict[bytes, Sequence], set[bytes]]) -> bool:
        """Whether `seq` would compute what a prefill under way is computing: at least
        `PENDING_PREFIX_MIN_TOKENS` in the blocks after its cached run of `run` blocks, or (row state) a state
        after its hit of `hit` blocks. It waits for that prefill's chunk instead (a shared prompt is then
        computed once, not by every row admitted with the first; SGLang's LPM policy puts back waiting
        requests sharing a prefix likewise), then joins with the longer hit."""
        blocks, states = pending
        hashes = seq.block_hashes[: (seq.cache_len - 1) // self.pool.block_size]
        end = run
        while end < len(hashes) and hashes[end] in blocks:  # hashes chain: one prefill computes them all
            end += 1
        if (end - run) * self.pool.block_size >= PENDING_PREFIX_MIN_TOKENS:
            if self.snapshots is not None:
                self._wait_for_branch_point(hashes[end - 1], end, pending)
            return True
        return any(hashes[j] in states for j in range(hit, run))

    def _wait_for_branch_point(self, last: bytes, end: int, pending: tuple[dict[bytes, Sequence], set[bytes]]) -> None:
        """A waiting prompt shares the blocks up to `end` (the last one's hash `last`) with a prefill under way,
        and leaves that prefill's prompt there: the prefill keeps a state there, so the waiting prompt hits the
        whole shared prefix. Without it, the prefill's states would lie only at its periodic points, and the first
        prompt to leave it would recompute up to `snapshot_every - 1` blocks from the one before (taking the
        branch-point state for the rest)."""
        blocks, states = pending
        blocks[last].branch_points.add(end * self.pool.block_size)
        states.add(last)

    def _cached_prefix(self, seq: Sequence, target: int) -> tuple[list[int], int]:
        """Cached blocks of `seq`'s longest cached prefix, referenced, and how many blocks the cached
        run of its hashes has (more, where a row-state or window model cannot continue at its end). At
        least one token is left to compute (a prefill needs a last position, and the block it writes
        must be its own). With row state, the prefix ends where a snapshot ends (`seq.restore_slot`,
        held), and where the cached blocks went on further, that point is `seq`'s branch point."""
        if not self.prefix_caching:
            return [], 0
        full = (target - 1) // self.pool.block_size
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.pool.block_size, full, seq.placeholder_runs, seq.prefix_root)
        if seq.wants_prompt_logprobs:
            return [], 0  # every prompt position's logits are asked: none of it may come from the cache
        hit = self.pool.take_cached(seq.block_hashes[:full])
        if self.snapshots is None and self.window is None:
            return hit, len(hit)
        keep = len(hit)
        while keep and not self._continues_at(seq, keep):
            keep -= 1
        self.pool.release(hit[keep:])
        if self.window is not None:
            self.window.take_hit(seq, seq.block_hashes, keep)
        if self.snapshots is not None:
            seq.branch_points = {len(hit) * self.pool.block_size} if len(hit) > keep else set()
            if keep:
                seq.restore_slot = self.snapshots.take(seq.block_hashes[keep - 1])
        return hit[:keep], len(hit)

    def _continues_at(self, seq: Sequence, blocks: int) -> bool:
        """Whether `seq` can continue after its first `blocks` cached blocks: a state snapshot ends there
        (row-state layers) and the window blocks before it are cached (sliding layers)."""
        hashes = seq.block_hashes
        return ((self.snapshots is None or self.snapshots.has(hashes[blocks - 1]))
                and (self.window is None or self.window.cached_before(hashes, blocks)))

    def _give_back(self, seq: Sequence, hit: list[int]) -> None:
        """`seq` does not join after all: let go of its hit."""
        self.pool.release(hit)
        if self.window is not None:
            self.window.release(seq)
        if seq.restore_slot is not None:
            self.snapshots.release(seq.restore_slot)
            seq.restore_slot = None

    def _plan_snapshots(self, seq: Sequence, planned: set[bytes]) -> None:
        """Slots for the states this round's chunk of `seq` passes and the cache lacks: every
        `snapshot_every` blocks, its branch point, its prompt's (or a resume's) last block boundary."""
        size = self.pool.block_size
        end = seq.num_computed + seq.chunk_len
        extend_block_hashes(seq.block_hashes, seq.token_ids, size, end // size, seq.placeholder_runs, seq.prefix_root)
        for p in self._snapshot_points(seq, seq.num_computed, end):
            key = seq.block_hashes[p // size - 1]
            if not self.snapshots.has(key) and key not in planned:
                slot = self.snapshots.allocate()
                if slot is None:
                    return
                planned.add(key)
                seq.snapshot_saves.append((p, slot))

    def _snapshot_points(self, seq: Sequence, start: int, end: int) -> list[int]:
        """The block boundaries in `(start, end]` where `seq`'s prefill keeps a state, ascending."""
        size = self.pool.block_size
        return [p for p in range(start - start % size + size, end + 1, size)
                if p % (self.snapshot_every * size) == 0 or p in seq.branch_points
                or p == seq.cache_len - seq.cache_len % size]

    def _plan_capture(self, seq: Sequence, steps: int) -> None:
        """A slot for the last block boundary `seq` may cross in this round's decode steps (what it
        consumed after each step: `cache_len + 1 .. cache_len + steps`)."""
        size = self.pool.block_size
        last = seq.cache_len + steps
        if last // size > seq.cache_len // size:
            slot = self.snapshots.allocate()
            if slot is not None:
                seq.snapshot_saves.append((last - last % size, slot))

    def decoded(self, seq: Sequence) -> None:
        """After `seq`'s decode steps: keep the boundary state it captured if its kept tokens reached it
        (steps past its stop ran on tokens it dropped), as the one it registers when it leaves; give
        back the window blocks it has left behind (cached first)."""
        if self.window is not None:
            self.cache_blocks(seq)
            self.window.trim(seq)
        for position, slot in seq.snapshot_saves:
            if position <= seq.cache_len:
                if seq.boundary is not None:
                    self.snapshots.release(seq.boundary[1])
                seq.boundary = (position, slot)
            else:
                self.snapshots.release(slot)
        seq.snapshot_saves = []

    def restored(self, restores: list[tuple[int, int]]) -> None:
        """The runner copied these snapshots into their rows: let go of them."""
        for slot, _ in restores:
            self.snapshots.release(slot)

    def _grow(self, seq: Sequence, num_tokens: int, moves: list, preempted: list) -> bool:
        """Blocks for `num_tokens` of `seq`, preempting newer sequences while the pool is short."""
        need = self.pool.blocks_for(num_tokens) - len(seq.block_table)
        while need > self.pool.num_available or (
                self.window is not None and self.window.need(seq, num_tokens) > self.window.pool.num_available):
            newer = [s for s in self.running if s.arrival > seq.arrival]
            if not newer:
                return False
            self._preempt(max(newer, key=lambda s: s.arrival), moves, preempted)
        if need > 0:
            seq.block_table += self.pool.allocate(need)
        if self.window is not None:
            self.window.grow(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence, moves: list, preempted: list) -> None:
        moves += self.release([seq])
        seq.num_computed = 0
        seq.chunk_len = 0
        self.waiting.appendleft(seq)
        preempted.append(seq)
        self.counters["preemptions"] += 1

    def chunk_done(self, seq: Sequence) -> None:
        """After `seq`'s prefill chunk: its full blocks and the state snapshots the chunk filled; the
        window blocks it has left behind go back."""
        self.cache_blocks(seq)
        if self.window is not None:
            self.window.trim(seq)
        if seq.snapshot_saves:
            self._register_snapshots(seq, seq.snapshot_saves)
            seq.snapshot_saves = []

    def cache_blocks(self, seq: Sequence) -> None:
        """Register `seq`'s full computed blocks in the prefix cache (with prefix caching on)."""
        if not self.prefix_caching:
            return
        full = min(seq.num_computed // self.pool.block_size, len(seq.block_table))
        if full > seq.num_registered:
            extend_block_hashes(seq.block_hashes, seq.token_ids, self.pool.block_size, full, seq.placeholder_runs, seq.prefix_root)
            for j in range(seq.num_registered, full):
                self.pool.register(seq.block_table[j], seq.block_hashes[j])
                if self.window is not None:
                    self.window.register(seq, j, seq.block_hashes[j])
            seq.num_registered = full

    def _register_snapshots(self, seq: Sequence, saves: list[tuple[int, int]]) -> None:
        """Register the filled snapshots `(position, slot)` at or before `seq`'s computed tokens (their
        blocks are registered); let go of the others."""
        for position, slot in saves:
            if position <= seq.num_computed:
                self.snapshots.register(slot, seq.block_hashes[position // self.pool.block_size - 1])
            else:
                self.snapshots.release(slot)

    def drop_snapshots(self, seq: Sequence) -> None:
        """Let go of every snapshot `seq` holds or was to fill, registering none (its state is in doubt)."""
        for _, slot in seq.snapshot_saves + ([seq.boundary] if seq.boundary else []):
            self.snapshots.release(slot)
        if seq.restore_slot is not None:
            self.snapshots.release(seq.restore_slot)
        seq.snapshot_saves, seq.boundary, seq.restore_slot = [], None, None

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
            if self.snapshots is not None:
                # (a): its last decode boundary, where the next turn of its chat continues
                self._register_snapshots(seq, seq.snapshot_saves + ([seq.boundary] if seq.boundary else []))
                seq.snapshot_saves, seq.boundary = [], None
                self.drop_snapshots(seq)
            self.pool.release(seq.block_table)
            seq.block_table, seq.num_registered = [], 0
            if self.window is not None:
                self.window.release(seq)
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
