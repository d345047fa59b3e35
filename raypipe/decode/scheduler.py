"""Which sequences run: a FIFO waiting queue and a compact running batch.

Row i of the running batch is KV cache row i. Requests join only between rounds, at the end of
the batch, while rows are free and their prompt tokens fit the token budget; a request that does
not fit simply waits (first come, first served, so a long prompt is never starved). A request
that leaves hands its row to the last running sequence, whose cache the runner then moves.

Joining requests are prefilled in groups of similar prompt length: one right-padded forward per
group. Image prompts vary several-fold in length, and padding a whole admission to its longest
prompt spent a large share of prefill compute on padding (batching prompts buys nothing on a CPU,
and only a little on a GPU once the batch is a few hundred tokens), so a group's padding is capped
at `MAX_PADDING` of its real tokens.
"""

from __future__ import annotations

from collections import deque

from raypipe.decode.sequence import Sequence

MAX_PADDING = 0.1  # a prefill group's padded tokens may exceed its real tokens by this fraction


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

    def admit(self) -> list[list[Sequence]]:
        """Waiting sequences that join now, as prefill groups; each group holds consecutive rows at
        the end of the running batch."""
        joining: list[Sequence] = []
        tokens = 0
        while self.waiting and len(self.running) + len(joining) < self.max_num_seqs:
            seq = self.waiting[0]
            if joining and tokens + seq.prompt_len > self.max_num_batched_tokens:
                break
            joining.append(self.waiting.popleft())
            tokens += seq.prompt_len
        groups = group_by_length(joining, MAX_PADDING)
        for seq in (seq for group in groups for seq in group):
            seq.row = len(self.running)
            self.running.append(seq)
        return groups

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


def group_by_length(seqs: list[Sequence], max_padding: float) -> list[list[Sequence]]:
    """`seqs` sorted by prompt length and cut into groups whose padding to their longest prompt is
    at most `max_padding` of their real tokens."""
    groups: list[list[Sequence]] = []
    tokens = 0
    for seq in sorted(seqs, key=lambda s: s.prompt_len):
        # Sorted ascending, so `seq` would be the group's longest prompt.
        if groups and (len(groups[-1]) + 1) * seq.prompt_len <= (1 + max_padding) * (tokens + seq.prompt_len):
            groups[-1].append(seq)
            tokens += seq.prompt_len
        else:
            groups.append([seq])
            tokens = seq.prompt_len
    return groups
