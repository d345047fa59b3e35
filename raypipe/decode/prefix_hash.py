"""Block hashes for automatic prefix caching: what a full block's K/V depend on, as 16 bytes.

The K/V of block j depend on every token before and in it. So a block's hash chains its parent's
hash with its own token ids, and, where those tokens are placeholders of a visual item, with what
the placeholders stand for: the item's content hash and the offset of the block's first row inside
the item (two images of the same size have the same placeholder ids, and the same image can sit at
different offsets of a block). Positions need no key of their own: a family's positions (Qwen's 3-D
mrope included) follow from the tokens and items before and in the block, which the chain covers.

An item's content hash is taken of its embedding rows (after EVS pruning) and its layout (kind,
grid, seconds per grid): the rows are what the language model reads, so the key is right whatever
made them (the encoder, its cache, a caller passing embeddings), and it costs ~1 ms per MB of rows
in the caller's task.
"""

from __future__ import annotations

import hashlib
from array import array

import torch

from raypipe.models.prompt import token_runs

DIGEST_BYTES = 16


def item_digest(rows: torch.Tensor, layout) -> bytes:
    h = hashlib.blake2b(repr((layout.kind, tuple(layout.grid), layout.seconds_per_grid)).encode(),
                        digest_size=DIGEST_BYTES)
    h.update(rows.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


def placeholder_runs(ids: list[int], layouts, rows: torch.Tensor | None, adapter
                     ) -> tuple[tuple[int, int, bytes, int], ...]:
    """`(start, end, item digest, row offset of start inside the item)` per run of placeholder tokens.

    `rows` are the visual rows in prompt order, as `request.visual_rows` made them; each item owns
    `adapter.prompt_runs(layout)` consecutive runs (checked by `request.check_request`)."""
    if rows is None:
        return ()
    runs = iter(token_runs(ids, adapter.placeholder_token_ids.values()))
    out, first_row = [], 0
    for layout in layouts:
        lengths = adapter.prompt_runs(layout)
        digest = item_digest(rows[first_row: first_row + sum(lengths)], layout)
        offset = 0
        for length in lengths:
            start, _ = next(runs)
            out.append((start, start + length, digest, offset))
            offset += length
        first_row += sum(lengths)
    return tuple(out)


def extend_block_hashes(hashes: list[bytes], tokens: list[int], block_size: int, num_blocks: int,
                        runs: tuple[tuple[int, int, bytes, int], ...]) -> None:
    """Append to `hashes` (a sequence's chain so far) until it covers `num_blocks` full blocks of `tokens`."""
    while len(hashes) < num_blocks:
        j = len(hashes)
        start, end = j * block_size, (j + 1) * block_size
        h = hashlib.blake2b(hashes[-1] if hashes else b"", digest_size=DIGEST_BYTES)
        h.update(array("q", tokens[start:end]).tobytes())
        for run_start, run_end, digest, offset in runs:
            if run_start < end and run_end > start:
                h.update(digest)
                h.update((offset + max(start - run_start, 0)).to_bytes(8, "little"))
        hashes.append(h.digest())
