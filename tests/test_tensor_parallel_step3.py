"""A decode group for Step3 (sliding-window + full attention, MoE with a shared expert), two ranks over gloo,
sharded by raypipe's own rule (raypipe/parallel/step3_shards.py): attention heads of both layer kinds split,
routed experts split whole across ranks, the shared expert and the dense MLP column/row split. Greedy tokens
equal one device's and transformers' generate(), K=1 and K=8, with images, requests joining a running batch,
preemption under a small pool and chunked prefill; top-5 log-probabilities match one device's; each rank
holds half of the decoder layers and read only that half of them from the checkpoint, as its own process
reports. Both expert splits (whole experts, or every expert's width) equal one device's forward."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
import torch
from safetensors import safe_open

from raypipe import SamplingParams
from raypipe.decode.config import EXPERT_SPLITS, EngineConfig
from raypipe.models.checkpoint import safetensors_files
from raypipe.models.prompt import build_prompt
from raypipe.models.registry import language_adapter, preset_checkpoint, vision_adapter
from raypipe.models.step3.loading import load_step3_model
from raypipe.parallel.collectives import Collectives, open_store
from raypipe.parallel.rank_runner import weight_shard
from raypipe.parallel.shards import sharded_parameter_bytes
from raypipe.parallel.step3_shards import Step3Shard
from tests import decode_reference
from tests import step3_reference as ref
from tests.conftest import random_images
from tests.test_tensor_parallel import assert_same_top_logprobs, on_both, one_device_and_group

REST = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")  # read whole by every rank
DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2}
MAX_NEW = 12
BLOCK = 8
CHUNK = 48  # max_num_batched_tokens: longer prompts are prefilled in chunks
REQUESTS = [("Say something.", []), ("What is in this picture?", [(300, 200)]),
            ("Compare these three, please:", [(120, 100), (60, 500), (224, 224)]), ("hi", [(400, 700)]),
            ("A longer text-only prompt, longer than the sliding window of the tiny preset.", []), ("x", [])]


@pytest.fixture(scope="module")
def cases(step3_ckpt, step3_hf_model):
    """(prompt, transformers' image features, transformers' greedy tokens) per request."""
    tokenizer, vision = language_adapter(step3_ckpt).tokenizer, vision_adapter(step3_ckpt)
    out = []
    for i, (text, sizes) in enumerate(REQUESTS):
        prompt = build_prompt(decode_reference.messages(text, random_images(sizes, seed=i)), tokenizer, vision)
        features = ref.image_features(step3_hf_model, step3_ckpt, [image.pixels for image in prompt.visuals])
        out.append((prompt, features, ref.generate(step3_hf_model, prompt.prompt_token_ids, features, MAX_NEW)))
    assert len({tuple(want) for _, _, want in out}) > 1
    assert max(len(p.prompt_token_ids) for p, _, _ in out) > CHUNK
    return out


@pytest.fixture(scope="module")
def engines(step3_ckpt, cases, ray_local):
    """One device and a group of two with the same number of blocks: about two of the longest requests' worth,
    so a batch of all of them preempts. Each budget buys those full-attention blocks and their window-pool
    share; a group's ranks hold half the heads each, so half the bytes."""
    made = one_device_and_group(step3_ckpt, cases, block=BLOCK, max_new=MAX_NEW, max_num_batched_tokens=CHUNK)
    yield made
    for engine in made:
        engine.shutdown()


@pytest.mark.parametrize("k", [1, 8])
def test_group_greedy_equals_one_device_and_generate(engines, cases, k):
    single, group = engines
    assert single.runner.cache.num_blocks == group.runner.cache.num_blocks
    before = group.stats()
    one, two = on_both(engines, k, cases, [SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)] * len(cases), "step3")
    assert two == one == [w for _, _, w in cases]
    after = group.stats()
    assert after["preemptions"] > 0 and after["failed_rounds"] == 0  # the K=1 run preempts (K=8 frees rows sooner)
    assert after["chunked_prefills"] > before["chunked_prefills"]


def test_group_repeats_a_prompt_with_a_prefix_hit(engines, cases):
    """The three-image prompt twice on the group: generate()'s tokens both times, the repeat through a
    prefix hit (full-attention blocks and the window pool's blocks before the hit, on every rank)."""
    group = engines[1]
    prompt, features, want = cases[2]
    hits = []
    for i in range(2):
        before = group.stats()["prefix_cache_hit_tokens"]
        out = asyncio.run(group.generate_output(f"again-{i}", prompt, features,
                                                SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)))
        assert out.token_ids == want
        hits.append(group.stats()["prefix_cache_hit_tokens"] - before)
    assert group.stats()["prefix_caching"] and not group.runner.cache.row_state_kinds
    assert hits[1] > 0


def test_group_logprobs_match_one_device(engines, cases):
    """Log-softmax of the logits, top 5 per step: fp32, atol 1e-5 / rtol 1e-4 (the all-reduces sum the ranks'
    partial products in another order than one device's GEMMs do)."""
    prompt, features, _ = cases[1]
    assert_same_top_logprobs(engines, prompt, features, SamplingParams(max_tokens=MAX_NEW, logprobs=5, ignore_eos=True))


def checkpoint_bytes(ckpt) -> dict[str, int]:
    """Bytes of the language tensors in the checkpoint's files (from their headers): decoder-layer parameters,
    the routers' bias (a buffer of the module: every rank reads it whole), the rest (read whole by every rank)."""
    out = {"layers": 0, "router_bias": 0, "rest": 0}
    for path in safetensors_files(ckpt):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.startswith("model.layers.") or key in REST:
                    part = f.get_slice(key)
                    size = math.prod(part.get_shape()) * DTYPE_BYTES[part.get_dtype()]
                    kind = "rest" if key in REST else "router_bias" if key.endswith(".moe.router_bias") else "layers"
                    out[kind] += size
    return out


def test_each_rank_holds_and_reads_half_of_the_decoder_layers(engines, step3_ckpt):
    """Measured in each rank's process: its decoder-layer parameters are half of one device's (norms, routers and
    the q/k norms whole on both), and the bytes it read from the checkpoint are exactly those plus the embeddings,
    final norm and lm_head: no rank reads the other rank's slices, the vision tower or the whole model."""
    single, group = engines
    whole = sharded_parameter_bytes(single.runner.model)["decoder_layers"]
    ranks = group.runner.info()
    assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2
    layers = [r["parameter_bytes"]["decoder_layers"] for r in ranks]
    assert layers[0] == layers[1] and 0.5 < layers[0] / whole < 0.52
    on_disk = checkpoint_bytes(step3_ckpt)
    assert on_disk["layers"] == whole  # fp32 preset, fp32 engine: the checkpoint's layers are one device's
    for rank in ranks:
        assert rank["checkpoint_bytes_read"] == (rank["parameter_bytes"]["decoder_layers"] + on_disk["router_bias"]
                                                 + on_disk["rest"])


@pytest.mark.parametrize("split", EXPERT_SPLITS)
def test_both_expert_splits_equal_one_device_forward(step3_ckpt, split):
    """Two ranks as two threads over gloo (no engine): the sharded text model's hidden states for a batch of
    60 positions (past the 16-token window) equal the one-device model's, fp32 atol 1e-5 / rtol 1e-4."""
    adapter = language_adapter(step3_ckpt)
    whole = load_step3_model(step3_ckpt, torch.float32).model.language_model
    inputs = torch.randn(2, 60, adapter.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(60)[None].expand(2, -1)
    with torch.no_grad():
        want = whole(inputs_embeds=inputs, position_ids=positions, use_cache=False).last_hidden_state
    # Loaded one after the other here, not in the threads: transformers' `no_init_weights` patches torch's init
    # functions process-wide, and two overlapping uses leave them patched for the rest of the session.
    collectives = [Collectives(r, 2, torch.device("cpu")) for r in (0, 1)]
    models = [adapter.load_model(torch.device("cpu"), torch.float32,
                                 shard=Step3Shard(adapter.text_config, r, 2, collectives[r], split)) for r in (0, 1)]
    store, host, port = open_store()
    got, errors = {}, []

    def rank(r: int):
        try:
            collectives[r].connect(store if r == 0 else None, host, port, f"step3-{split}")
            with torch.no_grad():
                got[r] = models[r].model(inputs_embeds=inputs, position_ids=positions,
                                         use_cache=False).last_hidden_state
        except BaseException as exc:  # surfaced below: a thread's exception would not fail the test
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for r in (0, 1):
        torch.testing.assert_close(got[r], want, atol=1e-5, rtol=1e-4)


def test_tensor_parallel_experts_are_refused_where_they_are_not_built():
    with pytest.raises(ValueError, match="expert_split"):
        EngineConfig(expert_split="rows")
    moe = language_adapter(preset_checkpoint("tiny-qwen3-vl-moe")).text_config
    with pytest.raises(ValueError, match="built for Step3 only"):
        weight_shard(moe, 0, 2, None, "tensor")
