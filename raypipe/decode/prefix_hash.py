"""Block hashes for automatic prefix caching: what a full block's K/V depend on, as 16 bytes.

The K/V of block j depend on every token before and in it. So a block's hash chains its parent's
hash with its own token ids, and, where those tokens are placeholders of a visual item, with what
the placeholders stand for: the item's content hash and the offset of the block's first row inside
the item (two images of the same size have the same placeholder ids, and the same image can sit at
different offsets of a block). Positions need no key of their own: a family's positions (Qwen's 3-D
mrope included) follow from the tokens and items before and in the block, which the chain covers.

An item is keyed by its identity, never by its embedding's bits: its content hash (of its pixels as the
tower consumes them, so of its frame sampling and resize too) and the layout parameters that shaped its
tokens (kind, grid, a video's seconds per grid and EVS rate), as vLLM keys multimodal items by their
hash. The bits of the same image's embedding follow how it was encoded (which companions shared its
forward, the kernels of the machine, fp32 or bf16): keyed by them, the same image would miss after an
embedding-cache eviction or when another encoder replica encoded it. An item without a content hash (a layout made
by hand) gets a digest of its own, so no block from it on is ever shared.

A sequence served with a LoRA adapter computes different K/V (and row state) for the same tokens, so its
chain starts from the adapter's key (`chain_root`) instead of nothing: a block computed under one adapter
is never a hit for another adapter or for the base model. The key is the adapter's fingerprint, a sha256
of the bytes its weights and config were read from (`models/lora.py`), not its name: adapters are loaded
and unloaded while the engine runs, and a name loaded again with other weights must not hit the blocks
computed under the old ones. A request's `cache_salt`
(vLLM's field) goes into the same key: tenants with different salts never hit each other's blocks, so
one cannot learn from its latency what another asked.
"""

from __future__ import annotations

import hashlib
import os
from array import array

from raypipe.models.prompt import token_runs

DIGEST_BYTES = 16


def item_digest(layout) -> bytes:
    if layout.content_hash is None:
        return os.urandom(DIGEST_BYTES)
    identity = (layout.content_hash, layout.kind, tuple(layout.grid), layout.seconds_per_grid, layout.pruning_rate)
    return hashlib.blake2b(repr(identity).encode(), digest_size=DIGEST_BYTES).digest()


def chain_root(lora: str | None, cache_salt: str | None = None) -> bytes:
    """The chain's start for a sequence served with the LoRA adapter of key `lora` (its fingerprint) and salted
    with `cache_salt`; empty for the base model without a salt."""
    if lora is None and cache_salt is None:
        return b""
    key = repr(("lora", lora, "salt", cache_salt)).encode()
    return hashlib.blake2b(key, digest_size=DIGEST_BYTES).digest()


def placeholder_runs(ids: list[int], layouts, adapter) -> tuple[tuple[int, int, bytes, int], ...]:
    """`(start, end, item digest, row offset of start inside the item)` per run of placeholder tokens;
    each item owns `adapter.prompt_runs(layout)` consecutive runs (checked by `request.check_request`)."""
    runs = iter(token_runs(ids, adapter.placeholder_token_ids.values()))
    out = []
    for layout in layouts:
        digest, offset = item_digest(layout), 0
        for length in adapter.prompt_runs(layout):
            start, _ = next(runs)
            out.append((start, start + length, digest, offset))
            offset += length
    return tuple(out)


def extend_block_hashes(hashes: list[bytes], tokens: list[int], block_size: int, num_blocks: int,
                        runs: tuple[tuple[int, int, bytes, int], ...], root: bytes = b"") -> None:
    """Append to `hashes` (a sequence's chain so far, started from `root`) until it covers `num_blocks`
    full blocks of `tokens`."""
    while len(hashes) < num_blocks:
        j = len(hashes)
        start, end = j * block_size, (j + 1) * block_size
        h = hashlib.blake2b(hashes[-1] if hashes else root, digest_size=DIGEST_BYTES)
        h.update(array("q", tokens[start:end]).tobytes())
        for run_start, run_end, digest, offset in runs:
            if run_start < end and run_end > start:
                h.update(digest)
                h.update((offset + max(start - run_start, 0)).to_bytes(8, "little"))
        hashes.append(h.digest())


def prompt_block_hashes(ids: list[int], layouts, adapter, block_size: int, max_blocks: int,
                        lora: str | None = None, cache_salt: str | None = None) -> list[bytes]:
    """The hashes the engine looks a prompt's prefix up by (every full block but the one holding its last
    token, which a prefill always computes), at most the first `max_blocks`: what a request router keys
    replicas by (`serve/prefix_router.py`), computed where the prompt is built."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, ids, block_size, min((len(ids) - 1) // block_size, max_blocks),
                        placeholder_runs(ids, layouts, adapter), chain_root(lora, cache_salt))
    return hashes
