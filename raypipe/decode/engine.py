"""`LLMEngine`: continuous batching with multi-step rounds, usable in any process with an event loop.

One background thread loads the model, owns the engine state and runs rounds while there is work; a
second one only runs prefill forwards beside a decode (the language model is driven with explicit
positions and its own cache view per thread, so it keeps no per-call state that two threads could share):

    apply aborts -> schedule (scheduler.py): blocks of the paged KV pool for the running sequences'
       K steps (preempting the newest when the pool runs dry), next chunks of prefills under way,
       waiting requests admitted after the running batch (reusing their longest cached prefix; for
       layers with per-row state, the state snapshot at its end is copied into the row first; a LoRA
       adapter's row only once its adapter has a device slot, written here: lora_pool.py)
    -> [prefill thread] prefill those chunks by groups of similar length, first token of each
       prompt completed || [engine thread] K decode steps for the sequences already decoding
    -> per sequence: cut at its stop, emit one delta -> free the rows and blocks of finished ones

Prefill and decode overlap because, on a CPU, each is a stream of GEMMs that can have cores of
its own; run one after the other, a round took prefill + decode time and profiling showed prefill
at ~40% of the engine's time. While both run, the prefill thread has one core and the decode the
others: two forwards each asking for every core put twice as many OpenMP threads as cores on the
machine, and every parallel op then waits at its barrier for a descheduled thread. The prefill
thread never has OpenMP workers of its own (`runtime/cpu_threads.py`: a second team slows every
parallel op of the decode), so once the decode is done, the engine thread prefills what is left on
every core. They write disjoint rows
and blocks (a prefill may read cached prefix blocks, which nobody writes) and join at the round
boundary, so rows are only moved and blocks only taken or given back while nothing runs. Joining
requests enter the decode batch one round later; their outputs do not change. A burst of prompts much larger
than the decode batch does not overlap (`_prefill_first`): it prefills on every core in a round that decodes
nothing, and the rows decode with it next round. In `small`'s shared-prompt workload (one request decoding
while 15 more join), the burst's median first token came 0.87-0.95 s after it was sent against 1.07-1.16 s
overlapped, and the workload made 154-205 against 145-158 tokens/s (one process, the two alternated). A round
that decodes nothing prefills, on a CPU, in forwards of at most `ANSWER_PIECE_TOKENS` prompt tokens, each
answering before the next begins. With compiled forwards (`compiled_forward.py`) nothing overlaps: their graphs
run only on the thread count they were compiled with, so a round prefills on every core first, then decodes
(`_prefill_then_decode`).

Callers `await` deltas from `generate()`; validation happens in the caller's task before a
request is queued, so a bad request fails alone. Requests submitted in one turn of the caller's
event loop (a burst sent with `asyncio.gather`, a batch's rows) reach the scheduler in the same
round, never split by a round that starts meanwhile: the scheduler sees what their prompts share,
computes a shared prefix once and, for row state, keeps a state where they diverge (`scheduler.py`).
The engine needs no Ray actor around it: image embeddings may be tensors or Ray `ObjectRef`s
(awaited in `generate`).

Work is bounded: at most `max_num_seqs + max_num_waiting` requests are in the engine, one more is
refused with `QueueFull` (retryable); an engine whose KV cache cannot hold one `max_model_len`
sequence refuses to start (`kv_pool_size.py`). Aborts name a `Sequence`, not an id, so an abort that arrives
after its request ended cannot hit a new request reusing the id; `shutdown()` fails every request
still in the engine with `EngineClosed`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor

import torch

from raypipe.decode.block_pool import BlockPool
from raypipe.decode.config import EngineConfig
from raypipe.decode.grammar import GrammarCompiler, GrammarLimits
from raypipe.decode.grammar_worker import readable_error
from raypipe.decode.lora_pool import LoraPool
from raypipe.decode.model_runner import ModelRunner
from raypipe.decode.output import OutputProcessor
from raypipe.decode.prefix_hash import chain_root, placeholder_runs
from raypipe.decode.request import check_request, visual_rows
from raypipe.decode.resume import Resume, resume_sequence
from raypipe.decode.sampler import SamplingBatch
from raypipe.decode.scheduler import Scheduler
from raypipe.decode.sequence import RequestDelta, RequestOutput, Sequence
from raypipe.decode.snapshot_pool import SnapshotPool
from raypipe.decode.window_tables import WindowTables
from raypipe.errors import CapacityError, EngineClosed, InvalidInput, QueueFull
from raypipe.inputs.sampling import SamplingParams
from raypipe.models.lora import read_adapter
from raypipe.models.prompt import PreparedPrompt
from raypipe.models.registry import family_of, language_adapter
from raypipe.runtime.cpu_threads import forward_thread, single_threaded
from raypipe.runtime.device import pick_device, resolve_dtype

log = logging.getLogger(__name__)
# A prefill beside a decode runs on the prefill thread's one core until that decode is done, then on every core
# of the engine thread: while the decode runs, its groups are cut into forwards of at most this many prompt
# tokens (still large enough for efficient GEMMs), so one big group cannot keep it on one core for the whole
# round; once the decode is done, what is left of a group runs as one forward (docs/performance.md measured it
# against pieces).
OVERLAP_PIECE_TOKENS = 256
# On a CPU, a round that decodes nothing prefills in forwards of at most this many prompt tokens, each forward's
# first tokens out before the next begins: a burst's first requests answer in a fraction of the burst's prefill
# time, a forward of a few hundred rows being as fast per token on a CPU as a bigger one; its last answers a
# little later (each forward's fixed cost: +5% on `small`'s image burst; docs/performance.md, "A burst answers
# in pieces").
ANSWER_PIECE_TOKENS = 512
# A CPU round whose waiting prompts hold at least this many tokens, and this many per decoding row, prefills them
# first on every core and decodes nothing; its rows decode with the prompts' rows next round. Beside a small
# decode such a burst would prefill on one core while that decode's core waits out the last piece.
PREFILL_FIRST_TOKENS = 512
PREFILL_FIRST_TOKENS_PER_ROW = 64


class LLMEngine:
    def __init__(self, checkpoint, config: EngineConfig | None = None, runner_factory=None):
        """`runner_factory` builds the model runner (`ModelRunner`'s arguments); a tensor-parallel
        group's comes from `raypipe.parallel.runner_factory(config)`."""
        self.adapter = language_adapter(checkpoint)
        self.config = (config or EngineConfig()).resolved(self.adapter.max_position_embeddings)
        if self.config.tensor_parallel_size > 1 and runner_factory is None:
            raise ValueError("EngineConfig.tensor_parallel_size > 1 needs a decode group: pass "
                             "runner_factory=raypipe.parallel.runner_factory(config)")
        self.num_threads = self.config.num_threads or torch.get_num_threads()
        self.device = pick_device()
        self._counters = dict(rounds=0, prefills=0, prefill_tokens=0, decode_steps=0, decode_row_steps=0,
                              max_running=0, tokens_generated=0, finished=0, aborted=0, failed_rounds=0,
                              prefill_seconds=0.0, decode_seconds=0.0)
        self._cond = threading.Condition()
        self._inbox: list[Sequence] = []
        self._arriving: list[Sequence] = []  # submitted in the caller's current event-loop turn
        self._aborts: set[Sequence] = set()  # objects, not ids: an id may be reused once its request ends
        self._live: dict[str, Sequence] = {}  # submitted, not yet finished (guarded by _cond)
        self._capacity = self.config.max_num_seqs + self.config.max_num_waiting
        self._outbox: list[tuple[Sequence, RequestDelta]] = []  # delivered once rows are freed
        self._stopping = False
        self._overlapping = False  # a decode runs beside the prefill thread (`_cores_split`)
        self._prefilled_first = False  # the last round held its decode back for a burst (`_prefill_first`)
        # One torch thread: a prefill piece beside the decode, never a second OpenMP team (cpu_threads.py)
        self._prefill_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raypipe-prefill",
                                                  initializer=forward_thread, initargs=(1,))
        # The engine thread loads the model, then runs rounds: every forward that uses several CPU threads
        # runs on it (cpu_threads.py). A daemon: an engine never shut down must not hold the process open.
        loaded = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(runner_factory, loaded), name="raypipe-decode",
                                        daemon=True)
        self._thread.start()
        try:
            loaded.result()
        except BaseException:
            self._prefill_thread.shutdown(wait=False)
            raise

    def _run(self, runner_factory, loaded: concurrent.futures.Future) -> None:
        try:
            self._load(runner_factory)
        except BaseException as exc:
            loaded.set_exception(exc)
            return
        loaded.set_result(None)
        self._loop()

    def _load(self, runner_factory) -> None:
        """The model, its cache and the scheduler (on the engine thread)."""
        forward_thread(self.num_threads)
        prefix_caching = self.config.enable_prefix_caching is not False  # exact for every layer kind
        self.runner = (runner_factory or ModelRunner)(self.adapter, device=self.device, dtype=resolve_dtype(self.config.dtype, self.device),
                                  max_num_seqs=self.config.max_num_seqs, max_model_len=self.config.max_model_len,
                                  num_scheduler_steps=self.config.num_scheduler_steps,
                                  block_size=self.config.block_size, kv_cache_memory=self.config.kv_cache_memory,
                                  kv_cache_free_memory_fraction=self.config.kv_cache_free_memory_fraction,
                                  state_snapshot_fraction=self.config.state_snapshot_memory_fraction
                                  if prefix_caching else 0.0,
                                  max_num_batched_tokens=self.config.max_num_batched_tokens)
        # LoRA adapters (lora_pool.py): the configured ones read now (a bad one stops the start), and the layers they
        # target wrapped before a compiled decode step compiles or captures them; more may be loaded while it runs
        self.loras = LoraPool(self._read_lora, self.config.max_loras,
                              self.config.max_cpu_loras or self.config.max_loras)
        if self.config.lora_modules:
            self.runner.use_loras(self.config.max_loras, self.config.max_lora_rank)
            for name, path in self.config.lora_modules.items():
                self.runner.wrap_lora_layers(self.loras.load(name, path).factors)
        self.decode_step = self._start_decode_step()
        self.weights = self._pack_weights()
        if self.decode_step["mode"] == "eager" and self.config.compiled_forward:
            self.decode_step = self._start_compiled_forward()
        self.pool = BlockPool(self.runner.cache.num_blocks, self.config.block_size)
        self.snapshots, state = None, self.runner.cache.state_bytes_per_row
        if prefix_caching and self.runner.cache.row_state_kinds:
            if self.runner.num_snapshots:
                self.snapshots = SnapshotPool(self.runner.num_snapshots, state)
                self.pool.on_evict = self.snapshots.drop
            else:  # no snapshot can be held (no memory for one): a hit could not restore rows
                prefix_caching = False
        block_bytes = max(self.runner.bytes_per_token * self.config.block_size, 1)
        self.snapshot_every = self.config.snapshot_every_blocks or max(1, -(-state // block_bytes))
        self.window = None  # sliding-window layers' blocks (window_tables.py)
        if self.runner.cache.window_blocks:
            self.window = WindowTables(BlockPool(self.runner.cache.window_blocks, self.config.block_size),
                                       self.adapter.text_config.sliding_window)
        self.scheduler = Scheduler(self.config.max_num_seqs, self.config.max_num_batched_tokens, self.pool,
                                   chunked_prefill=True, prefix_caching=prefix_caching, snapshots=self.snapshots,
                                   snapshot_every=self.snapshot_every, window=self.window, loras=self.loras)
        self._log_cache()
        self.output = OutputProcessor(self.adapter.tokenizer, self.adapter.eos_token_ids, self.config.max_model_len)
        self.tokenizer = self.adapter.tokenizer
        c = self.config
        limits = GrammarLimits(  # by name: eight numbers in a row are easy to swap unnoticed
            timeout_s=c.grammar_compile_timeout_s, workers=c.grammar_compile_workers,
            memory_bytes=c.grammar_compile_memory_bytes, stack_bytes=c.grammar_compile_stack_bytes,
            max_bytes=c.grammar_max_bytes, max_depth=c.grammar_max_depth, max_ref_depth=c.grammar_max_ref_depth,
            max_rules=c.grammar_max_rules)
        self.grammars = GrammarCompiler(self.tokenizer, self.runner.vocab_size, self.adapter.eos_token_ids, limits)

    # ---- caller side (any thread / event loop) ----

    def check_request(self, prompt: PreparedPrompt | list[int], params: SamplingParams, lora: str | None = None) -> None:
        """Raise `InvalidInput` if the engine would refuse this request (no work is started)."""
        check_request(prompt, params, language_adapter=self.adapter, max_model_len=self.config.max_model_len)
        if lora is not None:
            self.loras.check(lora)
        if params.structured is not None:
            self.grammars.matcher(params.structured)  # compiles (and caches) it, or names what is wrong

    async def generate(self, request_id: str, prompt: PreparedPrompt | list[int], visual_embeds: Seq = (),
                       params: SamplingParams | None = None, lora: str | None = None, *,
                       cache_salt: str | None = None, resume: Resume | None = None) -> AsyncIterator[RequestDelta]:
        """Deltas for one request, served with LoRA adapter `lora` (None: the base model); `cache_salt` keeps its
        prefix-cache blocks apart from those of requests with another salt or none; `resume` continues a request
        another engine ran until it died (resume.py): deltas then carry only what follows its output. Leaving
        the iteration early (or cancelling) aborts it."""
        params = params if params is not None else SamplingParams()
        ids, layouts = check_request(prompt, params, language_adapter=self.adapter,
                                     max_model_len=self.config.max_model_len)
        adapter = None if lora is None else (self.loras.cached(lora)
                                             or await asyncio.to_thread(self.loras.weights, lora))
        resolved = await _resolve(visual_embeds)
        with single_threaded():  # the caller's thread: no OpenMP team beside the engine thread's (cpu_threads.py)
            embeds, kept = visual_rows(resolved, layouts, self.adapter)
            positions, rope_delta = self.adapter.positions(ids, layouts, kept)
        runs = placeholder_runs(ids, layouts, self.adapter) if self.scheduler.prefix_caching else ()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def deliver(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                self._abort(seq)

        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        # Compiled here, not on the engine thread (cached: ~1 ms the first time, a copy after).
        matcher = await asyncio.to_thread(self.grammars.matcher, params.structured) if params.structured else None
        seq = Sequence(request_id, ids, positions, rope_delta, embeds, params, deliver, generator, matcher,
                       placeholder_runs=runs, prefix_root=chain_root(adapter and adapter.fingerprint, cache_salt),
                       lora=adapter)
        if resume is not None:
            resume_sequence(seq, resume, self.output, self.runner.vocab_size)
        self._submit(seq)
        done = False
        try:
            while not done:
                item = await queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finish_reason is not None
                yield item
        finally:
            if not done:
                self._abort(seq)

    async def generate_output(self, request_id: str, prompt: PreparedPrompt | list[int], visual_embeds: Seq = (),
                              params: SamplingParams | None = None, lora: str | None = None) -> RequestOutput:
        """The whole result of one request."""
        ids = prompt.prompt_token_ids if isinstance(prompt, PreparedPrompt) else list(prompt)
        num_image_tokens = prompt.num_image_tokens if isinstance(prompt, PreparedPrompt) else 0
        out = RequestOutput(request_id, list(ids), [], "", None, num_image_tokens)
        async for delta in self.generate(request_id, prompt, visual_embeds, params, lora):
            out.add(delta)
        return out

    def load_lora(self, name: str, path: str, where: str = "lora_path") -> str:
        """Serve LoRA adapter `name` from `path` (a PEFT folder, local or `s3://`) from now on; its fingerprint.
        Read and checked here, in the caller's thread (a bad adapter is an `InvalidInput` naming `where`'s field);
        a name already served is refused (unload it first). Its slot is written at a round boundary, when a
        request first needs it (on every rank of a tensor-parallel group)."""
        with single_threaded():  # a caller's thread: no OpenMP team beside the engine thread's (cpu_threads.py)
            self.runner.use_loras(self.config.max_loras, self.config.max_lora_rank)
        return self.loras.load(name, str(path), where).fingerprint  # read single-threaded too (`_read_lora`)

    def unload_lora(self, name: str) -> None:
        """Stop serving `name`: requests already holding it finish with it, new ones are refused (`lora_not_found`)."""
        self.loras.unload(name)

    def _read_lora(self, name: str, path: str, where: str):
        with single_threaded():  # also read again in a caller's thread, once evicted from the CPU pool (`generate`)
            return read_adapter(name, path, self.runner.model, self.config.max_lora_rank, where,
                                family_of(self.adapter.checkpoint))

    def abort(self, request_id: str) -> None:
        """Stop a request at the next round boundary and free its row; unknown ids are ignored."""
        with self._cond:
            seq = self._live.get(request_id)
        if seq is not None:
            self._abort(seq)

    def _abort(self, seq: Sequence) -> None:
        with self._cond:
            if self._live.get(seq.request_id) is seq:
                self._deliver_arrivals()  # the engine sees a request before its abort
                self._aborts.add(seq)
                self._cond.notify()

    def stats(self) -> dict:
        c, s = self._counters, self.scheduler.counters
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "rounds": c["rounds"], "prefill_batches": c["prefills"], "prefill_tokens": c["prefill_tokens"],
                "decode_steps": c["decode_steps"], "max_running_seen": c["max_running"],
                "mean_decode_batch": c["decode_row_steps"] / c["decode_steps"] if c["decode_steps"] else 0.0,
                "tokens_generated": c["tokens_generated"], "requests_finished": c["finished"],
                "requests_aborted": c["aborted"], "failed_rounds": c["failed_rounds"],
                "prefill_seconds": c["prefill_seconds"], "decode_seconds": c["decode_seconds"],
                "num_scheduler_steps": self.config.num_scheduler_steps, "max_num_seqs": self.config.max_num_seqs,
                "max_model_len": self.config.max_model_len, "kv_cache_bytes": self.runner.cache.nbytes,
                "kv_cache_tokens": self.pool.capacity_tokens, **self.pool.stats(),
                **(self.snapshots.stats() if self.snapshots is not None else {}),
                **({f"sliding_{k}": v for k, v in self.window.pool.stats().items()} if self.window is not None else {}),
                "prefix_caching": self.scheduler.prefix_caching, "chunked_prefill": self.scheduler.chunked_prefill,
                "prefix_cache_query_tokens": s["prefill_tokens_asked"],
                "prefix_cache_hit_tokens": s["prefix_cache_hit_tokens"],
                "prefix_cache_hit_rate": (s["prefix_cache_hit_tokens"] / s["prefill_tokens_asked"]
                                          if s["prefill_tokens_asked"] else 0.0),
                "preemptions": s["preemptions"], "chunked_prefills": s["chunked_prefills"],
                "deferred_admissions": s["deferred_admissions"],
                **({"snapshot_every_blocks": self.snapshot_every} if self.snapshots is not None else {}),
                **self.loras.stats(), "lora_slot_waits": s["lora_slot_waits"],
                "device": str(self.device), "decode_step": self.decode_step, "linear_weights": self.weights}

    def _log_cache(self) -> None:
        """The weights' bytes, what is cached for each layer kind, and the budgets (docs/performance.md,
        "Prefix caching"; on CUDA the KV budget is a share of the memory left after the weights, so a
        quantized checkpoint's smaller weights leave more of it, docs/quantization.md)."""
        cache, size = self.runner.cache, self.config.block_size
        blocks = cache.num_blocks - 1
        kinds = {"full_attention": "K/V in paged blocks (cached by prefix hash)",
                 "sliding_attention": "K/V in blocks of the window pool, freed as they leave the window "
                                      "(cached by prefix hash; a hit needs the window before it)",
                 "linear_attention": "conv + recurrent state per row (snapshotted at block boundaries)"}
        model = self.runner.model
        log.info("language model weights: %.1f MiB (%s)", model.weight_bytes() / 2**20,
                 model.quantization or f"{self.runner.dtype}, not quantized")
        log.info("KV cache: %d blocks x %d tokens = %d tokens of paged K/V (%.1f MiB, %d bytes per token); "
                 "prefix caching %s; chunked prefill on; per layer kind: %s", blocks, size, blocks * size,
                 cache.nbytes / 2**20, self.runner.bytes_per_token, "on" if self.scheduler.prefix_caching else "off",
                 "; ".join(f"{kind}: {kinds.get(kind, 'rows')}" for kind in sorted(set(cache.layer_types))))
        if self.window is not None:
            log.info("window pool: %d blocks x %d tokens (%d bytes per token) for the sliding layers' window of %d",
                     cache.window_blocks - 1, size, self.runner.window_bytes_per_token, self.window.window)
        if self.snapshots is not None:
            log.info("state snapshots: %d slots x %d bytes = %.1f MiB (EngineConfig.state_snapshot_memory_fraction "
                     "= %g of the KV budget), one every %d blocks of a prefill, at branch points and where "
                     "sequences stop; a hit needs one at exactly its last cached block", self.snapshots.num_slots,
                     self.snapshots.slot_bytes, self.snapshots.num_slots * self.snapshots.slot_bytes / 2**20,
                     self.config.state_snapshot_memory_fraction, self.snapshot_every)

    def _start_decode_step(self) -> dict:
        """Static-shape decode step if configured and possible, warmed up now; what was chosen and why."""
        wanted = self.config.compiled_decode
        if not (wanted or (wanted is None and self.device.type == "cuda")):
            return {"mode": "eager", "reason": f"EngineConfig.compiled_decode is {wanted} on {self.device.type}"}
        reason = self.runner.use_static_step(self.config.decode_batch_buckets, self.config.decode_kv_buckets)
        if reason is not None:
            log.info("decode steps run eager: %s", reason)
            return {"mode": "eager", "reason": reason}
        step = self.runner.static_step
        try:
            seconds = self.runner.warm_up_static_step()
        except RuntimeError as exc:  # a capture or compile that failed: e.g. a module reading tensor values on the host
            self.runner.static_step = None
            reason = f"the static-shape decode step did not warm up: {str(exc).strip().splitlines()[0]}"
            log.warning("decode steps run eager: %s", reason)
            return {"mode": "eager", "reason": reason}
        mode = "cuda_graphs" if step.use_cuda_graphs else "torch.compile"
        log.info("decode step: %s, %d batch x %d KV buckets warmed up in %.1f s", mode, len(step.batch_buckets),
                 len(step.kv_buckets), seconds)
        return {"mode": mode, "batch_buckets": list(step.batch_buckets), "kv_buckets": list(step.kv_buckets),
                "warmup_seconds": seconds}

    def _start_compiled_forward(self) -> dict:
        """Eager-path forwards, decode steps and prefills, compiled (`compiled_forward.py`) where they can be: now."""
        reason = ("a tensor-parallel group runs eager" if self.config.tensor_parallel_size > 1
                  else "LoRA adapters run eager" if self.config.lora_modules
                  else self.runner.use_compiled_forward())
        if reason is not None:
            log.info("decode steps run eager: %s", reason)
            return {"mode": "eager", "reason": reason}
        try:
            seconds = self.runner.warm_up_compiled_forward()
        except Exception as exc:  # noqa: BLE001 - a compile that failed (a module dynamo or inductor cannot take)
            self.runner.drop_compiled_forward()
            reason = f"the compiled forward did not compile: {(str(exc).strip().splitlines() or [repr(exc)])[0]}"
            log.warning("decode steps run eager: %s", reason)
            return {"mode": "eager", "reason": reason}
        log.info("decode step: compiled forward (torch.compile, the cache and GEMMs opaque), compiled in %.1f s",
                 seconds)
        return {"mode": "compiled_forward", "warmup_seconds": seconds}

    def _pack_weights(self) -> str:
        """oneDNN-packed linears where they apply (CPU, eager decode steps, one device); what was done."""
        if not self.config.cpu_packed_weights:
            return "not packed: EngineConfig.cpu_packed_weights is False"
        if self.runner.static_step is not None or self.config.tensor_parallel_size > 1:
            return "not packed: a compiled decode step or a tensor-parallel group keeps plain linears"
        done = self.runner.use_packed_weights()
        log.info("language model linears: %s", done)
        return done

    def shutdown(self) -> None:
        """Stop after the current round; every request still running or waiting gets `EngineClosed`."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=30)
        self._prefill_thread.shutdown(wait=False)
        self.grammars.close()
        self.runner.close()
        with self._cond:
            left, self._live = list(self._live.values()), {}
        for seq in left:
            seq.deliver(EngineClosed(f"decode engine shut down before request {seq.request_id!r} finished"))

    def _submit(self, seq: Sequence) -> None:
        with self._cond:
            if self._stopping:
                raise EngineClosed("decode engine is shut down")
            if seq.request_id in self._live:
                raise InvalidInput(f"request id {seq.request_id!r} is already running", item="request_id",
                                   code="duplicate_request_id")
            if len(self._live) >= self._capacity:
                raise QueueFull(f"decode engine is full ({self.config.max_num_seqs} running and "
                                f"{self.config.max_num_waiting} waiting requests); retry later")
            self._live[seq.request_id] = seq
            self._arriving.append(seq)
            if len(self._arriving) == 1:  # the first of its turn: the rest of the turn follows it in
                asyncio.get_running_loop().call_soon(self._deliver_arrivals)

    def _deliver_arrivals(self) -> None:
        """Hand the requests submitted in one turn of the event loop to the engine thread at once: a
        round that took only the first of a burst would prefill its prompt before the scheduler knew
        that the others share it (for row state: before it knew where to keep a state for them)."""
        with self._cond:  # re-entrant: `_abort` calls it holding the lock
            if self._arriving:
                self._inbox += self._arriving
                self._arriving = []
                self._cond.notify()

    # ---- engine thread ----

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._inbox or self._aborts or self.scheduler.has_work() or self._stopping):
                    self._cond.wait()
                if self._stopping:
                    return
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, set()
            for seq in inbox:
                self.scheduler.add(seq)
            try:
                self._apply_aborts(aborts)
                self._round()
            except Exception as exc:  # a bug or device error: fail this batch, keep serving
                log.exception("decode round failed")
                self._counters["failed_rounds"] += 1
                self._fail_running(exc)
            self._flush()

    def _round(self) -> None:
        steps = self.config.num_scheduler_steps
        plan = self.scheduler.schedule(lambda seq: min(steps, self.output.budget(seq)))
        # Adapter slots given this round are written here: no forward runs between rounds (see top)
        self.runner.write_lora_slots(self.loras.take_writes())
        self.runner.move_rows(plan.moves)
        if plan.restores:
            try:
                self.runner.restore(plan.restores)
            finally:
                self.scheduler.restored(plan.restores)
        running, groups = plan.decode, plan.prefill  # running: rows 0..n-1
        if running and self._prefill_first(len(running), groups):
            for seq in running:
                self.scheduler.decoded(seq)  # no steps: the round's planned snapshot slots go back
            running = []
        self._prefilled_first = not running and bool(plan.decode)
        if not running or self._prefill_then_decode():
            # here, on every thread: nothing decodes, or compiled forwards that want every core
            self._prefill_answering(groups, ANSWER_PIECE_TOKENS if self.device.type == "cpu" else None)
            if running:
                self._decode(running)
                self._flush(unfinished_only=True)
            self._release_finished()
            return
        with self._cores_split(bool(groups)):
            beside = self._prefill_thread.submit(self._prefill_beside_decode, groups) if groups else None
            try:
                self._decode(running)
            finally:
                self._overlapping = False  # the prefill thread stops after its current piece
                done, rest = beside.result() if beside is not None else ([], [])  # never leave a prefill running
        self._prefilled(done)
        self._flush(unfinished_only=True)  # the decode's tokens, and first tokens of what prefilled beside it
        self._prefill_answering(rest)  # what the prefill thread had not begun when the decode ended
        self._release_finished()

    def _prefill_first(self, rows: int, groups: list[list[Sequence]]) -> bool:
        """Whether this round prefills `groups` alone, before `rows` decoding rows take another step: on a CPU, a
        burst much larger than the decode batch (`PREFILL_FIRST_TOKENS`); never two rounds running, so the rows
        wait one prefill at most."""
        if self.device.type != "cpu" or self._prefilled_first:
            return False
        tokens = sum(seq.chunk_len for group in groups for seq in group)
        return tokens >= max(PREFILL_FIRST_TOKENS, PREFILL_FIRST_TOKENS_PER_ROW * rows)

    def _prefill_then_decode(self) -> bool:
        """Whether a round's prefill runs before its decode on every core instead of beside it on one: with compiled
        forwards (`compiled_forward.py`), whose graphs run on the thread count they were compiled with; split, both
        would run eager on one core each."""
        return self.runner.compiled_now() is not None

    def _prefill_answering(self, groups: list[list[Sequence]], piece_tokens: int | None = None) -> None:
        """Prefill on this (the engine) thread, group by group, in forwards of at most `piece_tokens` prompt
        tokens where given, each forward's first tokens out as soon as it is done (a burst's first requests
        answer while the rest still prefill)."""
        for group in groups:
            while group:
                forward = group if piece_tokens is None else _first_piece(group, piece_tokens)
                group = group[len(forward):]
                self._prefilled([self._prefill_forward(forward)])
                self._flush(unfinished_only=True)

    def _prefilled(self, forwards: list[tuple[list[Sequence], list[Sequence], list[int], list]]) -> None:
        """Book prefilled chunks and emit the first tokens `_prefill_forward` sampled for them."""
        for group, sampled, tokens, logprobs in forwards:
            self._counters["prefills"] += 1
            self._counters["prefill_tokens"] += sum(s.chunk_len for s in group)
            for seq in group:
                seq.num_computed += seq.chunk_len
                seq.chunk_len = 0
                self.scheduler.chunk_done(seq)
            for seq, token, lp in zip(sampled, tokens, logprobs):
                self._emit(seq, self.output.append(seq, [token], lp))

    @contextlib.contextmanager
    def _cores_split(self, overlapping: bool):
        """While a prefill runs beside it on the CPU (on one thread), the decode leaves that thread's core
        (see top). Not with a compiled decode step: torch.compile guards on the thread count, so every change
        would recompile the step's buckets."""
        split = overlapping and self.device.type == "cpu" and self.num_threads > 1 and self.runner.static_step is None
        if split:
            torch.set_num_threads(self.num_threads - 1)
        self._overlapping = overlapping
        try:
            yield
        finally:
            self._overlapping = False
            if split:
                torch.set_num_threads(self.num_threads)

    def _prefill_beside_decode(self, groups: list[list[Sequence]]) -> tuple[list, list[list[Sequence]]]:
        """`_prefill_forward`s for as much of `groups` as it begins while the decode runs, and what is left (on
        the prefill thread: it touches only the prefilling sequences). On the CPU a forward is a piece of at most
        `OVERLAP_PIECE_TOKENS` prompt tokens, so the rest soon goes to the engine thread's every core."""
        out, groups = [], list(groups)
        while groups and self._overlapping:
            group = groups.pop(0)
            forward = _first_piece(group, OVERLAP_PIECE_TOKENS) if self.device.type == "cpu" else group
            if len(forward) < len(group):
                groups.insert(0, group[len(forward):])
            out.append(self._prefill_forward(forward))
        return out, groups

    def _prefill_forward(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[Sequence], list[int], list]:
        """One forward: its sequences, those whose prompt it completes, their first token ids and
        log-probabilities. A resumed sequence samples nothing: its newest output token is already the next input."""
        start = time.perf_counter()
        sampled = [s for s in seqs if not s.output_ids and s.num_computed + s.chunk_len == s.prompt_len]
        if not sampled:
            self.runner.prefill(seqs, [], None)
            tokens, logprobs = [], []
        else:
            batch = self._sampling_batch(sampled)
            tokens, logprobs = self.runner.prefill(seqs, sampled, batch), batch.take_logprobs(sampled)
        self._counters["prefill_seconds"] += time.perf_counter() - start
        return seqs, sampled, tokens, logprobs

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        return SamplingBatch.build(seqs, [self.output.stop_ids(s) for s in seqs], self.runner.vocab_size,
                                   self.device)

    def _decode(self, running: list[Sequence]) -> None:
        self._counters["rounds"] += 1
        self._counters["max_running"] = max(self._counters["max_running"], len(running))
        new_ids: list[list[int]] = [[] for _ in running]
        budgets = [self.output.budget(seq) for seq in running]
        stop_ids = [self.output.stop_ids(seq) for seq in running]
        done = [False] * len(running)

        def on_step(step: int, ids: list[int]) -> bool:
            for row, token in enumerate(ids):
                if not done[row]:
                    new_ids[row].append(token)
                    done[row] = len(new_ids[row]) >= budgets[row] or token in stop_ids[row]
            return all(done)

        batch, start = self._sampling_batch(running), time.perf_counter()
        steps = self.runner.decode(running, batch, self.config.num_scheduler_steps, on_step)
        self._counters["decode_seconds"] += time.perf_counter() - start
        self._counters["decode_steps"] += steps
        self._counters["decode_row_steps"] += steps * len(running)
        for seq, ids, logprobs in zip(running, new_ids, batch.take_logprobs(running)):
            self._emit(seq, self.output.append(seq, ids, logprobs))
            seq.num_computed = seq.cache_len
            self.scheduler.decoded(seq)

    def _emit(self, seq: Sequence, delta: RequestDelta) -> None:
        if seq.matcher is not None and seq.matcher.is_error():
            self._fail_constraint(seq)
            return
        self._counters["tokens_generated"] += len(delta.token_ids)
        if delta.finish_reason is not None:
            self._counters["finished"] += 1
            self._forget(seq)
        self._outbox.append((seq, delta))

    def _fail_constraint(self, seq: Sequence) -> None:
        """End a request whose matcher hit an error mid-output: an error to its caller, never "stop" with
        text the constraint did not finish (its mask allowed only EOS from there on)."""
        seq.finish_reason = "error"  # finished: its row and blocks are released with the others
        self._counters["finished"] += 1
        self._forget(seq)
        reason = readable_error(seq.matcher.get_error())
        self._outbox.append((seq, InvalidInput(
            f"the constraint failed after {len(seq.output_ids)} output tokens and cannot finish: {reason}",
            item=seq.params.structured.field, code="grammar_failed")))

    def _flush(self, unfinished_only: bool = False) -> None:
        # A finished request's last delta goes after its row is freed (`_release_finished`), so a caller that
        # sees a request finish also sees its row free: `unfinished_only` holds those back.
        outbox, self._outbox = self._outbox, []
        for seq, delta in outbox:
            if unfinished_only and seq.finished:
                self._outbox.append((seq, delta))
            else:
                seq.deliver(delta)

    def _release_finished(self) -> None:
        finished = [seq for seq in self.scheduler.running if seq.finished]
        if finished:
            self.runner.move_rows(self.scheduler.release(finished))

    def _apply_aborts(self, aborts: set[Sequence]) -> None:
        if not aborts:
            return
        leaving = []
        for seq in [s for s in self.scheduler.waiting if s in aborts]:
            self.scheduler.remove_waiting(seq)
            leaving.append(seq)
        leaving += [s for s in self.scheduler.running if s in aborts and not s.finished]
        for seq in leaving:
            self._counters["aborted"] += 1
            self._emit(seq, self.output.finish(seq, "abort"))
        self._release_finished()

    def _fail_running(self, exc: Exception) -> None:
        self._outbox = [(seq, delta) for seq, delta in self._outbox if seq.finished]
        for seq in self.scheduler.running:
            self.pool.release(seq.block_table)
            seq.block_table, seq.row = [], None
            if self.window is not None:
                self.window.release(seq)
            if self.snapshots is not None:
                self.scheduler.drop_snapshots(seq)
        failed, self.scheduler.running = [s for s in self.scheduler.running if not s.finished], []
        for seq in failed:
            self._forget(seq)  # a CapacityError (a decode group's rank died: GroupFailed) is retryable as it is
            seq.deliver(exc if isinstance(exc, CapacityError) else
                        RuntimeError(f"decode engine failed on this batch: {exc!r}"))

    def _forget(self, seq: Sequence) -> None:
        with self._cond:
            if self._live.get(seq.request_id) is seq:
                del self._live[seq.request_id]


def _first_piece(group: list[Sequence], tokens: int) -> list[Sequence]:
    """The longest start of `group` with at most `tokens` prompt tokens (at least its first sequence)."""
    total = 0
    for n, seq in enumerate(group):
        total += seq.chunk_len
        if n and total > tokens:
            return group[:n]
    return group


async def _resolve(embeds: Seq) -> list:
    """Ray ObjectRefs fetched without blocking the event loop; anything else as it is.

    Ray is looked up, not imported: a process that never imported it holds no ObjectRef, and the engine
    must run where Ray is not installed (the GPU check, `raypipe.gpucheck`)."""
    embeds = list(embeds)
    ray = sys.modules.get("ray")
    refs = [] if ray is None else [i for i, e in enumerate(embeds) if isinstance(e, ray.ObjectRef)]
    if refs:
        values = await asyncio.gather(*(embeds[i] for i in refs))
        for i, value in zip(refs, values):
            embeds[i] = value
    return embeds
