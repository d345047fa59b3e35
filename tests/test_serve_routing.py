"""Prefix-affinity routing on a real local Serve: two Decoder replicas keep each conversation's cache useful.

One Serve application for the module (tiny preset, one Ingress, one EncoderGroup with one worker, two
Decoder replicas, routing on with an explicit overload threshold of 8 and match ratio of 0.5) and, as the one-replica
reference, an `LLMEngine` in the test's process fed by the app's own encoder (one engine: every
prefix it computed is in its cache).

8 conversations x 5 turns, interleaved: every round sends the 8 conversations' next turns at once.
Each turn's prompt extends the previous turn's prompt, so a turn that lands where the previous one
ran takes at least every full block of that prompt from the cache; on the other replica it would
only find the chat template's head. A first turn shares only that head with the others (3 of its 5 keyed
blocks: over the match ratio, but it branches off another prompt there, which is no affinity), so new
conversations are spread by queue length; a later turn continues its previous prompt, over half of it.
With 8 requests in flight over 2 replicas no queue can exceed another by more than 7, below the
threshold, so the overload fallback cannot apply here: every turn >= 2 must land on its conversation's
replica.

The spread of first turns: the router counts each request it chose until Serve sends it, and Serve counts it
from then on, so first turns arriving together alternate over the shorter queue; a turn that finds both queues
empty (the one before it finished) goes to the replica the router sent fewer blocks. Each replica takes
between 2 and 6 of the 8 conversations (`MIN_CONVERSATIONS`), whole. Before the branch rule, every first
turn could follow the first one's replica: 40 of 40 requests on one; before the router counted its unsent
choices, first turns routed together all saw the same queue lengths and 7 of 8 conversations once went to one.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest

from raypipe.decode.config import EngineConfig
from tests.test_serve_api import image_url, user

CONVERSATIONS, TURNS, MAX_TOKENS = 8, 5, 4
ENGINE = {"max_model_len": 1024, "max_num_seqs": 8}
BLOCK = EngineConfig().block_size
ROUTING = {"min_match_ratio": 0.5, "overload_threshold": 8}  # explicit: the test's reasoning rests on them
MIN_CONVERSATIONS = 2  # per replica, of CONVERSATIONS (see the module's docstring)


@pytest.fixture(scope="module")
def server(serve_app, tiny_ckpt):
    from raypipe.serve.app import compose, deployment_options
    from raypipe.serve.kuberay import SERVE_CONFIG, load_serve_config

    options = deployment_options(load_serve_config(SERVE_CONFIG))
    for name, replicas in (("Ingress", 1), ("EncoderGroup", 1), ("Decoder", 2)):
        options[name] = {**{k: v for k, v in options[name].items() if k != "autoscaling_config"},
                         "num_replicas": replicas}
    return serve_app(compose({"num_encoders": 1, "engine": ENGINE, "routing": ROUTING}, options), "raypipe-routing")


@pytest.fixture(scope="module")
def one_replica(server, tiny_ckpt):
    from raypipe.decode.engine import LLMEngine

    engine = LLMEngine(tiny_ckpt, EngineConfig(**ENGINE))
    yield engine
    engine.shutdown()


def reference_round(engine, conversations: list[list[dict]], turn: int) -> list:
    """One replica's outputs for every conversation's next turn at once (images through the app's encoder)."""
    from ray import serve

    from raypipe import SamplingParams
    from raypipe.models.prompt import build_prompt
    from raypipe.models.registry import vision_adapter

    vision = vision_adapter(engine.adapter.checkpoint)
    prompts = [build_prompt(messages, engine.tokenizer, vision) for messages in conversations]
    encoder = serve.get_deployment_handle("EncoderGroup", app_name="raypipe-routing")
    embeds = [encoder.encode.remote(prompt.visuals, None).result() for prompt in prompts]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)

    async def run():
        return await asyncio.gather(*(engine.generate_output(f"ref-{turn}-{c}", prompt.without_pixels(), rows, params)
                                      for c, (prompt, rows) in enumerate(zip(prompts, embeds))))

    return asyncio.run(run())


def per_replica(text: str, name: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf'^{name}{{replica="([^"]+)"}} ([0-9.e+-]+)$', text, re.M)}


async def one_round(server: str, conversations: list[list[dict]]) -> list:
    """Every conversation's next turn at once."""
    async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120) as client:
        return await asyncio.gather(*(client.chat.completions.create(model="tiny", messages=messages,
                                                                     temperature=0, max_tokens=MAX_TOKENS)
                                      for messages in conversations))


def test_turns_stay_on_their_replica_with_one_replicas_outputs_and_hit_rate(server, one_replica):
    conversations = [user(f"Conversation {c}: what is in", image_url(56, 56 + 28 * (c % 3), seed=100 + c), "?")
                     for c in range(CONVERSATIONS)]
    served, reference = [], []  # per round, per conversation
    for turn in range(TURNS):
        responses = asyncio.run(one_round(server, conversations))
        outputs = reference_round(one_replica, conversations, turn)
        served.append([(r.choices[0].message.content, r.usage.prompt_tokens,
                        r.usage.prompt_tokens_details.cached_tokens) for r in responses])
        reference.append([(o.text, len(o.prompt_token_ids), o.num_cached_tokens) for o in outputs])
        conversations = [[*messages, {"role": "assistant", "content": r.choices[0].message.content},
                          {"role": "user", "content": f"Turn {turn + 2}: tell me more."}]
                         for messages, r in zip(conversations, responses)]

    # Greedy outputs and prompts are those of one replica.
    assert [[(text, n) for text, n, _ in row] for row in served] == \
        [[(text, n) for text, n, _ in row] for row in reference]
    # Every turn >= 2 took at least the previous turn's full prompt blocks from the cache: it ran where that did.
    for turn in range(1, TURNS):
        for c in range(CONVERSATIONS):
            previous = served[turn - 1][c][1]
            assert served[turn][c][2] >= (previous - 1) // BLOCK * BLOCK, (turn, c, served[turn][c])
    hit_rate = sum(r[2] for row in served for r in row) / sum(r[1] for row in served for r in row)
    one_replica = sum(r[2] for row in reference for r in row) / sum(r[1] for row in reference for r in row)
    assert one_replica > 0.5 and abs(hit_rate - one_replica) <= 0.1 * one_replica, (hit_rate, one_replica)

    # /metrics: requests and prefix-cache tokens per Decoder replica, both replicas used.
    text = httpx.get(f"{server}/metrics", timeout=30).text
    requests = per_replica(text, "raypipe_decoder_requests_total")
    hits = per_replica(text, "raypipe_decoder_prefix_cache_hits_total")
    queries = per_replica(text, "raypipe_decoder_prefix_cache_queries_total")
    assert sum(requests.values()) == CONVERSATIONS * TURNS
    assert all(count % TURNS == 0 for count in requests.values()), requests  # whole conversations per replica
    assert len(requests) == 2 and min(requests.values()) >= MIN_CONVERSATIONS * TURNS, requests
    assert sum(hits.values()) == sum(r[2] for row in served for r in row)
    assert sum(queries.values()) == sum(r[1] for row in served for r in row)


def test_an_adapters_new_conversations_go_to_the_replica_it_was_sent_to(server, tiny_ckpt, tmp_path):
    """Issue 46 item 5 (Serve's model multiplexing rule): an adapter loaded while the app runs is read by the
    replica its first request lands on; its later requests, sharing no prefix with anything, go there too instead
    of by queue length (which spread the 8 first turns above over both replicas) and a second read."""
    from raypipe.testing.lora_adapters import write_adapters
    from tests.test_lora import ADAPTERS

    [adapter] = write_adapters(tiny_ckpt, tmp_path, {"red": ADAPTERS["red"]}).values()
    admin = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    admin.post("/load_lora_adapter", body={"lora_name": "red", "lora_path": str(adapter)}, cast_to=httpx.Response)

    def requests() -> dict[str, float]:
        return per_replica(httpx.get(f"{server}/metrics", timeout=30).text, "raypipe_decoder_requests_total")

    async def under_red(prompts: list[str]):
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120) as client:
            await asyncio.gather(*(client.chat.completions.create(model="red", messages=user(p), temperature=0,
                                                                  max_tokens=MAX_TOKENS) for p in prompts))

    before = requests()
    asyncio.run(under_red(["Say something about red."]))
    first = requests()
    [holder] = [r for r in first if first[r] != before.get(r, 0)]
    asyncio.run(under_red([f"Topic {c}: {'why ' * c}is the sky blue?" for c in range(CONVERSATIONS)]))
    after = requests()
    assert {r: after[r] - first.get(r, 0) for r in after} == {r: CONVERSATIONS if r == holder else 0 for r in after}


def test_streams_on_a_killed_decoder_replica_finish_on_the_other_with_one_replicas_tokens(server, one_replica):
    """Issue 43 item 7. Last in the module: it SIGKILLs one of the two Decoder replicas while 10 greedy streams run
    (Serve restarts it). Every stream finishes whole; its tokens (as `token_id:<id>` logprob entries) and text are
    the one-replica engine's, and /metrics counts the resumes. Before the resume, the streams on the killed replica
    ended in a 503 `replica_unavailable` error event."""
    import os
    import signal

    from ray import serve

    from raypipe import SamplingParams
    from raypipe.models.prompt import build_prompt
    from raypipe.models.registry import vision_adapter

    streams, tokens = 10, 160
    conversations = [user(f"Stream {s}: count slowly, then tell a story about number {s * 7}.") for s in range(streams)]
    decoder = serve.get_deployment_handle("Decoder", app_name="raypipe-routing")
    pids = {decoder.pid.remote().result() for _ in range(20)}
    assert len(pids) == 2, pids
    victim = min(pids)

    async def run():
        started = asyncio.Event()
        seen = [0] * streams

        async def one(client, s: int):
            ids, text, finish = [], "", None
            stream = await client.chat.completions.create(
                model="tiny", messages=conversations[s], temperature=0, max_tokens=tokens, stream=True, logprobs=True,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
            async for chunk in stream:
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    ids += [int(e.token.removeprefix("token_id:")) for e in (choice.logprobs.content or [])] \
                        if choice.logprobs else []
                    finish = choice.finish_reason or finish
                seen[s] = len(ids)
                if min(seen) >= 8:
                    started.set()
            return ids, text, finish

        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=300) as client:
            runs = [asyncio.ensure_future(one(client, s)) for s in range(streams)]
            await asyncio.wait_for(started.wait(), 120)
            assert max(seen) < tokens, "the streams must still run when the replica dies"
            os.kill(victim, signal.SIGKILL)
            return await asyncio.gather(*runs)

    served = asyncio.run(run())
    vision = vision_adapter(one_replica.adapter.checkpoint)
    prompts = [build_prompt(messages, one_replica.tokenizer, vision) for messages in conversations]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    async def reference():
        return await asyncio.gather(*(one_replica.generate_output(f"kill-ref-{s}", prompt.without_pixels(), [], params)
                                      for s, prompt in enumerate(prompts)))

    for (ids, text, finish), expected in zip(served, asyncio.run(reference())):
        assert finish == "length" and ids == expected.token_ids and text == expected.text
    metrics = httpx.get(f"{server}/metrics", timeout=30).text
    resumed = float(re.search(r"^raypipe_resumed_choices_total ([0-9.e+]+)$", metrics, re.M).group(1))
    assert 1 <= resumed <= streams, resumed
