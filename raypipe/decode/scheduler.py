"""Which sequences run: a FIFO waiting queue and a compact running batch.

Row i of the running batch is KV cache row i. Requests join only between rounds, at the end of
the batch, while rows are free and the padded prefill fits the token budget; a request that does
not fit simply waits (first come, first served, so a long prompt is never starved). A request
that leaves hands its row to the last running sequence, whose cache the runner then moves.
"""

from __future__ import annotations

from collections import deque

from raypipe.decode.sequence import Sequence


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[Sequence]:
        """Waiting sequences that join now, already given rows at the end of the running batch."""
        admitted: list[Sequence] = []
        longest = 0
        while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            seq = self.waiting[0]
            padded = (len(admitted) + 1) * max(longest, seq.prompt_len)
            if admitted and padded > self.max_num_batched_tokens:
                break
            self.waiting.popleft()
            seq.row = len(self.running) + len(admitted)
            longest = max(longest, seq.prompt_len)
            admitted.append(seq)
        self.running.extend(admitted)
        return admitted

    def remove_waiting(self, seq: Sequence) -> bool:
        try:
            self.waiting.remove(seq)
        except ValueError:
            return False
        return True

    def release(self, leaving: list[Sequence]) -> list[tuple[int, int, int]]:
        """Drop `leaving` from the running batch; returns `(src_row, dst_row, cache_len)` moves to apply."""
        moves = []
        # Highest rows first: a row freed at the end never needs a move, and earlier rows stay valid.
        for seq in sorted(leaving, key=lambda s: s.row, reverse=True):
            last = self.running.pop()
            if last is not seq:
                self.running[seq.row] = last
                moves.append((last.row, seq.row, last.cache_len))
                last.row = seq.row
            seq.row = None
        return moves
