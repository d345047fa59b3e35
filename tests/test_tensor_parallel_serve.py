"""Serve with a tensor-parallel Decoder (`engine.tensor_parallel_size: 2`, gloo on CPU): the official
openai client gets the same greedy answer as one device; killing one rank's process mid-stream ends that
stream with a retryable 503 error event, and the next request restarts the group whole and succeeds."""

from __future__ import annotations

import os
import signal

import openai
import pytest

from tests.test_serve_api import free_port

MAX_MODEL_LEN = 1024
ENGINE = {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4, "num_threads": 1}


@pytest.fixture(scope="module")
def server(ray_local, tiny_ckpt):
    from ray import serve

    from raypipe.serve.app import build_app
    from raypipe.serve.proxy_errors import CONTROLLER_OPTIONS

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, controller_options=CONTROLLER_OPTIONS)
    serve.run(build_app({"num_encoders": 1, "engine": {**ENGINE, "tensor_parallel_size": 2}}),
              name="raypipe-tp", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


def decoder():
    from ray import serve

    return serve.get_deployment_handle("Decoder", app_name="raypipe-tp")


def chat(client, text: str, **fields):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                          temperature=0, **fields)


def test_group_answers_like_one_device(client, tiny_ckpt):
    import asyncio

    from raypipe import SamplingParams
    from raypipe.decode.config import EngineConfig
    from raypipe.decode.engine import LLMEngine
    from raypipe.models.prompt import build_prompt
    from raypipe.models.registry import vision_adapter

    ranks = decoder().group_info.remote().result()
    assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2
    answer = chat(client, "Say something.", max_tokens=12)
    one = LLMEngine(tiny_ckpt, EngineConfig(**ENGINE))
    try:
        prompt = build_prompt([{"role": "user", "content": "Say something."}], one.tokenizer, vision_adapter(tiny_ckpt))
        want = asyncio.run(one.generate_output("one", prompt, [], SamplingParams(max_tokens=12)))
    finally:
        one.shutdown()
    assert answer.choices[0].message.content == want.text and answer.usage.completion_tokens == len(want.token_ids)


def test_killed_rank_fails_the_stream_retryably_and_the_group_restarts(client):
    [_, rank1] = decoder().group_info.remote().result()
    stream = chat(client, "Talk for a long time.", max_tokens=MAX_MODEL_LEN - 200, stream=True,
                  extra_body={"ignore_eos": True})
    chunks = 0
    with pytest.raises(openai.APIError) as failure:
        for _ in stream:
            chunks += 1
            if chunks == 3:
                os.kill(rank1["pid"], signal.SIGKILL)
    assert chunks >= 3
    assert failure.value.body["code"] == "overloaded", failure.value.body  # a 503: retry
    answer = chat(client, "Say something.", max_tokens=8)  # restarts the group first
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content
    ranks = decoder().group_info.remote().result()
    assert rank1["pid"] not in {r["pid"] for r in ranks} and len(ranks) == 2
    assert decoder().stats.remote().result()["group_restarts"] == 1


def test_serve_flag_sets_the_engine_and_the_replica_takes_one_bundle_per_rank():
    from raypipe.cli import build_parser
    from raypipe.parallel.group import placement_options
    from raypipe.serve.run import serve_config

    config = serve_config(build_parser().parse_args(["serve", "--tensor-parallel-size", "4"]))
    engine = config["applications"][0]["args"]["engine"]
    assert engine["tensor_parallel_size"] == 4 and engine["num_scheduler_steps"] == 8  # the file's others stay
    assert placement_options(4, 1) == {"placement_group_bundles": [{"GPU": 1}] * 4,
                                       "placement_group_strategy": "STRICT_PACK"}
    assert placement_options(1, 1) == {}
