"""Paged KV cache, prefix caching and chunked prefill (Qwen2.5-VL): greedy still equals transformers'
generate() token for token, for K=1 and K=8, and each mechanism did run (the engine's stats say so).

Engines use 8-token blocks so that the tiny prompts span several blocks and images straddle block
boundaries (a block's hash then covers part of an image, at an offset inside it).
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from raypipe import SamplingParams
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.models.prompt import build_prompt
from raypipe.models.registry import vision_adapter
from tests import decode_reference as ref
from tests.conftest import random_images

MAX_NEW = 16
BLOCK = 8
LONG_TEXT = "Here is some context that several requests share before they ask their own question. " * 2


@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    with ref.engine_pool(tiny_ckpt, max_num_seqs=8, max_model_len=512, block_size=BLOCK) as get:
        yield get


@pytest.fixture(scope="module")
def vision(tiny_ckpt):
    return vision_adapter(tiny_ckpt)


def run(coro):
    return asyncio.run(coro)


def case(engine, hf_model, ckpt, vision, msgs, max_new=MAX_NEW):
    prompt = build_prompt(msgs, engine.tokenizer, vision)
    embeds = ref.embeddings(hf_model, ckpt, prompt)
    return prompt, embeds, ref.hf_generate(hf_model, prompt, embeds, max_new, engine.adapter.eos_token_ids[0])


def generate_counting_hits(engine, tag, prompt, embeds, max_new=MAX_NEW):
    """(output, prompt tokens taken from the prefix cache) of one request run alone."""
    before = engine.stats()["prefix_cache_hit_tokens"]
    out = run(engine.generate_output(tag, prompt, embeds, SamplingParams(max_tokens=max_new)))
    return out, engine.stats()["prefix_cache_hit_tokens"] - before


def expected_hits(prompt: list[int], cached: list[int]) -> int:
    """Tokens a prompt takes from the cache when `cached` tokens' K/V were left there: the full blocks
    inside their common prefix, short of the prompt's last token (which must be computed)."""
    common = len(os.path.commonprefix([prompt, cached]))
    return min(common, len(prompt) - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("k", [1, 8])
def test_cached_prefixes_are_reused_and_outputs_unchanged(engines, hf_model, tiny_ckpt, vision, k):
    engine = engines(k)
    assert engine.stats()["prefix_caching"] is True
    image, other = random_images([(112, 168), (112, 168)], seed=40 + k)
    first = case(engine, hf_model, tiny_ckpt, vision, ref.messages("What is in this picture?", [image]))
    out, hits = generate_counting_hits(engine, f"img-q1-{k}", *first[:2])
    assert out.token_ids == first[2] and hits == 0
    # Cached by now: the prompt and every generated token but the last (its K/V were never computed).
    cached = first[0].prompt_token_ids + out.token_ids[:-1]

    # The same image, another question: everything up to the question's first block is reused.
    second = case(engine, hf_model, tiny_ckpt, vision, ref.messages("Which colors do you see?", [image]))
    out, hits = generate_counting_hits(engine, f"img-q2-{k}", *second[:2])
    assert out.token_ids == second[2]
    image_end = max(i for i, t in enumerate(first[0].prompt_token_ids) if t == hf_model.config.image_token_id) + 1
    assert hits == expected_hits(second[0].prompt_token_ids, cached) >= image_end // BLOCK * BLOCK

    # Another image of the same size: the same placeholder ids, other content, so no block from the
    # image's start on may be reused (it would be by token ids alone).
    third = case(engine, hf_model, tiny_ckpt, vision, ref.messages("What is in this picture?", [other]))
    image_start = first[0].prompt_token_ids.index(hf_model.config.image_token_id)
    out, hits = generate_counting_hits(engine, f"other-{k}", *third[:2])
    assert out.token_ids == third[2]
    assert hits == image_start // BLOCK * BLOCK < expected_hits(third[0].prompt_token_ids, cached)

    # Multi-turn: the first turn's answer appended, the image re-sent, a new question.
    answer = engine.tokenizer.decode(first[2], skip_special_tokens=True)
    turn2 = [*ref.messages("What is in this picture?", [image]), {"role": "assistant", "content": answer},
             {"role": "user", "content": [{"type": "text", "text": "And what else?"}]}]
    follow = case(engine, hf_model, tiny_ckpt, vision, turn2)
    out, hits = generate_counting_hits(engine, f"turn2-{k}", *follow[:2])
    assert out.token_ids == follow[2]
    assert hits == expected_hits(follow[0].prompt_token_ids, cached) >= len(first[0].prompt_token_ids) // BLOCK * BLOCK


@pytest.mark.parametrize("k", [1, 8])
def test_text_prompts_sharing_a_prefix(engines, hf_model, tiny_ckpt, vision, k):
    engine = engines(k, enable_prefix_caching=True)  # its own engine: nothing cached by other tests
    cases = [case(engine, hf_model, tiny_ckpt, vision, ref.messages(LONG_TEXT + q, []))
             for q in ("Why?", "How many words came before this question?", "Why?")]
    outs = []
    for i, (prompt, embeds, want) in enumerate(cases):
        out, hits = generate_counting_hits(engine, f"text-{k}-{i}", prompt, embeds)
        assert out.token_ids == want
        outs.append(out)
        ids = prompt.prompt_token_ids
        if i == 0:
            assert hits == 0
        elif i == 1:  # the shared text, up to the block the two prompts differ in
            assert hits == expected_hits(ids, cases[0][0].prompt_token_ids) > len(LONG_TEXT) // 2
        else:  # the first prompt again: all of it but its last block
            assert hits == (len(ids) - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("k", [1, 8])
def test_rows_sharing_a_prompt_read_its_blocks_once_with_transformers_tokens(engines, hf_model, tiny_ckpt, vision,
                                                                             monkeypatch, k):
    """Four requests on one cached prompt decode together: the round gathers the blocks all rows share once
    (`PagedAttentionLayer.begin_round(shared_blocks=)`) and the decode attention reads them once for every row
    (`attention._shared_then_own`); greedy tokens stay transformers'."""
    from raypipe.decode.paged_attention import PagedAttentionLayer

    engine = engines(k, enable_prefix_caching=True)
    shared = []
    begin = PagedAttentionLayer.begin_round
    monkeypatch.setattr(PagedAttentionLayer, "begin_round",
                        lambda self, tables, shared_blocks=0, *more: (shared.append((tables.shape[0], shared_blocks)),
                                                                      begin(self, tables, shared_blocks, *more))[1])
    cases = [case(engine, hf_model, tiny_ckpt, vision, ref.messages(LONG_TEXT + q, []))
             for q in ("Why?", "Tell me more.", "How long is it?", "Why not?")]
    run(engine.generate_output(f"warm-shared-{k}", *cases[0][:2], SamplingParams(max_tokens=1)))

    async def together():
        return await asyncio.gather(*(engine.generate_output(f"shared-{k}-{i}", prompt, embeds,
                                                             SamplingParams(max_tokens=MAX_NEW))
                                      for i, (prompt, embeds, _) in enumerate(cases)))

    outs = run(together())
    assert [o.token_ids for o in outs] == [want for _, _, want in cases]
    common = len(os.path.commonprefix([c[0].prompt_token_ids for c in cases])) // BLOCK
    assert any(rows == 4 and blocks == common >= 4 for rows, blocks in shared), (common, shared)


def test_rounds_continue_the_last_rounds_rows_with_transformers_tokens(engines, hf_model, tiny_ckpt, vision,
                                                                        monkeypatch):
    """A decode round of the same sequences as the last one starts from that round's rows instead of gathering
    (`round_reuse.py`): kept in place while the rows keep their order, copied when rows that finished leave gaps.
    Rows ending at different steps, with images: greedy tokens stay transformers'. A round always gathering
    (`kept_rows` dropped) gives the same tokens: the rows hold what the pool holds."""
    from raypipe.decode.paged_attention import PagedAttentionLayer

    engine = engines(2)
    images = random_images([(112, 168), (168, 112)], seed=71)
    lengths = [16, 5, 9, 16]
    cases = [case(engine, hf_model, tiny_ckpt, vision, ref.messages(q, pictures), max_new=n)
             for q, pictures, n in zip(("What is this?", "Describe it.", "Colors?", "Tell me a story."),
                                       ([images[0]], [], [images[1]], []), lengths)]
    calls = []
    begin = PagedAttentionLayer.begin_round

    def recording(self, tables, shared_blocks=0, kept_rows=None, spare_blocks=0):
        calls.append(kept_rows if self.kept is not None else None)
        return begin(self, tables, shared_blocks, kept_rows, spare_blocks)

    async def together(tag):
        return await asyncio.gather(*(engine.generate_output(f"{tag}-{i}", prompt, embeds, SamplingParams(max_tokens=n))
                                      for i, ((prompt, embeds, _), n) in enumerate(zip(cases, lengths))))

    monkeypatch.setattr(PagedAttentionLayer, "begin_round", recording)
    outs = run(together("kept"))
    assert [o.token_ids for o in outs] == [want for _, _, want in cases]
    reused = [rows for rows in calls if rows is not None]
    assert any(rows == list(range(len(rows))) for rows in reused), calls  # kept in place
    assert any(rows != list(range(len(rows))) for rows in reused), calls  # rows copied into a new order
    monkeypatch.setattr(PagedAttentionLayer, "begin_round",
                        lambda self, tables, shared_blocks=0, kept_rows=None, spare_blocks=0:
                        begin(self, tables, shared_blocks, None, spare_blocks))
    assert [o.token_ids for o in run(together("gathered"))] == [want for _, _, want in cases]


def test_shared_then_own_attention_equals_attention_over_every_rows_whole_keys():
    """The decode attention over shared keys (read once) and each row's own equals `_merged_heads` over each
    row's copy of all of them, masked alike; keys given to another kernel (SDPA: not CPU fp32) are joined back."""
    from raypipe.decode import attention
    from raypipe.decode.paged_attention import SHARED_PREFIX

    torch.manual_seed(0)
    rows, heads, kv_heads, dim, prefix, own = 5, 8, 2, 16, 24, 7
    query = torch.randn(rows, heads, 1, dim)
    shared_keys, shared_values = torch.randn(1, kv_heads, prefix, dim), torch.randn(1, kv_heads, prefix, dim)
    keys, values = torch.randn(rows, kv_heads, own, dim), torch.randn(rows, kv_heads, own, dim)
    ends = torch.tensor([3, 7, 1, 5, 6])  # each row's own keys in use
    allowed = torch.arange(prefix + own)[None, :] < (prefix + ends)[:, None]
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None, None, :]
    whole_keys = torch.cat((shared_keys.expand(rows, -1, -1, -1), keys), 2)
    whole_values = torch.cat((shared_values.expand(rows, -1, -1, -1), values), 2)
    want = attention._merged_heads(query, whole_keys, whole_values, mask, dim ** -0.5)
    setattr(keys, SHARED_PREFIX, (shared_keys.transpose(2, 3).contiguous(), shared_values))
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True  # what SDPA's path reads of a layer
    got, _ = attention.attention_forward(module, query, keys, values, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    keys64 = keys.double()
    setattr(keys64, SHARED_PREFIX, tuple(part.double() for part in getattr(keys, SHARED_PREFIX)))
    sdpa, _ = attention.attention_forward(module, query.double(), keys64, values.double(), mask.double())
    torch.testing.assert_close(sdpa.float(), want, rtol=1e-5, atol=1e-6)


def test_forward_threads_flush_denormals_and_others_do_not():
    """The engine's forward threads treat floats below fp32's normal range as zero (`cpu_threads.forward_thread`);
    a thread that did not ask, such as the caller's, keeps them."""
    import threading

    from raypipe.runtime.cpu_threads import forward_thread

    denormal = torch.tensor([1e-40])
    seen = {}

    def forward():
        forward_thread(1)
        seen["forward"] = (denormal * 1.0).item()

    thread = threading.Thread(target=forward)
    thread.start()
    thread.join()
    assert seen["forward"] == 0.0 and (denormal * 1.0).item() > 0.0


def bytes_for(engine: LLMEngine, tokens: int) -> int:
    return engine.runner.bytes_per_token * tokens


@pytest.mark.parametrize("k", [1, 8])
def test_preempted_sequences_resume_with_the_same_tokens(engines, hf_model, tiny_ckpt, vision, k):
    """Four copies of a request at once in a pool of two prompts' blocks and one more: the newer of the
    two admitted is preempted as they grow, and recomputed later (its cached blocks come back from the
    prefix cache). Then 8 different requests, staggered, through a pool of about two of them."""
    cases = [case(engines(1), hf_model, tiny_ckpt, vision, ref.request(i), 24) for i in range(len(ref.REQUESTS))]
    params = SamplingParams(max_tokens=24)
    longest_output = max(cases, key=lambda c: len(c[2]))
    assert len(longest_output[2]) >= 2 * BLOCK  # it grows by two blocks or more: the pool cannot hold two
    outs, stats = ref.preempted_copies(engines, k, longest_output, params, block_size=BLOCK)
    assert [out.token_ids for out in outs] == [longest_output[2]] * 4
    assert stats["preemptions"] > 0 and stats["kv_blocks_used"] == 0

    longest = max(len(p.prompt_token_ids) for p, _, _ in cases) + 24
    engine = engines(k, kv_cache_memory=bytes_for(engines(1), 2 * longest), max_model_len=longest)
    outs = ref.staggered(engine, cases, [params] * len(cases), f"preempt-{k}")
    for i, out in enumerate(outs):
        assert out.token_ids == cases[i][2], f"request {i}"
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["running"] == stats["waiting"] == 0


@pytest.mark.parametrize("k", [1, 8])
def test_chunked_prefill_of_a_prompt_three_times_the_round_budget(engines, hf_model, tiny_ckpt, vision, k):
    long = case(engines(1), hf_model, tiny_ckpt, vision, ref.request(2))
    prompt_len = len(long[0].prompt_token_ids)
    engine = engines(k, max_num_batched_tokens=prompt_len // 3, enable_prefix_caching=False)
    short = case(engines(1), hf_model, tiny_ckpt, vision, ref.request(6), 40)
    seen: list[str] = []  # which request each delta belonged to, in arrival order

    async def both():
        async def tokens(tag, prompt, embeds, n):
            ids = []
            async for delta in engine.generate(tag, prompt, embeds, SamplingParams(max_tokens=n)):
                seen.append(tag)
                ids += delta.token_ids
            return ids

        first = asyncio.ensure_future(tokens("short", short[0], short[1], 40))
        while engine.stats()["running"] == 0:
            await asyncio.sleep(0.001)
        return await asyncio.gather(first, tokens("long", long[0], long[1], MAX_NEW))

    before = engine.stats()
    got_short, got_long = run(both())
    assert got_long == long[2] and got_short == short[2]
    after = engine.stats()
    budget = engine.config.max_num_batched_tokens
    assert after["chunked_prefills"] - before["chunked_prefills"] == 1 + (len(short[0].prompt_token_ids) > budget)
    assert after["prefill_tokens"] - before["prefill_tokens"] >= prompt_len
    if len(short[2]) > 4 * k:  # the short one kept decoding (a delta per round) over the long one's 3+ chunks
        assert seen[: seen.index("long")].count("short") >= 3


def test_the_default_pool_holds_a_max_model_len_sequence_in_whole_blocks(tiny_ckpt, hf_model):
    """max_model_len 24 with one sequence and 16-token blocks: the default CPU pool is two blocks, so a
    request that reaches 24 tokens is admitted (it used to get one block and `kv_cache_too_small`)."""
    engine = LLMEngine(tiny_ckpt, EngineConfig(max_model_len=24, max_num_seqs=1))
    try:
        assert engine.config.block_size == 16
        assert engine.stats()["kv_cache_tokens"] == 32  # ceil(24 / 16) blocks of 16
        prompt = [ord(c) for c in "twenty tokens of text"][:20]
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                                     eos_token_id=[10 ** 6], pad_token_id=0)[0, len(prompt):].tolist()
        for max_tokens in (4, 30):  # reaches max_model_len exactly; asks past it (cut at max_model_len)
            out = run(engine.generate_output(f"fits-{max_tokens}", prompt, [],
                                             SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
            assert out.token_ids == want and out.finish_reason == "length"
        bytes_per_token = engine.runner.bytes_per_token
    finally:
        engine.shutdown()

    # An explicit pool too small for one max_model_len sequence: refused at start, naming the settings.
    with pytest.raises(ValueError) as err:
        LLMEngine(tiny_ckpt, EngineConfig(max_model_len=24, max_num_seqs=1, kv_cache_memory=bytes_per_token * 16))
    message = str(err.value)
    assert "holds 16 tokens" in message and "max_model_len = 24" in message
    assert f"kv_cache_memory to at least {bytes_per_token * 32} bytes" in message
    assert "max_model_len to at most 16" in message


def test_engine_config_refuses_bad_kv_settings():
    for bad in (dict(kv_cache_memory=0), dict(kv_cache_memory=1.5), dict(kv_cache_free_memory_fraction=0),
                dict(kv_cache_free_memory_fraction=1.5), dict(block_size=0)):
        with pytest.raises(ValueError):
            EngineConfig(**bad)
    EngineConfig(max_model_len=4096, max_num_batched_tokens=512)  # a budget below max_model_len is fine now


def test_kv_stats_reach_the_metrics_endpoint(engines):
    from raypipe.serve.metrics import ServeMetrics

    engine = engines(8)
    run(engine.generate_output("for-metrics", list(range(3 * BLOCK)), [], SamplingParams(max_tokens=4)))
    stats = engine.stats()
    text = ServeMetrics().render(None, stats).decode()
    for key, name in (("kv_blocks_total", "raypipe_kv_blocks_total"), ("kv_blocks_used", "raypipe_kv_blocks_used"),
                      ("kv_blocks_cached", "raypipe_kv_blocks_cached"), ("kv_cache_tokens", "raypipe_kv_cache_tokens"),
                      ("prefix_cache_hit_rate", "raypipe_prefix_cache_hit_rate"),
                      ("preemptions", "raypipe_decode_preemptions"),
                      ("chunked_prefills", "raypipe_decode_chunked_prefills")):
        assert f"{name} {float(stats[key])}" in text, name
    assert stats["kv_blocks_total"] * BLOCK == stats["kv_cache_tokens"] and stats["kv_blocks_cached"] > 0
