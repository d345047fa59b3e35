"""`raypipe bench kv`: what the paged KV cache and prefix caching buy, on the `small` preset by default.

(a) Same KV bytes, a realistic length mix (prompts 300-1,500 tokens, outputs 50-500, `--quick`: a
    quarter of those outputs and fewer requests): how many sequences run together and tokens/s,
    paged vs the old slot layout. The slot cache reserved `max_model_len` tokens per row, so at the
    same bytes it ran `budget / (max_model_len x bytes per token)` rows; it is gone, so its run is
    the same engine capped at that many sequences (each then always fits, as in a slot cache).
    Prompts are token ids: an image's tokens take the same K/V as text tokens.
(b) A round of K=8 eager decode steps (forward + logits) at equal batch and KV length: paged (the
    rows' blocks gathered once for the round, as the engine does) vs a contiguous per-row cache,
    per step; and one paged step that gathers on its own (as the static-shape step does).
(c) A 5-turn chat about one image (the image re-sent, the conversation growing): prompt tokens
    computed and time to first token per turn, prefix caching on vs off (medians over
    conversations, each with its own image; the embeddings are random rows of the right shape,
    the engine's cost does not depend on their values). Answers are held to lowercase letters
    (`logit_bias`): a random-weight model otherwise emits bytes that are not valid UTF-8, so the
    answer re-sent as history would tokenize to other ids and every turn would recompute it, which
    a real model's answers do not cause; the table says whether every answer round-tripped.
(d) A batch job whose rows share one long prompt (a 1,000-token instruction, then each row's own
    short text): tokens/s and prompt tokens computed, prefix caching on vs off. Rows that arrive
    while the first computes the shared prompt wait for its blocks (the scheduler's deferral) and
    compute only their own text (with row state: from the nearest snapshot).
(e) A 100-token system prompt shared by 16 requests, one after another, each with its own question:
    the prefix-cache hit rate (a model with per-row state hits from the third request on, at the
    branch point the second one kept), and state-snapshot bytes per cached token next to K/V bytes
    per token.
(f) Models with per-row state only: a 2,048-token prompt prefilled with a state snapshot every N
    blocks (every block, the default — one snapshot's bytes in K/V blocks — and 4x that): prefill
    seconds (a gated-delta-net model takes its snapshots inside the one forward) and snapshot bytes, against how many tokens a
    prompt branching off at a random point recomputes (N blocks / 2 on average): what
    `EngineConfig.snapshot_every_blocks` trades.

(a) and (b) compare the paged full-attention layout with the slot layout it replaced, so they run
only where every layer is full attention.

Numbers taken while other work shares the machine are noise; compare ratios from a quiet run.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time

import numpy as np
import torch
from transformers.cache_utils import Cache

from raypipe.bench.common import median_seconds, print_table, write_json
from raypipe.bench.decode import eager_step, spread_block_tables

MAX_MODEL_LEN = 4096
SLOT_ROWS = 4  # the slot cache's rows at max_model_len: this sets the shared KV budget
STEP_BATCHES = (1, 8, 32)
STEP_KV_LEN = 1024
ROUND_STEPS = 8
TURNS = 5
SYSTEM_TOKENS = 100
SYSTEM_REQUESTS = 16
INTERVAL_PROMPT = 2048
TEXT_TOKENS = 256  # the presets' byte tokens: ids below this are plain text, never a placeholder


def length_mix(rng: np.random.Generator, count: int, output_scale: float) -> list[tuple[int, int]]:
    return [(int(rng.integers(300, 1501)), max(1, int(rng.integers(50, 501) * output_scale))) for _ in range(count)]


def run_mix(engine, mix: list[tuple[int, int]], seed: int) -> dict:
    """Every request at once (token-id prompts, ignore_eos, its own output length): tokens/s and concurrency."""
    from raypipe import SamplingParams

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, TEXT_TOKENS, n).tolist() for n, _ in mix]

    async def all_requests():
        return await asyncio.gather(*(
            engine.generate_output(f"mix-{seed}-{i}", p, [], SamplingParams(max_tokens=out, ignore_eos=True))
            for i, (p, (_, out)) in enumerate(zip(prompts, mix))))

    before = engine.stats()
    start = time.perf_counter()
    outs = asyncio.run(all_requests())
    seconds = time.perf_counter() - start
    after = engine.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds, "max_running": after["max_running_seen"],
            "mean_decode_batch": after["mean_decode_batch"], "preemptions": after["preemptions"] - before["preemptions"]}


async def _all_at_once(engine, prompts: list[list[int]], max_tokens: int) -> list:
    from raypipe import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return await asyncio.gather(*(engine.generate_output(f"shared-{i}", p, [], params) for i, p in enumerate(prompts)))


class ContiguousCache(Cache):
    """The pre-paging layout for comparison: per layer K/V of `(rows, kv_heads, max_len, head_dim)`,
    each decode step writes at its rows' own index and attends over the first `kv_len` columns."""

    def __init__(self, text_config, rows: int, max_len: int, dtype: torch.dtype):
        super().__init__(layers=[])
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        shape = (rows, text_config.num_key_value_heads, max_len, head_dim)
        self.kv = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                   for _ in range(text_config.num_hidden_layers)]
        self.rows = torch.arange(rows)
        self.write_index = torch.zeros(rows, dtype=torch.long)
        self.kv_len = 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.kv[layer_idx]
        keys[self.rows, :, self.write_index] = key_states[:, :, 0]
        values[self.rows, :, self.write_index] = value_states[:, :, 0]
        return keys[:, :, : self.kv_len], values[:, :, : self.kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len


def step_times(runner, text_config, batch: int, kv_len: int, repeats: int) -> tuple[float, float, float]:
    """Median seconds per eager decode step at `batch` rows: paged in a round of `ROUND_STEPS`,
    contiguous in a round of as many, and paged alone (gathering for itself)."""
    from raypipe.decode.cache_kinds import additive

    tokens = torch.zeros(batch, dtype=torch.long)
    positions = torch.full((3, batch, 1), kv_len - 1, dtype=torch.long)
    write_index = torch.full((batch,), kv_len - 1, dtype=torch.long)
    tables = spread_block_tables(runner.cache, batch, kv_len + ROUND_STEPS)
    contiguous = ContiguousCache(text_config, batch, kv_len + ROUND_STEPS, runner.dtype)
    contiguous.write_index, contiguous.kv_len = write_index, kv_len
    mask = {"full_attention": additive((torch.arange(kv_len)[None, :] <= write_index[:, None])[:, None, None],
                                       runner.dtype)}

    def paged_step():
        return eager_step(runner, tokens, positions, write_index, kv_len, tables)

    @torch.inference_mode()
    def paged_round():
        runner.cache.begin_decode_round(tables)
        for _ in range(ROUND_STEPS):
            paged_step()
        runner.cache.end_decode_round()

    @torch.inference_mode()
    def contiguous_round():
        for _ in range(ROUND_STEPS):
            hidden = runner.model(runner.model.embed(tokens[:, None]), positions, mask, contiguous)
            runner.model.logits(hidden[:, -1])

    return (median_seconds(paged_round, repeats) / ROUND_STEPS, median_seconds(contiguous_round, repeats) / ROUND_STEPS,
            median_seconds(torch.inference_mode()(paged_step), repeats))


def chat_turns(engine, vision, image: np.ndarray, seed: int, max_tokens: int, questions: list[str]) -> list[dict]:
    """One conversation, turn by turn: prompt tokens, tokens computed by prefill, time to first token."""
    from raypipe import SamplingParams
    from raypipe.models.prompt import build_prompt

    adapter, rng = engine.adapter, torch.Generator().manual_seed(seed)
    letters = engine.tokenizer.convert_tokens_to_ids(list("abcdefghijklmnopqrstuvwxyz"))
    params = SamplingParams(max_tokens=max_tokens, logit_bias={token: 100.0 for token in letters})
    messages, turns = [], []
    for question in questions:
        content = ([{"type": "image", "image": image}] if not messages else []) + [{"type": "text", "text": question}]
        messages.append({"role": "user", "content": content})
        prompt = build_prompt(messages, engine.tokenizer, vision)
        if not turns:
            embeds = [torch.randn((adapter.tokens_per_image(layout.grid), adapter.embedding_width), generator=rng)
                      for layout in prompt.visual_layouts]

        async def first_token_and_text():
            start, first, text, ids = time.perf_counter(), None, "", []
            async for delta in engine.generate(f"chat-{seed}-{len(turns)}", prompt, embeds, params):
                first = first or time.perf_counter() - start
                text += delta.text
                ids += delta.token_ids
            return first, text, ids

        before = engine.stats()["prefill_tokens"]
        ttft, answer, ids = asyncio.run(first_token_and_text())
        turns.append({"prompt_tokens": len(prompt.prompt_token_ids), "ttft_s": ttft,
                      "computed_tokens": engine.stats()["prefill_tokens"] - before,
                      "round_trips": engine.tokenizer.encode(answer, add_special_tokens=False) == ids})
        messages.append({"role": "assistant", "content": answer})
    return turns


def main(args) -> int:
    from raypipe.decode.kv_cache import layer_types
    from raypipe.models.registry import language_adapter, resolve_model

    checkpoint = resolve_model(getattr(args, "model", None) or "small")
    torch.set_num_threads(os.cpu_count() or 1)
    adapter = language_adapter(checkpoint)
    text = adapter.text_config
    max_len = min(MAX_MODEL_LEN, adapter.max_position_embeddings)
    quick = args.quick
    rng = np.random.default_rng(0)
    mix = length_mix(rng, 12 if quick else 32, 0.25 if quick else 1.0)
    result = {"model": str(checkpoint), "max_model_len": max_len, "mix": mix}
    paged_only = set(layer_types(text)) == {"full_attention"}
    row_state = "linear_attention" in layer_types(text)  # state snapshots: (f)
    mix_rows, step_rows, budget = [], [], 0
    if paged_only:
        budget, mix_rows, step_rows = layouts(checkpoint, text, max_len, mix, quick, result)

    chat_rows, side, max_tokens, conversations = multi_turn_chat(checkpoint, max_len, quick, result)
    batch_rows, rows, batch_tokens = shared_batch(checkpoint, max_len, quick, result)
    system_rows = system_prompt(checkpoint, max_len, result)
    interval_rows = snapshot_intervals(checkpoint, max_len, quick, result) if row_state else []

    write_json(args.out, "kv", result)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
        return 0
    if not paged_only:
        print(f"(a) and (b) skipped: {checkpoint.name} has layers besides full attention {sorted(set(layer_types(text)))}; "
              "they compare full-attention cache layouts")
    else:
        print_table(f"(a) same KV bytes ({budget / 2**20:.0f} MiB = {SLOT_ROWS} slot rows of {max_len} tokens), "
                    f"{len(mix)} requests at once, prompts 300-1500, outputs {min(o for _, o in mix)}-"
                    f"{max(o for _, o in mix)}, {checkpoint.name}",
                    ["cache", "max running", "mean decode batch", "tokens", "tok/s", "preemptions"], mix_rows)
        print(f"paged / slot rows: {result['concurrency_ratio']:.2f}x sequences, {result['tok_s_ratio']:.2f}x tok/s")
        print_table(f"(b) eager decode step (forward + logits) in a round of {ROUND_STEPS}, median ms per step",
                    ["batch", "KV length", "paged", "contiguous", "paged / contiguous", "paged, gather per step"],
                    step_rows)
    print_table(f"(c) {TURNS}-turn chat, one {side}x{side} image, {max_tokens} tokens per answer, median of "
                f"{conversations} conversation(s), {checkpoint.name}",
                ["turn", "prompt tokens", "computed (off)", "computed (on)", "TTFT off ms", "TTFT on ms", "off / on"],
                chat_rows)
    print(f"turns 2-{TURNS}: TTFT {result['chat_ttft_ratio_turns_2_on']:.2f}x lower with prefix caching (median); "
          f"hit rate {result['chat']['on_hit_rate']:.2f}; every answer re-sent as the same tokens: "
          f"{'yes' if result['chat']['on_answers_round_trip'] and result['chat']['off_answers_round_trip'] else 'no'}")
    print_table(f"(d) a batch of {len(rows)} rows sharing a 1000-token prompt, {batch_tokens} tokens each",
                ["prefix caching", "rows", "prompt tokens", "computed", "seconds", "tok/s"], batch_rows)
    print(f"shared-prompt batch: {result['shared_batch_tok_s_ratio']:.2f}x tok/s with prefix caching")
    print_table(f"(e) {SYSTEM_REQUESTS} requests one after another sharing a {SYSTEM_TOKENS}-token system prompt",
                ["hit rate", "requests 3+: cached tokens (median)", "snapshots", "snapshot bytes / cached token",
                 "window K/V bytes / cached token", "K/V bytes / token"], system_rows)
    if interval_rows:
        print_table(f"(f) one {INTERVAL_PROMPT}-token prompt, a state snapshot every N blocks of "
                    f"{result['block_size']} tokens",
                    ["N", "prefill s (median)", "snapshots", "snapshot MiB", "prompt K/V MiB",
                     "mean tokens recomputed at a branch"],
                    interval_rows)
    return 0


def layouts(checkpoint, text, max_len: int, mix, quick: bool, result: dict):
    """(a) and (b): the paged layout against the slot layout and a contiguous cache."""
    from raypipe.decode.config import EngineConfig
    from raypipe.decode.engine import LLMEngine

    # (a) the same KV bytes, paged vs the slot layout's concurrency
    paged = LLMEngine(checkpoint, EngineConfig(max_num_seqs=64, max_model_len=max_len, num_scheduler_steps=8))
    budget = SLOT_ROWS * max_len * paged.runner.bytes_per_token
    paged.shutdown()
    configs = {"paged": EngineConfig(max_num_seqs=64, max_model_len=max_len, kv_cache_memory=budget),
               "slot rows": EngineConfig(max_num_seqs=SLOT_ROWS, max_model_len=max_len, kv_cache_memory=budget)}
    mix_rows, result["mix_runs"] = [], {}
    for name, config in configs.items():
        engine = LLMEngine(checkpoint, config)
        run_mix(engine, [(300, 4)] * 2, seed=99)  # warm-up
        runs = [run_mix(engine, mix, seed=s) for s in range(1 if quick else 3)]
        engine.shutdown()
        row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        result["mix_runs"][name] = row
        mix_rows.append([name, row["max_running"], row["mean_decode_batch"], row["tokens"], row["tok_s"],
                         row["preemptions"]])
    paged_row, slot_row = result["mix_runs"]["paged"], result["mix_runs"]["slot rows"]
    result["concurrency_ratio"] = paged_row["max_running"] / slot_row["max_running"]
    result["tok_s_ratio"] = paged_row["tok_s"] / slot_row["tok_s"]

    # (b) step time at equal batch, paged vs contiguous (an idle engine's pool; nothing else writes it)
    step_engine = LLMEngine(checkpoint, EngineConfig(max_num_seqs=max(STEP_BATCHES), max_model_len=max_len))
    step_rows, result["step"] = [], {}
    for b in STEP_BATCHES[:2] if quick else STEP_BATCHES:
        paged_s, plain_s, alone_s = step_times(step_engine.runner, text, b, STEP_KV_LEN, 3 if quick else 10)
        result["step"][b] = {"paged_ms": paged_s * 1e3, "contiguous_ms": plain_s * 1e3, "ratio": paged_s / plain_s,
                             "paged_gather_per_step_ms": alone_s * 1e3}
        step_rows.append([b, STEP_KV_LEN, paged_s * 1e3, plain_s * 1e3, paged_s / plain_s, alone_s * 1e3])
    step_engine.shutdown()
    return budget, mix_rows, step_rows


def multi_turn_chat(checkpoint, max_len: int, quick: bool, result: dict):
    """(c) multi-turn chat with one image, prefix caching on vs off."""
    from raypipe.decode.config import EngineConfig
    from raypipe.decode.engine import LLMEngine
    from raypipe.models.registry import vision_adapter

    vision = vision_adapter(checkpoint)
    side = 448 if quick else 672
    questions = ["What is in this picture?", "Describe the colors.", "What is in the top left corner?",
                 "Is there any text?", "Summarize everything so far."][:TURNS]
    max_tokens = 16 if quick else 48
    conversations = 1 if quick else 3
    result["chat"] = {}
    for name, caching in (("on", True), ("off", False)):
        engine = LLMEngine(checkpoint, EngineConfig(max_num_seqs=4, max_model_len=max_len,
                                                    enable_prefix_caching=caching))
        runs = [chat_turns(engine, vision, np.random.default_rng(c).integers(0, 256, (side, side, 3), dtype=np.uint8),
                           c, max_tokens, questions) for c in range(conversations)]
        result["chat"][name] = [{k: statistics.median(run[t][k] for run in runs) for k in runs[0][t] if k != "round_trips"}
                                for t in range(TURNS)]
        result["chat"][f"{name}_answers_round_trip"] = all(turn["round_trips"] for run in runs for turn in run)
        result["chat"][f"{name}_hit_rate"] = engine.stats()["prefix_cache_hit_rate"]
        engine.shutdown()
    chat_rows = []
    for t, (on, off) in enumerate(zip(result["chat"]["on"], result["chat"]["off"]), start=1):
        chat_rows.append([t, on["prompt_tokens"], off["computed_tokens"], on["computed_tokens"], off["ttft_s"] * 1e3,
                          on["ttft_s"] * 1e3, off["ttft_s"] / on["ttft_s"]])
    later = [off["ttft_s"] / on["ttft_s"] for on, off in zip(result["chat"]["on"][1:], result["chat"]["off"][1:])]
    result["chat_ttft_ratio_turns_2_on"] = statistics.median(later)
    return chat_rows, side, max_tokens, conversations


def shared_batch(checkpoint, max_len: int, quick: bool, result: dict):
    """(d) a batch sharing one prompt, prefix caching on vs off."""
    from raypipe.decode.config import EngineConfig
    from raypipe.decode.engine import LLMEngine

    shared_rng = np.random.default_rng(7)
    shared = shared_rng.integers(0, TEXT_TOKENS, 1000).tolist()
    rows = [shared + shared_rng.integers(0, TEXT_TOKENS, int(shared_rng.integers(10, 60))).tolist()
            for _ in range(16 if quick else 64)]
    batch_tokens = 16 if quick else 64
    batch_rows, result["shared_batch"] = [], {}
    for name, caching in (("off", False), ("on", True)):
        engine = LLMEngine(checkpoint, EngineConfig(max_num_seqs=32, max_model_len=max_len,
                                                    enable_prefix_caching=caching))
        run_mix(engine, [(300, 4)] * 2, seed=99)  # warm-up
        before = engine.stats()
        start = time.perf_counter()
        outs = asyncio.run(_all_at_once(engine, rows, batch_tokens))
        seconds = time.perf_counter() - start
        after = engine.stats()
        engine.shutdown()
        tokens = sum(len(o.token_ids) for o in outs)
        row = {"seconds": seconds, "tok_s": tokens / seconds,
               "computed_prompt_tokens": after["prefill_tokens"] - before["prefill_tokens"],
               "prompt_tokens": sum(len(r) for r in rows)}
        result["shared_batch"][name] = row
        batch_rows.append([name, len(rows), row["prompt_tokens"], row["computed_prompt_tokens"], row["seconds"],
                           row["tok_s"]])
    result["shared_batch_tok_s_ratio"] = result["shared_batch"]["on"]["tok_s"] / result["shared_batch"]["off"]["tok_s"]
    return batch_rows, rows, batch_tokens


def system_prompt(checkpoint, max_len: int, result: dict) -> list[list]:
    """(e) hit rate of requests sharing a 100-token system prompt, and what the cache keeps besides full-attention
    K/V per cached token: state snapshots (linear attention), cached window blocks (sliding layers)."""
    from raypipe import SamplingParams
    from raypipe.decode.config import EngineConfig
    from raypipe.decode.engine import LLMEngine
    from raypipe.models.prompt import build_prompt
    from raypipe.models.registry import vision_adapter

    engine = LLMEngine(checkpoint, EngineConfig(max_num_seqs=4, max_model_len=max_len))
    vision = vision_adapter(checkpoint)
    system = ("You are a helpful assistant for a museum. Answer in one short sentence, name the room. " * 2)
    ids = build_prompt([{"role": "system", "content": system}], engine.tokenizer, vision).prompt_token_ids
    system = system[: len(system) * SYSTEM_TOKENS // len(ids)]  # about SYSTEM_TOKENS tokens with the template
    cached = []
    for i in range(SYSTEM_REQUESTS):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: where is it?"}]
        prompt = build_prompt(messages, engine.tokenizer, vision)
        out = asyncio.run(engine.generate_output(f"system-{i}", prompt, [], SamplingParams(max_tokens=4)))
        cached.append(out.num_cached_tokens)
    stats = engine.stats()
    engine.shutdown()
    snapshot_bytes = stats.get("state_snapshots_cached", 0) * stats.get("state_snapshot_bytes", 0)
    cached_tokens = stats["kv_blocks_cached"] * stats["kv_block_size"]
    window_bytes = stats.get("sliding_kv_blocks_cached", 0) * stats["kv_block_size"] * engine.runner.window_bytes_per_token
    result["system_prompt"] = {"hit_rate": stats["prefix_cache_hit_rate"], "cached_per_request": cached,
                               "snapshots": stats.get("state_snapshots_cached", 0),
                               "snapshot_bytes_per_cached_token": snapshot_bytes / max(cached_tokens, 1),
                               "window_bytes_per_cached_token": window_bytes / max(cached_tokens, 1),
                               "kv_bytes_per_token": engine.runner.bytes_per_token,
                               "bytes_per_snapshot": stats.get("state_snapshot_bytes", 0)}
    r = result["system_prompt"]
    return [[r["hit_rate"], statistics.median(cached[2:]), r["snapshots"], r["snapshot_bytes_per_cached_token"],
             r["window_bytes_per_cached_token"], r["kv_bytes_per_token"]]]


def snapshot_intervals(checkpoint, max_len: int, quick: bool, result: dict) -> list[list]:
    """(f) prefill time and snapshot memory of one long prompt against the snapshot interval N: every
    block, the default (one snapshot's bytes in K/V blocks), and four times that; the snapshot pool
    holds one per block of the prompt, so no N runs out of slots."""
    from raypipe import SamplingParams
    from raypipe.decode.config import EngineConfig
    from raypipe.decode.engine import LLMEngine

    probe = LLMEngine(checkpoint, EngineConfig(max_num_seqs=1, max_model_len=max_len))
    state, per_token, default = (probe.runner.cache.state_bytes_per_row, probe.runner.bytes_per_token,
                                 probe.snapshot_every)
    block = probe.config.block_size
    probe.shutdown()
    blocks_bytes = 2 * -(-max_len // block) * block * per_token  # two max_len sequences
    snapshots_bytes = (INTERVAL_PROMPT // block + 2) * state
    total = blocks_bytes + snapshots_bytes
    prompt_rng = np.random.default_rng(11)
    out_rows, result["intervals"], result["block_size"] = [], {}, block
    for every in sorted({1, default, 4 * default}):
        engine = LLMEngine(checkpoint, EngineConfig(
            max_num_seqs=2, max_model_len=max_len, snapshot_every_blocks=every, kv_cache_memory=total + state,
            state_snapshot_memory_fraction=(snapshots_bytes + state) / (total + state)))
        times = []
        for r in range(2 if quick else 3):  # fresh prompts: nothing cached
            ids = prompt_rng.integers(0, TEXT_TOKENS, INTERVAL_PROMPT).tolist()
            start = time.perf_counter()
            asyncio.run(engine.generate_output(f"interval-{r}", ids, [], SamplingParams(max_tokens=1)))
            times.append(time.perf_counter() - start)
        stats = engine.stats()
        engine.shutdown()
        snapshots = stats["snapshots_taken"] / len(times)
        row = {"prefill_s": statistics.median(times), "snapshots": snapshots, "default": every == default,
               "snapshot_mib": snapshots * state / 2**20, "kv_mib": INTERVAL_PROMPT * per_token / 2**20,
               "mean_recompute": every * block / 2}
        result["intervals"][every] = row
        out_rows.append([f"{every}{' (default)' if every == default else ''}", row["prefill_s"], snapshots,
                         row["snapshot_mib"], row["kv_mib"], row["mean_recompute"]])
    return out_rows
