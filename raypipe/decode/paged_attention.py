"""Full-attention layers over the paged KV cache: K/V in blocks from one pool, read by gather.

Each full-attention layer owns keys and values of shape `(num_blocks, block_size, kv_heads,
head_dim)`: token-major inside a block, so the flat view `(num_blocks * block_size, kv_heads,
head_dim)` is indexed by token slot (`block_id * block_size + offset`). The cache computes, once per
forward and for every layer alike, the token slots this forward writes and the blocks each row
reads (`WritePattern.write_slots` / `read_blocks`, from the rows' block tables).

A forward writes its new K/V with one `index_copy_` and reads each row's blocks in table order with
one `index_select` over whole blocks (`block_size x kv_heads x head_dim` contiguous elements each:
a gather by token slot moved 512-byte pieces and cost three times the step at batch 32), viewed as
`(rows, kv_heads, kv_len, head_dim)`: from there the masks and transformers' attention functions
(SDPA, eager) run exactly as over contiguous rows, which keeps greedy output equal to `generate()`.
Why a gather and not a paged kernel: on a CPU no maintained paged-attention kernel exists for this
torch, and the gather is one copy of the keys a step attends over, next to attention that reads
them anyway (`raypipe bench kv` measures it against a contiguous cache). Columns past a row's own
length read whatever their blocks hold (the null block for table padding) and are masked.

A decode round of K eager steps gathers its rows' blocks once (`begin_round`: one copy per layer,
head-major `(rows, kv_heads, round length, head_dim)`, keys as `(rows, kv_heads, head_dim, round length)` on a
CPU in fp32), then every step appends its token to those rows as well as to the pool and attends over a prefix
view of them: a gather per step copied every row's whole K/V each step, which at batch 32 cost more than the
rest of the step on a CPU. Head-major because the decode attention (`attention.py`) then runs every (row, KV
head) pair as one batched GEMM over contiguous keys. The rows are kept when the round ends, with room for a few
more blocks, and the next round of the same sequences continues them instead of gathering (`round_reuse.py`);
the pool stays the K/V every other reader reads.

Blocks every row of a round shares from the start (a system prompt, a document, a chat's template head: the
prefix cache gave them one set of blocks) are gathered once, not once per row (`begin_round(shared_blocks=)`):
the rows then hold only what follows, and the keys returned carry the shared part as `SHARED_PREFIX`, which the
engine's decode attention reads once for every row's queries (`attention.py`). Sixteen rows over a shared
800-token prompt otherwise read sixteen copies of its K/V each step.

A prefill with no cached past (every row starts at token 0) attends over its own fresh K/V, as
before paging; a prefill that continues a cached prefix or an earlier chunk reads through the table.
"""

from __future__ import annotations

import torch

from raypipe.decode.block_pool import NULL_BLOCK
from raypipe.decode.cache_kinds import CacheLimits, LayerCache, WritePattern, additive

# Attribute of a round's keys: the shared blocks every row attends, (K transposed `(1, kv_heads, head_dim, length)`,
# V `(1, kv_heads, length, head_dim)`).
SHARED_PREFIX = "shared_prefix"


class PagedAttentionLayer(LayerCache):
    layer_type = "full_attention"
    continues_rounds = True  # a round's rows stay valid for the next round of the same sequences

    def __init__(self, text_config, limits: CacheLimits, num_blocks: int | None = None):
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        self.heads, self.head_dim = text_config.num_key_value_heads, head_dim
        shape = (limits.num_blocks if num_blocks is None else num_blocks, limits.block_size, self.heads, head_dim)
        self.keys = torch.zeros(shape, device=limits.device, dtype=limits.dtype)
        self.values = torch.zeros(shape, device=limits.device, dtype=limits.dtype)
        self.round: tuple[torch.Tensor, torch.Tensor] | None = None  # this decode round's rows (K, V)
        self.kept: tuple | None = None  # the last round's (rows, shared, shared_len), for the next to continue
        self.keys_transposed = limits.device.type == "cpu" and limits.dtype == torch.float32  # round K as (.., D, L)
        self.shared: tuple[torch.Tensor, torch.Tensor] | None = None  # the round's shared leading blocks (K, V)
        self.shared_len = 0  # tokens in them; the rows hold positions from here

    @staticmethod
    def bytes_per_token(text_config, dtype: torch.dtype) -> int:
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        return 2 * text_config.num_key_value_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values]

    @staticmethod
    def access(pattern: WritePattern) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The token slots this forward writes and the blocks it reads, through this kind's block tables."""
        return pattern.write_slots, pattern.read_blocks

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, pattern: WritePattern):
        keys = self.keys.view(-1, self.heads, self.head_dim)
        values = self.values.view(-1, self.heads, self.head_dim)
        write_slots, read_blocks = self.access(pattern)
        if pattern.is_prefill:
            # (B, H, W, D) -> the real tokens, row-major: (N, H, D)
            keys.index_copy_(0, write_slots, key_states.transpose(1, 2)[pattern.real])
            values.index_copy_(0, write_slots, value_states.transpose(1, 2)[pattern.real])
            if not pattern.has_past:
                return key_states, value_states
        else:
            keys.index_copy_(0, write_slots, key_states[:, :, 0])
            values.index_copy_(0, write_slots, value_states[:, :, 0])
            if pattern.in_round:
                round_keys, round_values = self.round
                at, end = pattern.write_index - self.shared_len, pattern.kv_len - self.shared_len
                if self.keys_transposed:
                    round_keys[pattern.row_ids, :, :, at] = key_states[:, :, 0]
                    rows_keys = round_keys[..., :end].transpose(2, 3)
                else:
                    round_keys[pattern.row_ids, :, at] = key_states[:, :, 0]
                    rows_keys = round_keys[:, :, :end]
                round_values[pattern.row_ids, :, at] = value_states[:, :, 0]
                if self.shared is not None:
                    setattr(rows_keys, SHARED_PREFIX, self.shared)
                return rows_keys, round_values[:, :, :end]
        shape = (key_states.shape[0], pattern.kv_len, self.heads, self.head_dim)
        return (self.keys.index_select(0, read_blocks).view(shape).transpose(1, 2),
                self.values.index_select(0, read_blocks).view(shape).transpose(1, 2))

    def begin_round(self, tables: torch.Tensor, shared_blocks: int = 0, kept_rows: list[int] | None = None,
                    spare_blocks: int = 0) -> None:
        """Gather the K/V of the blocks in `tables` `(rows, blocks)` into this round's rows, head-major, with room for
        `spare_blocks` more; the first `shared_blocks` (the same in every row, full, none written this round) once
        for all rows instead. `kept_rows`: row i continues the previous round's row `kept_rows[i]`, which already
        holds its K/V (`round_reuse.py`): taken from there instead."""
        kept, self.kept = self.kept, None  # a new gather must not hold the last round's rows beside its own
        if kept_rows is not None and kept is not None:
            (keys, values), self.shared, self.shared_len = kept
            if kept_rows == list(range(len(kept_rows))):
                self.round = keys[: len(kept_rows)], values[: len(kept_rows)]
            else:
                index = torch.tensor(kept_rows, device=keys.device)
                self.round = keys.index_select(0, index), values.index_select(0, index)
            return

        def gather(blocks: torch.Tensor, rows: int, keys_transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
            shape = (rows, -1, self.heads, self.head_dim)
            keys, values = (pool.index_select(0, blocks.reshape(-1)).view(shape) for pool in (self.keys, self.values))
            return (keys.permute(0, 2, 3, 1) if keys_transposed else keys.transpose(1, 2)).contiguous(), \
                values.transpose(1, 2).contiguous()

        # Keys kept transposed, (rows, Hkv, D, L), where the decode attention reads them (CPU, fp32, `attention.py`):
        # its score GEMMs then read each row's keys as a plain matrix. Over a transposed view they ran 1.5-2x slower
        # (64 pairs x 300 keys, 2 cores), and a shared prefix's one big GEMM 17x slower.
        if shared_blocks:
            self.shared = gather(tables[0, :shared_blocks], 1, True)
        else:
            self.shared = None
        self.shared_len = shared_blocks * self.keys.shape[1]
        own = torch.nn.functional.pad(tables[:, shared_blocks:], (0, spare_blocks), value=NULL_BLOCK)
        self.round = gather(own, tables.shape[0], self.keys_transposed)

    def end_round(self) -> None:
        """The round's rows are kept for the next round to continue (`begin_round(kept_rows=)`), where it can."""
        self.kept = (self.round, self.shared, self.shared_len) if self.continues_rounds else None
        self.round, self.shared, self.shared_len = None, None, 0

    def move_row(self, src: int, dst: int, length: int) -> None:
        pass  # a sequence's K/V follow its block table, not its batch row

    @classmethod
    def prefill_mask(cls, pattern, width, dtype):
        """`(B, 1, W, kv_len)`: row b's query j is position `starts[b] + j`; it sees keys up to itself
        and none past the row's end (padded queries see the row's real keys: no all-masked row).

        None where no row has cached keys before its chunk: the keys are then the chunk's own, right-padded, so
        a real query's causal keys are all real and SDPA's `is_causal` is the same attention (a padded query's
        output is never read). Its flash kernel then skips the blocks above the diagonal instead of adding a
        mask to them: prefill's attention took ~22% of a `small` prefill with the mask."""
        if not pattern.has_past:
            return None
        query = pattern.starts[:, None] + torch.arange(width, device=pattern.starts.device)[None, :]
        key = torch.arange(pattern.kv_len, device=pattern.starts.device)
        ends = pattern.starts + pattern.lengths
        allowed = (key[None, None, :] <= query[:, :, None]) & (key[None, None, :] < ends[:, None, None])
        return additive(allowed[:, None], dtype)

    @classmethod
    def decode_mask(cls, pattern, dtype):
        """`(B, 1, 1, kv_len)`: each row sees its keys up to and including the new one."""
        pos = torch.arange(pattern.kv_len, device=pattern.write_index.device)
        return additive((pos[None, :] <= pattern.write_index[:, None])[:, None, None], dtype)


def token_slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat slots of `positions` `(B, L)` through block tables `(B, max_blocks)` (padded with the null block)."""
    return tables.gather(1, positions // block_size) * block_size + positions % block_size
