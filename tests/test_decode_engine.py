"""LLMEngine in-process: greedy equals transformers' generate() token for token, for K=1 and K=8."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from raypipe import InvalidInput, SamplingParams
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.decode.model_runner import ModelRunner
from raypipe.models.registry import vision_adapter
from tests import decode_reference as ref

MAX_NEW = 24


@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    with ref.engine_pool(tiny_ckpt, max_num_seqs=8, max_model_len=512) as get:
        yield get


@pytest.fixture(scope="module")
def cases(tiny_ckpt, hf_model, engines):
    """Prompt, reference embeddings and reference greedy tokens for each of ref.REQUESTS."""
    engine = engines(8)
    vision = vision_adapter(tiny_ckpt)
    out = []
    for i, (_, _) in enumerate(ref.REQUESTS):
        prompt = ref.prepare(i, engine.tokenizer, vision)
        embeds = ref.embeddings(hf_model, tiny_ckpt, prompt)
        want = ref.hf_generate(hf_model, prompt, embeds, MAX_NEW, engine.adapter.eos_token_ids[0])
        out.append((prompt, embeds, want))
    return out


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("case", [0, 1, 2], ids=["text", "one_image", "three_images"])
def test_single_request_matches_generate(engines, cases, k, case):
    prompt, embeds, want = cases[case]
    out = run(engines(k).generate_output(f"single-{k}-{case}", prompt, embeds, SamplingParams(max_tokens=MAX_NEW)))
    assert out.token_ids == want
    assert out.finish_reason == ("stop" if len(want) < MAX_NEW else "length")
    assert out.num_image_tokens == prompt.num_image_tokens


@pytest.mark.parametrize("k", [1, 8])
def test_staggered_concurrent_requests_join_a_running_batch(engines, cases, k):
    engine = engines(k)
    before = engine.stats()
    max_tokens = [MAX_NEW, 5, 17, MAX_NEW, 1, 9, 13, 20]

    async def one(i):
        await asyncio.sleep(0.004 * i)  # arrive while earlier requests are mid-generation
        prompt, embeds, _ = cases[i]
        return await engine.generate_output(f"batch-{k}-{i}", prompt, embeds, SamplingParams(max_tokens=max_tokens[i]))

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(len(cases))))

    outs = run(all_of_them())
    for i, out in enumerate(outs):
        assert out.token_ids == cases[i][2][: max_tokens[i]], f"request {i}"
    after = engine.stats()
    assert after["max_running_seen"] > 1
    assert after["prefill_batches"] - before["prefill_batches"] >= 2  # later requests joined a running batch
    assert after["running"] == 0 and after["waiting"] == 0
    # Its timers ran.
    assert after["prefill_seconds"] > before["prefill_seconds"] and after["decode_seconds"] > before["decode_seconds"]


@pytest.mark.parametrize("k", [1, 8])
def test_stop_token_ids_max_tokens_and_stop_strings_truncate_exactly(engines, cases, k):
    engine = engines(k)
    prompt, embeds, want = cases[1]
    stop_token = want[6]
    cut = want.index(stop_token) + 1

    async def stream(params):
        deltas = [d async for d in engine.generate(f"stop-{k}-{params}", prompt, embeds, params)]
        assert all(d.finish_reason is None for d in deltas[:-1])
        return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), deltas[-1].finish_reason

    assert run(stream(SamplingParams(max_tokens=MAX_NEW, stop_token_ids=[stop_token]))) == (
        want[:cut], engine.tokenizer.decode(want[:cut], skip_special_tokens=True), "stop")
    assert run(stream(SamplingParams(max_tokens=7)))[::2] == (want[:7], "length")

    full_text = engine.tokenizer.decode(want, skip_special_tokens=True)
    # Two tokens, completed mid-round for K=8, that decode to whole characters (U+FFFD stands for
    # bytes of a character not yet complete: it is never matched as stop text).
    start = next(i for i in range(9, len(want) - 1) if "\ufffd" not in engine.tokenizer.decode(want[i:i + 2]))
    stop = engine.tokenizer.decode(want[start:start + 2])
    n = next(n for n in range(1, len(want) + 1) if stop in engine.tokenizer.decode(want[:n]))
    tokens, text, reason = run(stream(SamplingParams(max_tokens=MAX_NEW, stop=["\x00never", stop])))
    assert (tokens, text, reason) == (want[:n], full_text[: full_text.index(stop)], "stop")


def test_eos_stops_unless_ignored(engines, cases, monkeypatch):
    engine = engines(8)
    prompt, embeds, want = cases[0]
    # The tiny model rarely samples <|im_end|>: make one of its greedy tokens the EOS for this test.
    monkeypatch.setattr(engine.output, "eos_token_ids", frozenset({want[4]}))
    cut = want.index(want[4]) + 1
    stopped = run(engine.generate_output("eos", prompt, embeds, SamplingParams(max_tokens=MAX_NEW)))
    ignored = run(engine.generate_output("eos-ignored", prompt, embeds,
                                         SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)))
    assert (stopped.token_ids, stopped.finish_reason) == (want[:cut], "stop")
    assert ignored.token_ids == want[:MAX_NEW]


def test_seeded_sampling_is_independent_of_the_batch(engines, cases):
    engine = engines(8)
    prompt, embeds, _ = cases[2]
    params = SamplingParams(max_tokens=20, temperature=0.9, top_k=40, top_p=0.95, seed=1234)
    alone = run(engine.generate_output("seed-alone", prompt, embeds, params)).token_ids

    async def busy():
        others = [engine.generate_output(f"noise-{i}", cases[i][0], cases[i][1],
                                         SamplingParams(max_tokens=15, temperature=1.0, seed=None if i % 2 else i))
                  for i in (0, 3, 4, 5)]
        results = await asyncio.gather(*others, engine.generate_output("seed-busy", prompt, embeds, params))
        return results[-1].token_ids

    assert run(busy()) == alone
    unseeded = [run(engine.generate_output(f"free-{i}", prompt, embeds,
                                           SamplingParams(max_tokens=20, temperature=0.9))).token_ids for i in range(2)]
    assert unseeded[0] != unseeded[1]  # it does sample


def test_bad_requests_fail_alone(engines, cases):
    engine = engines(8)
    prompt, embeds, want = cases[1]

    async def scenario():
        good = [asyncio.ensure_future(engine.generate_output(f"good-{i}", prompt, embeds,
                                                             SamplingParams(max_tokens=MAX_NEW))) for i in range(3)]
        await asyncio.sleep(0.01)
        bad = {
            "too_long": engine.generate_output("bad-long", [5] * 600, [], SamplingParams()),
            "count": engine.generate_output("bad-count", prompt, embeds[:0], SamplingParams()),
            "shape": engine.generate_output("bad-shape", prompt, [embeds[0][:-1]], SamplingParams()),
            "vocab": engine.generate_output("bad-vocab", [10 ** 6], [], SamplingParams()),
            "params": engine.generate_output("bad-params", [5, 6], [], {"max_tokens": 3}),
        }
        errors = {}
        for name, coro in bad.items():
            with pytest.raises(InvalidInput) as info:
                await coro
            errors[name] = info.value
        return [await g for g in good], errors

    outs, errors = run(scenario())
    assert errors["too_long"].code == "prompt_too_long"
    assert errors["count"].code == errors["shape"].code == "image_count_mismatch"
    assert all(out.token_ids == want for out in outs)
    with pytest.raises(InvalidInput):
        engine.check_request([5] * 600, SamplingParams())


def test_more_requests_than_rows_wait_and_complete(engines, cases):
    engine = engines(8, max_num_seqs=2, max_num_batched_tokens=512)

    async def many():
        return await asyncio.gather(*(engine.generate_output(f"wait-{i}", cases[i][0], cases[i][1],
                                                             SamplingParams(max_tokens=10)) for i in range(6)))

    outs = run(many())
    assert [out.token_ids for out in outs] == [cases[i][2][:10] for i in range(6)]
    stats = engine.stats()
    assert stats["max_running_seen"] == 2 and stats["kv_cache_bytes"] == engine.runner.cache.nbytes


def test_leaving_the_stream_aborts_and_frees_the_row(engines, cases):
    engine = engines(1)
    prompt, embeds, want = cases[0]

    async def leave_early():
        async for delta in engine.generate("leaver", prompt, embeds, SamplingParams(max_tokens=400, ignore_eos=True)):
            assert delta.token_ids
            break
        for _ in range(200):
            if engine.stats()["running"] == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    aborted = engine.stats()["requests_aborted"]
    assert run(leave_early())
    assert engine.stats()["requests_aborted"] == aborted + 1
    out = run(engine.generate_output("after", prompt, embeds, SamplingParams(max_tokens=MAX_NEW)))
    assert out.token_ids == want


def test_a_burst_answers_each_prefill_group_as_it_finishes(engines, cases, monkeypatch):
    """With nothing decoding, a round's prefill groups run one after the other: the first group's requests
    get their first token before a later group's prefill ends, not all together after the last one."""
    engine = engines(8)
    short, long_ = cases[0][0], [int(t) for t in torch.arange(200) % 50 + 30]  # two groups (length ratio)
    answered, waited = threading.Event(), []
    prefill = engine.runner.prefill

    def prefill_waiting_on_the_short_answer(seqs, sampled, batch):
        if any(s.prompt_len == len(long_) for s in seqs):
            waited.append(answered.wait(timeout=10))
        return prefill(seqs, sampled, batch)

    monkeypatch.setattr(engine.runner, "prefill", prefill_waiting_on_the_short_answer)

    async def first_token(request_id, prompt, embeds):
        async for delta in engine.generate(request_id, prompt, embeds, SamplingParams(max_tokens=2)):
            if delta.token_ids:
                answered.set()
                return delta.token_ids[0]

    async def both():
        return await asyncio.gather(first_token("burst-short", short, cases[0][1]),
                                    first_token("burst-long", long_, []))

    firsts = run(both())
    assert waited == [True]
    assert firsts[0] == cases[0][2][0]


def test_the_cpu_engine_runs_packed_linears_and_says_so(engines):
    """Every decode test here compares against `generate()` with these packed linears in place. (Eager steps
    named: packing is theirs, and `RAYPIPE_TEST_STATIC_STEPS=1` would force the static step otherwise.)"""
    from raypipe.models.packed_linear import PackedLinear
    from raypipe.models.packed_siblings import SiblingLinear

    engine = engines(8, compiled_decode=False)
    modules = list(engine.runner.model.modules())
    packed = [m for m in modules if isinstance(m, PackedLinear)]
    siblings = [m for m in modules if isinstance(m, SiblingLinear)]
    layers = engine.adapter.text_config.num_hidden_layers
    assert len(siblings) == 5 * layers  # q, k, v and gate, up in every layer, each set one GEMM
    assert len(packed) >= 2 * layers  # o, down
    packing, _, one_row = engine.stats()["linear_weights"].partition("; ")
    assert packing == (f"{len(packed) + len(siblings)} linear layers packed in torch.float32 for oneDNN "
                       f"({len(siblings)} of them as q/k/v or gate/up siblings sharing a GEMM)")
    # One-row inputs: through plain weights kept beside the packed ones everywhere, or nowhere, as measured
    kept = {layer.plain_weight is not None for layer in packed + [s.group for s in siblings]}
    assert len(kept) == 1
    assert one_row.startswith(f"one row at a time through {'plain' if kept.pop() else 'packed'} weights (")


def test_only_the_thread_that_loaded_the_model_runs_forwards_on_several_threads(tiny_ckpt, cases, monkeypatch):
    """Each thread that runs a parallel torch op keeps an OpenMP team, and more OpenMP threads than CPUs make
    libgomp's workers sleep between ops (runtime/cpu_threads.py). So the engine thread loads the model and runs
    every forward on several threads: a prefill beside the decode is on one thread, and once the decode is
    done, the engine thread prefills what is left on every thread."""
    loaded_on = []

    def runner_recording_its_thread(*args, **kwargs):
        loaded_on.append((threading.current_thread(), torch.get_num_threads()))
        return ModelRunner(*args, **kwargs)

    engine = LLMEngine(tiny_ckpt, EngineConfig(max_num_seqs=8, max_model_len=512, num_scheduler_steps=8,
                                               num_threads=2, compiled_decode=False), runner_recording_its_thread)
    try:
        _check_forward_threads(engine, loaded_on, cases, monkeypatch)
    finally:
        engine.shutdown()


def _check_forward_threads(engine, loaded_on, cases, monkeypatch):
    seen, undelivered, decoding, decoded = [], [], threading.Event(), threading.Event()
    prefill, decode = engine.runner.prefill, engine.runner.decode

    def prefill_recording_threads(seqs, sampled, batch):
        beside = decoding.wait(timeout=1.0)  # the round's decode starts just after this prefill was handed over
        seen.append(("prefill", beside, threading.current_thread(), torch.get_num_threads()))
        undelivered.append([seq.request_id for seq, _ in engine._outbox if not seq.finished])
        if beside:
            decoded.wait(timeout=10)  # let the decode finish before the next group
        return prefill(seqs, sampled, batch)

    def decode_flagged(*args):
        seen.append(("decode", True, threading.current_thread(), torch.get_num_threads()))
        decoded.clear()
        decoding.set()
        try:
            return decode(*args)
        finally:
            decoding.clear()
            decoded.set()

    from raypipe.decode import engine as engine_module

    callers = []  # the caller's side of `generate` (its embedding rows and positions) runs on one torch thread

    def visual_rows_recording_threads(*args):
        callers.append(torch.get_num_threads())
        return visual_rows(*args)

    visual_rows = engine_module.visual_rows
    monkeypatch.setattr(engine_module, "visual_rows", visual_rows_recording_threads)
    monkeypatch.setattr(engine.runner, "prefill", prefill_recording_threads)
    monkeypatch.setattr(engine.runner, "decode", decode_flagged)
    long_ = [int(t) for t in torch.arange(200) % 50 + 30]  # a group of its own beside cases[1]

    async def late_joiners():
        first = asyncio.ensure_future(engine.generate_output("threads-a", cases[0][0], cases[0][1],
                                                             SamplingParams(max_tokens=64, ignore_eos=True)))
        while engine.stats()["decode_steps"] == 0:
            await asyncio.sleep(0.002)
        joined = await asyncio.gather(
            engine.generate_output("threads-b", cases[1][0], cases[1][1], SamplingParams(max_tokens=4)),
            engine.generate_output("threads-c", long_, [], SamplingParams(max_tokens=4)))
        return await first, joined

    _, (joined, _) = run(late_joiners())
    assert joined.token_ids == cases[1][2][:4]
    (engine_thread, threads), = loaded_on
    assert engine_thread.name == "raypipe-decode" and threads == 2
    prefills = [s for s in seen if s[0] == "prefill"]
    assert prefills[0][2:] == (engine_thread, 2)  # the first request's prefill: nothing decoding, every thread
    if engine.runner.compiled_forward is not None:  # RAYPIPE_TEST_COMPILED_FORWARD: prefills first, never beside
        assert all(s[1:] == (False, engine_thread, 2) for s in prefills)
    else:
        beside, thread, count = prefills[1][1:]  # the next, beside the decode: on the prefill thread, one torch thread
        assert beside and thread.name.startswith("raypipe-prefill") and count == 1
        assert prefills[2][2:] == (engine_thread, 2)  # what was left once the decode was done: the engine thread's
        # ... once the decode's tokens and the first token prefilled beside it went out: they do not wait for it
        assert undelivered[2] == []
    several = {thread for _, _, thread, count in seen if count > 1}
    assert several == {engine_thread}
    assert [s[2:] for s in seen if s[0] == "decode"][0] == (engine_thread, 2)
    assert callers == [1, 1, 1]


def test_a_prefill_group_beside_a_decode_is_cut_into_pieces_of_bounded_tokens():
    """One big group would keep the prefill on the prefill thread's one core until the round ends, however soon
    the decode beside it is done: while it runs, a forward takes at most `OVERLAP_PIECE_TOKENS` prompt tokens."""
    from types import SimpleNamespace

    from raypipe.decode.engine import _first_piece

    group = [SimpleNamespace(chunk_len=n) for n in (75, 75, 75, 75, 300, 10)]
    pieces = []
    while group:
        pieces.append(_first_piece(group, 256))
        group = group[len(pieces[-1]):]
    assert [[s.chunk_len for s in piece] for piece in pieces] == [[75, 75, 75], [75], [300], [10]]


def test_a_round_that_decodes_nothing_prefills_forward_by_forward_and_answers_each(tiny_ckpt, cases, monkeypatch):
    """On a CPU a round with nothing decoding prefills its groups in forwards of at most `ANSWER_PIECE_TOKENS`
    prompt tokens (at least one prompt each), and each forward's first tokens go out before the next forward
    begins: a burst's first requests answer while the rest still prefill. Greedy tokens stay transformers'."""
    from raypipe.decode import engine as engine_module
    from raypipe.decode import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "MAX_PADDING", 100.0)  # the whole burst in one length group
    monkeypatch.setattr(engine_module, "ANSWER_PIECE_TOKENS", 1)  # ... and one prompt per forward
    engine = LLMEngine(tiny_ckpt, EngineConfig(max_num_seqs=8, max_model_len=512, num_threads=2,
                                               compiled_decode=False, enable_prefix_caching=False))
    forwards = []
    prefill = engine.runner.prefill

    def prefill_recording(seqs, sampled, batch):
        earlier = [s for forward in forwards for s in forward[0]]
        forwards.append((list(seqs), [seq for seq, _ in engine._outbox], [len(s.output_ids) for s in earlier]))
        return prefill(seqs, sampled, batch)

    monkeypatch.setattr(engine.runner, "prefill", prefill_recording)

    async def burst():
        return await asyncio.gather(*(engine.generate_output(f"burst-{i}", prompt, embeds,
                                                             SamplingParams(max_tokens=MAX_NEW))
                                      for i, (prompt, embeds, _) in enumerate(cases)))

    try:
        outputs = run(burst())
    finally:
        engine.shutdown()
    assert [o.token_ids for o in outputs] == [want for _, _, want in cases]
    assert [len(seqs) for seqs, _, _ in forwards] == [1] * len(cases)
    for _, undelivered, earlier_tokens in forwards:
        assert undelivered == [] and earlier_tokens == [1] * len(earlier_tokens)  # answered, not yet decoding


def test_a_burst_much_larger_than_the_decode_batch_prefills_first_on_every_thread(engines, cases, monkeypatch):
    """A burst of prompts joining one decoding row prefills in a round of its own on the engine thread (not on
    the prefill thread's one core beside a one-row decode), and the row decodes with the burst's rows next
    round (what the scheduler's token budget left of the burst may then overlap: never two such rounds running).
    Greedy tokens stay transformers'."""
    from raypipe.decode import engine as engine_module

    engine = engines(8)
    # The tiny prompts' burst: a few hundred tokens, fewer where earlier tests left them in the prefix cache
    monkeypatch.setattr(engine_module, "PREFILL_FIRST_TOKENS", 16)
    monkeypatch.setattr(engine_module, "PREFILL_FIRST_TOKENS_PER_ROW", 8)
    seen = []
    prefill, decode = engine.runner.prefill, engine.runner.decode
    monkeypatch.setattr(engine.runner, "prefill", lambda seqs, *more: (
        seen.append(("prefill", threading.current_thread().name, len(seqs))), prefill(seqs, *more))[1])
    monkeypatch.setattr(engine.runner, "decode", lambda seqs, *more: (
        seen.append(("decode", threading.current_thread().name, len(seqs))), decode(seqs, *more))[1])
    burst = cases[1:]

    async def burst_joins():
        steps = engine.stats()["decode_steps"]
        first = asyncio.ensure_future(engine.generate_output("first-alone", cases[0][0], cases[0][1],
                                                             SamplingParams(max_tokens=48, ignore_eos=True)))
        while engine.stats()["decode_steps"] == steps:
            await asyncio.sleep(0.002)
        joined = await asyncio.gather(*(engine.generate_output(f"burst-{i}", prompt, embeds,
                                                               SamplingParams(max_tokens=MAX_NEW))
                                        for i, (prompt, embeds, _) in enumerate(burst)))
        return await first, joined

    _, joined = run(burst_joins())
    assert [o.token_ids for o in joined] == [want for _, _, want in burst]
    joined_at = next(i for i, s in enumerate(seen) if s[0] == "prefill" and i and seen[i - 1][0] == "decode")
    first_round = seen[joined_at:joined_at + next(i for i, s in enumerate(seen[joined_at:]) if s[0] == "decode")]
    assert first_round and all(name == "raypipe-decode" for _, name, _ in first_round)  # every thread's
    after = next(s for s in seen[joined_at:] if s[0] == "decode")
    assert after[2] == 1 + sum(n for _, _, n in first_round)  # the lone row waited a round, decodes with them
