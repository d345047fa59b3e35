"""The engine's forwards compiled whole by inductor on a CPU (`EngineConfig.compiled_forward`).

An eager decode step at ~30 rows on `small` spends about a third of its time outside the GEMMs and the
attention: ~400 small operations a step (RMSNorm's seven, the rotary embedding's twenty a layer, SiLU and its
product, residual adds, views), each a dispatch and some an OpenMP fork. Compiled, inductor fuses each run of
them into one C++ loop. It does not trace the two things it cannot do better or at all:

- the paged cache and the attention over it: each attention layer's cache write and attention are one opaque
  operation, `raypipe::cached_attention`, which runs the eager code (`KVCache.update` and `attention.py`: the
  round's rows, shared leading blocks, block tables) on the cache this thread's forward was given;
- the packed GEMMs: `raypipe::packed_gemm` (`models/packed_linear.py`; inductor cannot lower oneDNN's prepacked
  weights). Sibling layers (q/k/v, gate/up) each call their group's GEMM on the same input; a graph pass
  (`_OneGemmPerInput`) keeps one call, as `models/packed_siblings.py` shares it eagerly.

So the graph holds the model's glue between those calls, with dynamic batch and chunk dimensions: graphs for one
row and for more (dynamo specializes a size of 1), whatever the KV length, which lives inside the opaque operation;
decode steps and prefills (chunks of two tokens or more, with and without cached keys before them) apart. All six
are compiled when the engine starts (`warm_up`: forwards through the null block, which no sequence owns), and
inductor's artefacts are kept under raypipe's cache (`compiled_step.use_compile_cache`): a restart compiles from
there.

Where it runs: a CPU engine whose every layer is full attention (the layer kinds whose cache Python needs no
tracing), without LoRA adapters (their rows' slots change per forward) and without a tensor-parallel group; only
forwards on the thread count the graphs were compiled with (inductor's loops keep theirs). So with compiled
forwards a round's prefill does not run beside its decode, each on its share of the cores and eager
(`engine._cores_split`): it runs first on every core, then the decode (`engine._prefill_then_decode`).
Results equal the eager step's up to float rounding (fused loops sum in another order); the tests compare greedy
tokens with transformers' `generate()` and with the eager step.
"""

from __future__ import annotations

import threading

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

from raypipe.decode import attention, compiled_step
from raypipe.decode.block_pool import NULL_BLOCK
from raypipe.decode.kv_cache import KVCache, block_tables
from raypipe.models.text_decoder import TextDecoder

WARM_UP_ROWS = (1, 2)  # one graph for one row, one for any more
WARM_UP_GRAPHS = 3 * len(WARM_UP_ROWS)  # per row count: a decode step's, and prefills' without and with cached keys

_current = threading.local()  # the cache of the forward this thread runs through a compiled graph


@torch.library.custom_op("raypipe::cached_attention", mutates_args=())
def cached_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     layer_idx: int, scaling: float) -> torch.Tensor:
    """Layer `layer_idx`'s new K/V into the cache of this thread's forward, then its attention over the cache:
    `(B, Q, H, D)`, as `attention.attention_forward` returns it."""
    cache: KVCache = _current.cache
    keys, values = cache.update(key, value, layer_idx)
    out, _ = attention.attention_forward(cache.attention_modules[layer_idx], query, keys, values, mask,
                                         scaling=scaling)
    return out.contiguous()


@cached_attention.register_fake
def _(query, key, value, mask, layer_idx, scaling):
    rows, heads, length, head_dim = query.shape
    return query.new_empty(rows, length, heads, head_dim)


class _OneGemmPerInput(CustomGraphPass):
    """Calls of `raypipe::packed_gemm` with the same input, weight and bias (siblings taking their slices of one
    group's GEMM) become one call."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        seen = {}
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not torch.ops.raypipe.packed_gemm.default:
                continue
            same = seen.setdefault((node.args, tuple(sorted(node.kwargs.items()))), node)
            if same is not node:
                node.replace_all_uses_with(same)
                graph.erase_node(node)

    def uuid(self) -> str:  # part of inductor's cache key
        return "raypipe-one-packed-gemm-per-input-1"


def supports(cache: KVCache, device: torch.device) -> str | None:
    """None if decode forwards over `cache` can be compiled here, else why not."""
    if device.type != "cpu":
        return f"a compiled forward is for CPU engines (CUDA has the static step's graphs), not {device.type}"
    kinds = sorted(set(cache.layer_types) - {"full_attention"})
    if kinds:
        return f"layer kinds {kinds} keep their cache code eager"
    return None


class CompiledForward:
    """`(inputs_embeds, position_ids, masks, cache) -> hidden states`, the text model's forward compiled, for the
    decode steps (`decode`) and the prefills (`prefill`) over `caches` (the runner's cache and views of it). A
    decode forward and a prefill differ in their inputs' strides and masks: each has a compiled function of its
    own, so neither's graphs count against the other's recompile limit."""

    def __init__(self, model, caches: list[KVCache]):
        self.model = model
        self.num_threads = torch.get_num_threads()
        self.calls = {"decode": 0, "prefill": 0}  # forwards run compiled (the tests check both ran)
        # A family whose visual rows do more in its layers (Qwen3-VL's deepstack) overrides the plain prefill
        self.plain_prefill = type(model).prefill is TextDecoder.prefill
        modules = {m.layer_idx: m for m in model.model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")}
        for module in modules.values():
            setattr(module, attention.OPAQUE_ATTENTION, True)
        for cache in caches:
            cache.attention_modules = modules
            cache.opaque_attention = True
        compiled_step.use_compile_cache()
        compiled_step.allow_graphs(WARM_UP_GRAPHS)
        options = {"post_grad_custom_pre_pass": _OneGemmPerInput()}
        self._decode = torch.compile(self._decode_forward, dynamic=True, options=options)
        self._prefill = torch.compile(self._prefill_forward, dynamic=True, options=options)

    def release(self, caches: list[KVCache]) -> None:
        """Attention modules and `caches` as they were before: eager code throughout."""
        for cache in caches:
            for module in cache.attention_modules.values():
                setattr(module, attention.OPAQUE_ATTENTION, False)
            cache.attention_modules, cache.opaque_attention = {}, False

    # Two code objects, two dynamo caches: the same call
    def _decode_forward(self, inputs_embeds, position_ids, masks, cache):
        return self.model(inputs_embeds, position_ids, masks, cache)

    def _prefill_forward(self, inputs_embeds, position_ids, masks, cache):
        return self.model(inputs_embeds, position_ids, masks, cache)

    def applies(self) -> bool:
        """Whether this thread's forward may run compiled now: with the thread count the graphs were made for."""
        return torch.get_num_threads() == self.num_threads

    def prefill_applies(self, width: int) -> bool:
        """Whether a prefill of chunks up to `width` tokens runs compiled: two tokens or more (dynamo would compile
        one-token chunks apart: they run eager), through the decoder's plain prefill."""
        return width > 1 and self.plain_prefill

    def decode(self, inputs_embeds, position_ids, masks, cache: KVCache) -> torch.Tensor:
        self.calls["decode"] += 1
        return self._run(self._decode, inputs_embeds, position_ids, masks, cache)

    def prefill(self, inputs_embeds, position_ids, masks, cache: KVCache) -> torch.Tensor:
        self.calls["prefill"] += 1
        return self._run(self._prefill, inputs_embeds, position_ids, masks, cache)

    @staticmethod
    def _run(compiled, inputs_embeds, position_ids, masks, cache: KVCache) -> torch.Tensor:
        _current.cache = cache
        try:
            return compiled(inputs_embeds, position_ids, masks, cache)
        finally:
            _current.cache = None

    @torch.inference_mode()
    def warm_up(self, cache: KVCache, prefill_cache: KVCache, dtype: torch.dtype) -> None:
        """Compile the graphs now, not in a request's forward, through the null block, which no sequence owns (its
        K/V are garbage every reader masks): decode steps of one row and of two, prefills of one row and of two,
        each with no cached keys before the chunk and with some, each on the cache its forwards will be given.
        Two tokens and two keys at least: dynamo specializes a size of 1."""
        device, block = cache.device, cache.block_size
        graphs = counters["stats"]["unique_graphs"]
        for rows in WARM_UP_ROWS:
            tables = block_tables([[NULL_BLOCK]] * rows, 1, device)
            cache.prepare_decode(rows, torch.ones(rows, dtype=torch.long, device=device), 2, tables)
            tokens = torch.zeros((rows, 1), dtype=torch.long, device=device)
            positions = torch.ones((1, rows, 1), dtype=torch.long, device=device).expand(3, rows, 1)  # as a step's
            self.decode(self.model.embed(tokens), positions, cache.masks(dtype), cache)
            for start in (0, block):
                prefill_cache.prepare_prefill(list(range(rows)), [start] * rows, [2] * rows, [[NULL_BLOCK] * 2] * rows)
                tokens = torch.zeros((rows, 2), dtype=torch.long, device=device)
                positions = (start + torch.arange(2, device=device)).expand(3, rows, 2).contiguous()
                self.prefill(self.model.embed(tokens), positions, prefill_cache.masks(dtype), prefill_cache)
        made = counters["stats"]["unique_graphs"] - graphs
        if made != WARM_UP_GRAPHS:  # dynamo runs a frame it will not compile eager, and says so only in a log line
            raise RuntimeError(f"dynamo compiled {made} graphs, not {WARM_UP_GRAPHS}")
