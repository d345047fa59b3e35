"""`EngineConfig`: the decode engine's limits, fixed when it starts (they size the KV cache)."""

from __future__ import annotations

import dataclasses

DEFAULT_MAX_MODEL_LEN = 4096  # when the checkpoint allows more
EXPERT_SPLITS = ("experts", "tensor")  # how a decode group splits MoE experts (`EngineConfig.expert_split`)


@dataclasses.dataclass(slots=True)
class EngineConfig:
    max_num_seqs: int = 32  # running sequences (rows of the bounded cache kinds; paged K/V follow actual lengths)
    max_model_len: int | None = None  # prompt + output tokens; None: min(model's limit, DEFAULT_MAX_MODEL_LEN)
    # Prefill budget per round in prompt tokens (padding adds <= 10%). A longer prompt is prefilled over
    # several rounds (chunked prefill; rows' linear-attention state carries over). Sliding-window layers'
    # window pool keeps room for one such chunk (decode/kv_pool_size.py).
    max_num_batched_tokens: int = 8192
    # Paged KV cache (decode/block_pool.py): tokens per block, and the pool's bytes. None: on CUDA
    # `kv_cache_free_memory_fraction` of the device memory free once the weights are loaded; on CPU
    # max_num_seqs sequences of max_model_len tokens, each in whole blocks. A pool that cannot hold one
    # max_model_len sequence is refused when the engine starts (decode/kv_pool_size.py).
    block_size: int = 16
    kv_cache_memory: int | None = None
    kv_cache_free_memory_fraction: float = 0.8
    # Automatic prefix caching, for every layer kind: full-attention blocks by prefix hash; where layers keep
    # per-row state (linear attention) a hit also needs a snapshot of that state at exactly its
    # last cached block (raypipe/decode/snapshot_pool.py). The snapshots get `state_snapshot_memory_fraction`
    # of the KV budget; one is taken every `snapshot_every_blocks` blocks of a prefill (also at branch points,
    # a prompt's last block boundary and where a sequence's decode stopped). None: as many blocks as one
    # snapshot's bytes would hold K/V, so a long prompt's periodic snapshots at most double its cache
    # (`raypipe bench kv` section (f) measures the prefill time and memory against N; docs/performance.md "Prefix caching").
    enable_prefix_caching: bool = True
    state_snapshot_memory_fraction: float = 0.2
    snapshot_every_blocks: int | None = None
    num_scheduler_steps: int = 8  # K: decode steps per scheduling round
    dtype: str = "auto"  # fp32 on CPU, bf16 on CUDA
    num_threads: int | None = None  # torch CPU threads for the engine process (None: leave as is)
    # Devices the language model spans (raypipe/parallel/): that many ranks, one per GPU, weights
    # sharded by the checkpoint's tensor-parallel plan; each rank uses num_threads CPU threads.
    tensor_parallel_size: int = 1
    # MoE layers in a group: "experts" (each rank holds E/N whole experts, the router on every rank) or
    # "tensor" (each rank holds every expert's 1/N of the expert width; Step3 only). docs/scaling.md, "One model over several devices".
    expert_split: str = "experts"
    # Requests queued beyond the running ones (they hold their prompts and image embeddings); one
    # more is refused with `raypipe.errors.QueueFull`, a retryable `CapacityError`.
    max_num_waiting: int = 1024
    # Decode steps through static-shape buckets (raypipe/decode/compiled_step.py): CUDA graphs on GPU,
    # torch.compile on CPU, every bucket warmed up when the engine starts. None: on with CUDA (capture
    # takes milliseconds per bucket), off on CPU (compiling each bucket takes seconds to minutes).
    compiled_decode: bool | None = None
    # CPU, eager path: decode steps' and prefills' forwards compiled whole by inductor, with the paged cache's code
    # and the packed GEMMs as opaque operations (raypipe/decode/compiled_forward.py), so a step's ~400 small
    # operations run fused. Six graphs compile when the engine starts (a minute or more cold; inductor's cache under
    # raypipe's makes a restart warm). Layer kinds other than full attention, LoRA adapters and tensor-parallel
    # groups stay eager.
    # Off by default: docs/performance.md, "Compiled forwards", says what it gains and costs.
    compiled_forward: bool = False
    # CPU, eager steps, one device: the language model's linears keep their weights packed for oneDNN's GEMMs
    # (raypipe/models/packed_linear.py: ~20% less GEMM time at decode batch sizes; same results up to rounding);
    # a bf16 model on a CPU without a bf16 GEMM computes its linears in fp32 (fp32's weight bytes, 5-8x faster);
    # where MKL's one-row product beats the packed one on this CPU (measured at load), one-row inputs keep the
    # plain weights too (twice the linears' bytes; docs/performance.md "The CPU decode path").
    cpu_packed_weights: bool = True
    decode_batch_buckets: tuple[int, ...] | None = None  # None: compiled_step's defaults up to max_num_seqs
    decode_kv_buckets: tuple[int, ...] | None = None  # None: doubling from 256 up to max_model_len
    # Structured outputs (raypipe/decode/grammar.py). Every constraint is first trial-compiled in one of
    # `grammar_compile_workers` warm worker processes (never in this one: llguidance can segfault), each
    # under an address-space limit and a compile thread of `grammar_compile_stack_bytes` (the decoder's
    # own build gets 4x). A compile past `grammar_compile_timeout_s` (a normal schema takes ~1 ms) is
    # killed with its worker and refused with `InvalidInput` code "grammar_too_complex" (HTTP 400), as is
    # one that crashes its worker; a request that finds every worker busy for that long gets `QueueFull`-
    # like `CapacityError` (503, retryable).
    grammar_compile_timeout_s: float = 2.0
    grammar_compile_workers: int = 2
    grammar_compile_memory_bytes: int = 1 << 30
    grammar_compile_stack_bytes: int = 8 << 20
    # Static limits checked before any compile (raypipe/inputs/structured_limits.py), also "grammar_too_complex":
    # a constraint's bytes, a schema's JSON nesting (llguidance's reader stops at 128), the longest $ref
    # chain (llguidance 1.9.1 segfaults from ~1,000) and a Lark grammar's rules (it segfaults from ~3,000).
    grammar_max_bytes: int = 256 << 10
    grammar_max_depth: int = 100
    grammar_max_ref_depth: int = 100
    grammar_max_rules: int = 1000
    # LoRA adapters (raypipe/models/lora.py; docs/lora.md): name -> folder (local or s3://) of a PEFT LoRA save,
    # read when the engine starts; more are loaded and unloaded while it runs (`LLMEngine.load_lora`). A request
    # names one (`lora=`, or the OpenAI `model` field); rows of different adapters and of none share a round.
    # Each targeted linear keeps `max_loras` device slots of rank `max_lora_rank` (a lower rank is zero-padded),
    # given to the adapters of running requests least recently used first: a request whose adapter finds every
    # slot busy waits (raypipe/decode/lora_pool.py). `max_cpu_loras` read adapters stay in CPU memory (LRU); the
    # others are read again from their folder when asked. None: max_loras, vLLM's default (an adapter's fp32
    # factors take 4 * r * (in + out) bytes per targeted linear: ~160 MB at r=16 on every linear of a 7B model).
    lora_modules: dict[str, str] = dataclasses.field(default_factory=dict)
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_scheduler_steps", "max_num_waiting", "block_size",
                     "tensor_parallel_size", "max_loras", "max_lora_rank",
                     "grammar_compile_workers", "grammar_compile_memory_bytes", "grammar_compile_stack_bytes",
                     "grammar_max_bytes", "grammar_max_depth", "grammar_max_ref_depth", "grammar_max_rules"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if self.snapshot_every_blocks is not None and (isinstance(self.snapshot_every_blocks, bool) or not isinstance(
                self.snapshot_every_blocks, int) or self.snapshot_every_blocks < 1):
            raise ValueError(f"EngineConfig.snapshot_every_blocks must be a positive integer or None, got "
                             f"{self.snapshot_every_blocks!r}")
        if self.max_model_len is not None:
            if isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int) \
                    or self.max_model_len < 2:
                raise ValueError(f"EngineConfig.max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.kv_cache_memory is not None and (isinstance(self.kv_cache_memory, bool)
                                                 or not isinstance(self.kv_cache_memory, int) or self.kv_cache_memory < 1):
            raise ValueError(f"EngineConfig.kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory!r}")
        if not 0 < self.kv_cache_free_memory_fraction <= 1:
            raise ValueError("EngineConfig.kv_cache_free_memory_fraction must be in (0, 1], got "
                             f"{self.kv_cache_free_memory_fraction!r}")
        if not 0 <= self.state_snapshot_memory_fraction < 1:
            raise ValueError("EngineConfig.state_snapshot_memory_fraction must be in [0, 1), got "
                             f"{self.state_snapshot_memory_fraction!r}")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"EngineConfig.grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s!r}")
        if self.expert_split not in EXPERT_SPLITS:
            raise ValueError(f"EngineConfig.expert_split must be one of {EXPERT_SPLITS}, got {self.expert_split!r}")
        if self.max_cpu_loras is not None and (isinstance(self.max_cpu_loras, bool) or not isinstance(
                self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"EngineConfig.max_cpu_loras must be an integer >= max_loras ({self.max_loras}) or None, "
                             f"got {self.max_cpu_loras!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"EngineConfig.num_threads must be >= 1, got {self.num_threads}")

    def resolved(self, model_max_len: int) -> "EngineConfig":
        """This config with `max_model_len` filled in and checked against the model's own limit."""
        max_len = self.max_model_len or min(model_max_len, DEFAULT_MAX_MODEL_LEN)
        if max_len > model_max_len:
            raise ValueError(f"max_model_len {max_len} exceeds the model's max_position_embeddings {model_max_len}")
        return dataclasses.replace(self, max_model_len=max_len)
