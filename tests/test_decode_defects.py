"""The LLMEngine defects of issue 8, each reproduced as reported (every test failed before its fix).

Stop strings are checked against a plain one-token-at-a-time reference: decode the first n greedy
tokens for n = 1, 2, ... (dropping a trailing incomplete character) and stop at the first n whose
text contains a stop string.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from raypipe import SamplingParams
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.decode.output import OutputProcessor
from raypipe.decode.sequence import Sequence
from raypipe.errors import CapacityError, EngineClosed, InvalidInput
from tests import decode_reference as ref


@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    with ref.engine_pool(tiny_ckpt, max_num_seqs=4, max_model_len=256) as get:
        yield get


def run(coro):
    return asyncio.run(coro)


def reference_stop(tokenizer, ids: list[int], stops: list[str]) -> tuple[list[int], str, str]:
    """(tokens, text, finish) of `ids` cut one token at a time at the first stop string completed."""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n], skip_special_tokens=True).rstrip("\ufffd")
        hits = [i for s in stops if (i := text.find(s)) >= 0]
        if hits:
            return ids[:n], text[: min(hits)], "stop"
    return ids, tokenizer.decode(ids, skip_special_tokens=True), "length"


async def stream(engine, request_id, prompt, params):
    deltas = [d async for d in engine.generate(request_id, prompt, [], params)]
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), deltas[-1].finish_reason


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_stop_string_split_across_tokens_is_found(engines, k):
    """Item 1: "Ά" is two byte tokens; a round ending between them hid the stop for good."""
    engine = engines(k)
    free = run(stream(engine, f"free-{k}", [1], SamplingParams(max_tokens=48, ignore_eos=True)))[0]
    got = run(stream(engine, f"stop-{k}", [1], SamplingParams(max_tokens=48, ignore_eos=True, stop=["Ά"])))
    assert got == reference_stop(engine.tokenizer, free, ["Ά"])
    assert len(got[0]) == 4 and got[2] == "stop"  # as reported: 48 tokens and "length" before


def test_overlapping_stop_strings_do_not_depend_on_k(engines):
    """Item 2: the stop string completed first wins, whatever the round boundaries."""
    stops = ["Sq9", "q"]
    params = SamplingParams(max_tokens=48, ignore_eos=True, stop=stops)
    free = run(stream(engines(1), "free", [0], SamplingParams(max_tokens=48, ignore_eos=True)))[0]
    want = reference_stop(engines(1).tokenizer, free, stops)
    for k in (1, 2, 8):
        assert run(stream(engines(k), f"overlap-{k}", [0], params)) == want, f"K={k}"
    assert len(want[0]) == 28


def test_shutdown_fails_running_and_waiting_callers(tiny_ckpt):
    """Item 4: callers of an engine shut down under them get `EngineClosed`, not a hang."""
    engine = LLMEngine(tiny_ckpt, EngineConfig(max_num_seqs=1, max_model_len=256, num_scheduler_steps=2))
    long = SamplingParams(max_tokens=250, ignore_eos=True)

    async def scenario():
        running = asyncio.ensure_future(engine.generate_output("running", [1, 2, 3], [], long))
        waiting = asyncio.ensure_future(engine.generate_output("waiting", [4, 5], [], long))
        while engine.stats()["running"] == 0:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(engine.shutdown)
        return await asyncio.wait_for(asyncio.gather(running, waiting, return_exceptions=True), 30)

    results = run(scenario())
    assert all(isinstance(r, EngineClosed) for r in results), results
    with pytest.raises(EngineClosed):
        run(engine.generate_output("late", [1], [], long))


def test_stale_abort_does_not_kill_a_retry_with_the_same_id(tiny_ckpt, monkeypatch):
    """Item 5: leave a stream, retry at once under the same id: the retry must run to its end.

    The race is widened on purpose: a slow decode step lets the abort arrive while the request
    still runs, and a slow row release lets the retry arrive after the request ended but before
    the engine applied the abort (which then hit the retry, by id).
    """
    engine = LLMEngine(tiny_ckpt, EngineConfig(max_num_seqs=4, max_model_len=256, num_scheduler_steps=1))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    want = run(engine.generate_output("reference", [3, 4, 5], [], params)).token_ids
    decode, release = engine.runner.decode, engine._release_finished

    def slow(call):
        def wrapped(*args):
            time.sleep(0.03)
            return call(*args)
        return wrapped

    monkeypatch.setattr(engine.runner, "decode", slow(decode))
    monkeypatch.setattr(engine, "_release_finished", slow(release))

    async def leave_and_retry(i):
        async for _ in engine.generate(f"retry-{i}", [3, 4, 5], [], params):
            break  # leaving aborts this request
        while True:
            try:
                return await engine.generate_output(f"retry-{i}", [3, 4, 5], [], params)
            except InvalidInput as exc:  # the first one is still being aborted
                assert exc.code == "duplicate_request_id"
                await asyncio.sleep(0.002)

    try:
        outs = [run(leave_and_retry(i)) for i in range(10)]
    finally:
        engine.shutdown()
    assert [(o.finish_reason, o.token_ids) for o in outs] == [("length", want)] * 10


def test_tiny_temperature_samples_like_greedy(engines):
    """Item 6: T=1e-38 overflowed logits / T to NaN and always sampled token 0."""
    engine = engines(8)
    greedy = run(engine.generate_output("greedy", [9, 8, 7], [], SamplingParams(max_tokens=12, ignore_eos=True)))
    for temperature in (1e-38, 1e-20, 1e-6):
        params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=temperature, seed=3)
        out = run(engine.generate_output(f"tiny-{temperature}", [9, 8, 7], [], params))
        assert out.token_ids == greedy.token_ids


class CountingTokenizer:
    """Counts the ids the output processor asks to decode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoded = 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("stop", [None, ["\x00never"]])
def test_detokenization_is_incremental_and_equals_a_full_decode(engines, stop):
    """Item 7: text equals one decode of all ids, for any split into rounds, at a cost linear in tokens."""
    tokenizer = engines(1).tokenizer
    rng = random.Random(7)
    # Byte tokens (multi-byte characters split across tokens), words and special tokens.
    pool = list(range(0, 256)) + [rng.randrange(256, 5000) for _ in range(200)] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    ids = [rng.choice(pool) for _ in range(3000)]
    counting = CountingTokenizer(tokenizer)
    processor = OutputProcessor(counting, (), max_model_len=10 ** 6)
    seq = Sequence("r", [1], None, 0, None, SamplingParams(max_tokens=len(ids), ignore_eos=True, stop=stop),
                   lambda _: None)
    text, start = "", 0
    while start < len(ids):
        step = rng.choice([1, 1, 2, 3, 8])
        text += processor.append(seq, ids[start: start + step]).text
        start += step
    assert seq.finish_reason == "length"
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert counting.decoded < 40 * len(ids)  # a full decode per round would be ~len(ids)**2 / 6


def test_waiting_queue_is_bounded_with_a_retryable_error(engines):
    """Item 8: one request beyond max_num_seqs + max_num_waiting is refused with a CapacityError."""
    engine = engines(8, max_num_seqs=1, max_num_waiting=2)
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    async def scenario():
        accepted = [asyncio.ensure_future(engine.generate_output(f"q-{i}", [i + 1], [], params)) for i in range(3)]
        # All three submitted (each request enters the engine before its first real wait), none finished:
        # yield to the event loop, no wall time. A 0.05 s sleep let an idle machine finish the first
        # 40-token request before the refused call, and the queue had room again.
        for _ in range(10):
            await asyncio.sleep(0)
        with pytest.raises(CapacityError, match="retry later"):
            await engine.generate_output("q-refused", [9], [], params)
        outs = await asyncio.gather(*accepted)
        again = await engine.generate_output("q-after", [9], [], params)  # room again once they finish
        return outs, again

    outs, again = run(scenario())
    assert [len(o.token_ids) for o in outs] == [40, 40, 40] and len(again.token_ids) == 40
