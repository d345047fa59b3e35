"""A decode step with static shapes: bucketed batch and KV length, captured once per bucket (CUDA graphs) or
compiled (torch.compile on CPU, the batch buckets sharing a graph).

An eager decode step at batch 32 on a CPU spends most of its time in Python and dispatch around
small GEMMs, and its shapes change every step (the batch as requests come and go, the KV length by
one per step), which defeats both `torch.compile` and CUDA graphs. Here every step is padded to a
bucket `(B, K)`: `B` rows from `batch_buckets` (the running rows, then padding rows), `K` KV
columns from `kv_buckets`. On GPU each bucket is one captured CUDA graph, replayed with its input
buffers refilled. On CPU, with two batch buckets or more above 1, the batch dimension is left dynamic to
inductor, so one compiled forward serves every batch bucket (dynamo compiles batch 1 apart, as it
specializes sizes 0 and 1; at the second KV bucket its automatic dynamic shapes make the KV length
dynamic too): on `small-qwen3.5` with batch buckets (1, 8, 32), 2 graphs compiled in 139 s against 3 in
184 s with a graph per bucket, the steps as fast (measured side by side, 2 cores). Only the model forward and the logits are in it; sampling stays outside.

Why padding is harmless:
- KV columns past a row's own length are masked (additive mask at the dtype's minimum, so their
  softmax weight is exactly 0); they only make the attention GEMMs a little longer.
- Padding rows have block tables of the null block only (`block_pool.NULL_BLOCK`): they write and
  read nothing any sequence owns. Their logits are dropped.
- Block tables are padded with the null block up to the bucket's KV length, so the token slots a
  step writes and the blocks it reads (`WritePattern.write_slots` / `read_blocks`) have the bucket's static shape;
  they are recomputed from the step's tables and copied into the bucket's buffers, like the mask.

With LoRA adapters every step computes every slot's delta (`LoraRows.every_slot`): a one-hot mask buffer per
bucket, refilled per step, picks each row's adapter, so one graph serves any mix (base-model and padding rows
take slot 0, whose factors are zeros).

Every layer kind of the cache (`cache_kinds.py`) runs in it:
- full attention reads its rows' blocks through the padded block tables (above);
- sliding-window layers read theirs through window tables padded the same way (null blocks for the
  padding rows and for blocks that left the window, which the window mask hides anyway);
- gated-delta-net layers (row state: conv inputs and recurrent state) read their rows through an index
  buffer, `state_rows`: row i's own for the running rows, the spare row (`max_num_seqs`, which only a
  swap between rounds uses) for the padding rows, so a padding row never writes a row that a prefill
  running beside the step may be filling. The rows are read as copies and written back after the step
  (`KVCache.keep_decode_rows`), where the eager step updates them in place.
A cache with a kind not listed in `STATIC_KINDS` runs eager (`supports` says why). Greedy tokens equal
the eager step's, which the tests check against transformers' `generate()`.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import pathlib
import time

import torch

from raypipe.decode.kv_cache import KVCache
from raypipe.models.presets import cache_root

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
KV_BUCKET_MIN = 256  # KV buckets double from here up to max_model_len


def batch_buckets_for(max_num_seqs: int, buckets=DEFAULT_BATCH_BUCKETS) -> tuple[int, ...]:
    return tuple(sorted({b for b in buckets if b < max_num_seqs} | {max_num_seqs}))


def kv_buckets_for(max_model_len: int, smallest: int = KV_BUCKET_MIN) -> tuple[int, ...]:
    out, k = [], smallest
    while k < max_model_len:
        out.append(k)
        k *= 2
    return (*out, max_model_len)


STATIC_KINDS = frozenset({"full_attention", "sliding_attention", "linear_attention"})


def supports(cache) -> str | None:
    """None if the static step can run on `cache`, else the reason it cannot."""
    kinds = sorted(set(cache.layer_types) - STATIC_KINDS)
    if kinds:
        return f"layer kinds {kinds} have no static-shape decode step"
    return None


class StaticDecodeStep:
    """`step(tokens, positions, write_index, kv_len, tables, ...) -> logits (n, vocab)` through bucketed static shapes."""

    def __init__(self, model, cache: KVCache, *, batch_buckets: tuple[int, ...], kv_buckets: tuple[int, ...],
                 use_cuda_graphs: bool | None = None):
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.kv_buckets = tuple(sorted(kv_buckets))
        if self.batch_buckets[-1] < cache.max_num_seqs or self.kv_buckets[-1] < cache.max_model_len:
            raise ValueError("the largest buckets must cover max_num_seqs and max_model_len")
        self.pad_index = 0  # padding rows write (and read) the null block; any index inside their table will do
        self.use_cuda_graphs = self.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self.loras = None  # the model's `LoraSlots` once it serves LoRA adapters (the runner sets it)
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None
        # A dynamic batch dimension pays where it saves compiles: two batch buckets or more above 1 (dynamo
        # compiles batch 1 apart anyway); a graph for one static shape compiles sooner.
        self.dynamic_batch = not self.use_cuda_graphs and sum(b > 1 for b in self.batch_buckets) > 1
        self._compiled = None if self.use_cuda_graphs else _compile(self._forward, len(self.batch_buckets)
                                                                     * len(self.kv_buckets), self.dynamic_batch)

    def bucket(self, n: int, kv_len: int) -> tuple[int, int]:
        return (self.batch_buckets[bisect.bisect_left(self.batch_buckets, n)],
                self.kv_buckets[bisect.bisect_left(self.kv_buckets, kv_len)])

    @torch.inference_mode()
    def warmup(self, batch_sizes=None, kv_lens=None) -> float:
        """Compile (CPU) or capture (CUDA) buckets now, not on a request's first step; seconds taken.

        By default every bucket with CUDA graphs (a capture takes milliseconds); on CPU every batch
        bucket at the smallest KV bucket, where every request starts (a compile takes seconds, so
        longer KV buckets compile on first use).
        """
        start = time.perf_counter()
        if kv_lens is None:
            kv_lens = self.kv_buckets if self.use_cuda_graphs else self.kv_buckets[:1]
        for b in batch_sizes or self.batch_buckets:
            for k in kv_lens:
                n = min(b, self.cache.max_num_seqs)
                tokens = torch.zeros(n, dtype=torch.long, device=self.device)
                positions = torch.zeros((3, n, 1), dtype=torch.long, device=self.device)
                # Warm-up rows have null-block tables: their writes land where no sequence reads.
                write_index = torch.full((n,), self.pad_index, dtype=torch.long, device=self.device)
                tables = torch.zeros((n, 1), dtype=torch.long, device=self.device)  # the null block
                # Row-state rows 0..n-1 take garbage here: at start no sequence holds them, and a row
                # that starts at token 0 ignores what its row held.
                window_tables = tables if self.cache.window_blocks else None
                self(tokens, positions, write_index, k, tables, window_tables=window_tables)
        return time.perf_counter() - start

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, write_index: torch.Tensor,
                 kv_len: int, tables: torch.Tensor, lora_slots: list[int] | None = None,
                 window_tables: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of one step; `lora_slots`: each row's LoRA adapter slot (None: every row the base model's);
        `window_tables`: the rows' sliding-window tables, where the model has sliding layers."""
        n = tokens.shape[0]
        key = self.bucket(n, kv_len)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(self, *key)
        return bucket.run(tokens, positions, write_index, tables, window_tables, n, lora_slots)

    def model_changed(self) -> None:
        """The model's modules changed (LoRA wrapped more linears): captured CUDA graphs replay the old ones, so
        each bucket captures again on its next step. A compiled forward needs nothing: torch.compile's guards
        on the modules' types recompile it.

        The graphs share one memory pool, which torch frees with its last graph: a capture into the old handle
        then fails inside the caching allocator ("use_count > 0"), so the new graphs take a new pool."""
        for bucket in self._buckets.values():
            bucket.graph = bucket.logits = None
        if self.use_cuda_graphs:
            self._pool = torch.cuda.graph_pool_handle()

    def _forward(self, tokens, positions, mask, cache):
        hidden = self.model(self.model.embed(tokens[:, None]), positions, mask, cache)
        return self.model.logits(hidden[:, -1])


class _Bucket:
    """Static input buffers of one `(B, K)` bucket, its own cache view, and its graph once captured."""

    def __init__(self, step: StaticDecodeStep, batch: int, kv_len: int):
        self.step = step
        device = step.device
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions = torch.zeros((3, batch, 1), dtype=torch.long, device=device)
        self.write_index = torch.full((batch,), step.pad_index, dtype=torch.long, device=device)
        self.tables = torch.zeros((batch, -(-kv_len // step.cache.block_size)), dtype=torch.long, device=device)
        self.window_tables = torch.zeros_like(self.tables) if step.cache.window_blocks else None
        self.row_range = torch.arange(batch, device=device)
        self.spare_row = step.cache.max_num_seqs  # padding rows' row state (see the module's docstring)
        self.state_rows = torch.full((batch,), self.spare_row, dtype=torch.long, device=device)
        self.row_state = bool(step.cache.row_state_kinds)  # whether the forward reads `state_rows`
        self.cache = step.cache.view()
        self.cache.prepare_decode(batch, self.write_index, kv_len, self.tables, self.window_tables,
                                  self.state_rows if self.row_state else None)
        self.mask = self.cache.masks(step.cache.dtype)  # {layer type: tensor}, refilled in place per step
        self.kv_len = kv_len
        self.lora_mask = None  # [batch, 1, slots, 1], one-hot on each row's adapter slot (models/lora.py)
        self.graph = None
        self.logits = None
        if step.dynamic_batch:
            self._batch_dynamic(self.tokens, self.write_index, self.state_rows, *self.mask.values(),
                                *(getattr(self.cache.pattern, name) for name in _PER_ROW_PATTERN))
            torch._dynamo.maybe_mark_dynamic(self.positions, 1)

    @staticmethod
    def _batch_dynamic(*tensors) -> None:
        """Tell torch.compile the leading (batch) dimension of these inputs varies: one graph for every batch
        bucket of a KV bucket. A flattened per-row tensor (`read_blocks`: rows x blocks) follows the batch too."""
        for tensor in tensors:
            if tensor is not None:
                torch._dynamo.maybe_mark_dynamic(tensor, 0)

    def run(self, tokens, positions, write_index, tables, window_tables, n: int,
            lora_slots: list[int] | None) -> torch.Tensor:
        self.tokens[:n].copy_(tokens)
        self.positions[:, :n].copy_(positions)
        self.write_index[:n].copy_(write_index)
        self.write_index[n:].fill_(self.step.pad_index)
        _fill_rows(self.tables, tables, n)
        if self.window_tables is not None:
            _fill_rows(self.window_tables, window_tables, n)
        if self.row_state:
            self.state_rows[:n].copy_(self.row_range[:n])
            self.state_rows[n:].fill_(self.spare_row)
        pattern = self.cache.pattern
        fresh = self.cache.decode_pattern(len(self.tokens), self.write_index, self.kv_len, self.tables,
                                          window_tables=self.window_tables)
        for name in _TABLE_PATTERN:
            if getattr(pattern, name) is not None:
                getattr(pattern, name).copy_(getattr(fresh, name))
        for name, mask in self.cache.masks(self.step.cache.dtype).items():
            if mask is not None:  # row-state kinds take none in decode
                self.mask[name].copy_(mask)
        with self._lora_rows(n, lora_slots):
            if not self.step.use_cuda_graphs:
                return self.step._compiled(self.tokens, self.positions, self.mask, self.cache)[:n]
            if self.graph is None:
                self._capture()
            self.graph.replay()
            return self.logits[:n]

    def _lora_rows(self, n: int, slots: list[int] | None):
        """Every adapter slot in use (static shapes), the mask refilled for this step's rows; padding rows and the
        base model's take slot 0, whose factors are zeros."""
        loras = self.step.loras
        if loras is None:
            return contextlib.nullcontext()
        if self.lora_mask is None:
            self.lora_mask = torch.zeros((len(self.tokens), 1, loras.num_slots, 1), dtype=self.step.cache.dtype,
                                         device=self.step.device)
            if self.step.dynamic_batch:
                self._batch_dynamic(self.lora_mask)
        self.lora_mask.zero_()
        rows = torch.tensor(slots or [0] * n, device=self.step.device)
        self.lora_mask[:n, 0, :, 0] = torch.nn.functional.one_hot(rows, loras.num_slots).to(self.lora_mask.dtype)
        self.lora_mask[n:, 0, 0, 0] = 1
        return loras.rows.every_slot(self.lora_mask)

    def _capture(self) -> None:
        step = self.step
        side = torch.cuda.Stream(step.device)
        side.wait_stream(torch.cuda.current_stream(step.device))
        with torch.cuda.stream(side):  # warm-up outside the graph (lazy inits, cuBLAS workspaces)
            step._forward(self.tokens, self.positions, self.mask, self.cache)
        torch.cuda.current_stream(step.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # A bucket captures again while requests arrive (model_changed): their threads' device copies must not
        # void this capture, as CUDA's default (global) mode makes them do; only this thread's calls are checked.
        with torch.cuda.graph(self.graph, pool=step._pool, capture_error_mode="thread_local"):
            self.logits = step._forward(self.tokens, self.positions, self.mask, self.cache)


# The write pattern's tensors computed from the step's tables (refilled per step), and all its per-row ones
# (their first dimension follows the bucket's batch)
_TABLE_PATTERN = ("write_slots", "read_blocks", "window_slots", "window_blocks")
_PER_ROW_PATTERN = (*_TABLE_PATTERN, "row_ids")


def _fill_rows(buffer: torch.Tensor, tables: torch.Tensor, n: int) -> None:
    """The bucket's table buffer: the running rows' tables (cut or padded to its width), null blocks elsewhere."""
    width = min(tables.shape[1], buffer.shape[1])
    buffer.zero_()
    buffer[:n, :width].copy_(tables[:, :width])


def use_compile_cache() -> pathlib.Path:
    """Inductor's cache under raypipe's (`$RAYPIPE_CACHE/inductor`) unless `TORCHINDUCTOR_CACHE_DIR` is set;
    the folder in use. Its default is a folder under /tmp, gone with the machine's temporary files; here
    a restarted engine finds the buckets it compiled before (measured on `small`, 3 batch buckets: a cold
    start 177 s, a warm one 21 s). Inductor reads the variable when it compiles: call before the first."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    return pathlib.Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


_graphs_asked = 0  # graphs every compiled step and forward made in this process may compile, together


def allow_graphs(num_graphs: int) -> None:
    """Let dynamo compile `num_graphs` more graphs in this process instead of falling back to eager. It counts
    recompiles per code object, and every engine's compiled step (`_forward`) or forward (`compiled_forward.py`)
    shares its code object with the other engines': the limit is the whole process's (an engine started after
    others, as in the tests, silently ran eager past dynamo's default of 8)."""
    global _graphs_asked
    _graphs_asked += num_graphs
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, _graphs_asked + 1)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, _graphs_asked + 1)


def _compile(fn, num_graphs: int, dynamic_batch: bool):
    use_compile_cache()  # compiled buckets persist under raypipe's cache: a restart compiles nothing new
    allow_graphs(num_graphs)  # at most one graph per bucket
    if not dynamic_batch:
        return torch.compile(fn, dynamic=False)
    # Dynamic from the first compile: the batch dimensions the buckets mark (`_Bucket._batch_dynamic`); a
    # dimension that changes later (the KV length, at the next KV bucket) becomes dynamic on its recompile.
    return torch.compile(fn)
