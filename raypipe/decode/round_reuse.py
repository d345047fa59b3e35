"""When a decode round may reuse the K/V rows the previous round gathered instead of gathering them again.

An eager round copies its rows' blocks out of the paged pool into rows of its own, and its steps append their
tokens to those rows as well as to the pool (`paged_attention.py`). So at the end of a round its rows hold every
token their sequences have, and the next round of the same sequences can start from them: kept as they are when
the rows keep their order (a prefix of them when the last rows finished), copied row by row otherwise. On
`small`'s text workload (32 rows, 2 cores) the gather took 10-14 ms of a ~300 ms round, and up to ~130 ms when its
fresh buffers met page faults.

A round reuses only when every sequence was a row of the previous round, has exactly the tokens it had when that
round ended, over the same blocks, with the same shared leading blocks, and its rows have room for this round's
blocks: a round gathers `SPARE_BLOCKS` more than it needs (null blocks) for that. A prefill of one of those
sequences (a recompute after preemption) forgets them (`ModelRunner.prefill`); anything else that could have
changed their K/V changes their token count or blocks. Reused rows hold the same values a new gather would read
(the pool's, written by the same steps), so outputs do not change.
"""

from __future__ import annotations

import dataclasses

from raypipe.decode.sequence import Sequence

SPARE_BLOCKS = 4  # a gathered round's rows hold this many more blocks (64 tokens at block size 16: 8 rounds of 8)


@dataclasses.dataclass(frozen=True)
class KeptRound:
    rows: dict[Sequence, tuple[int, int, tuple[int, ...]]]  # seq -> (its row, its tokens, the blocks holding them)
    shared_blocks: int
    capacity_blocks: int  # blocks each kept row has room for

    @classmethod
    def after(cls, seqs: list[Sequence], steps: int, shared_blocks: int, capacity_blocks: int,
              block_size: int) -> "KeptRound":
        """What a round of `seqs` (row i = seqs[i]) leaves once it has run `steps` steps, before the engine takes
        their tokens: a row that goes on has `steps` more tokens cached (one that stopped sooner has ended)."""
        ends = [s.cache_len + steps for s in seqs]
        return cls({s: (row, end, tuple(s.block_table[: -(-end // block_size)]))
                    for row, (s, end) in enumerate(zip(seqs, ends))}, shared_blocks, capacity_blocks)

    def rows_for(self, seqs: list[Sequence], width: int, shared_blocks: int) -> list[int] | None:
        """The kept row each of `seqs` continues, for a round `width` blocks wide; None if any cannot."""
        if shared_blocks != self.shared_blocks or width > self.capacity_blocks:
            return None
        rows = []
        for s in seqs:
            kept = self.rows.get(s)
            if kept is None or kept[1] != s.cache_len or tuple(s.block_table[: len(kept[2])]) != kept[2]:
                return None
            rows.append(kept[0])
        return rows

    def holds_any(self, seqs: list[Sequence]) -> bool:
        return any(s in self.rows for s in seqs)
