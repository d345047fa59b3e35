"""Prefix caching and chunked prefill for models with per-row state: MiniCPM-V 4.6 (gated delta-net +
full attention) and Step3 (sliding window + full attention, MoE). Greedy equals transformers'
`generate()` token for token, K=1 and K=8, in every way a prompt meets the cache:

- the next turn of an image chat (the image re-sent) continues from where the first turn stopped;
- a system prompt shared across requests: the second request leaves the first one's cached path
  and keeps a state at that branch point, which the third request hits exactly; when all three are
  sent together, the later ones wait for the first's blocks, and the first keeps that state for them;
- that branch point inside an image (the texts after the image differ): the hit ends inside the
  image, and the prefill restarts mid-image from the snapshot;
- a prompt shorter than 64 tokens sent again hits the state the first left at its last block boundary;
- a prompt three times the round budget is prefilled over rounds (state carried across chunks)
  while another request decodes;
- preemption under a tiny pool is in each family's own test file (`test_*_decode.py`).

Each test's prompts share nothing with another test's (their own images and texts), so the hit
each one asserts comes from its own requests.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from raypipe import SamplingParams
from raypipe.models.prompt import build_prompt, token_runs
from raypipe.models.registry import vision_adapter
from tests import decode_reference as decode_ref
from tests import minicpmv_reference
from tests import step3_reference
from tests.conftest import random_images

MAX_NEW = 10


@dataclasses.dataclass
class Family:
    ckpt: object
    engines: object  # decode_reference.engine_pool's get
    hf: object
    generate_fn: object
    features_fn: object
    memo: dict = dataclasses.field(default_factory=dict)

    @property
    def block(self) -> int:
        return self.engines(1).config.block_size

    def prompt(self, turns: list[tuple[str, list]], system: str | None = None):
        """Chat prompt from `(role, parts)` turns; parts are text strings and images."""
        messages = [{"role": "system", "content": system}] if system else []
        for role, parts in turns:
            content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p}
                       for p in parts]
            messages.append({"role": role, "content": content})
        prompt = build_prompt(messages, self.engines(1).tokenizer, vision_adapter(self.ckpt))
        embeds = self.features_fn(self.hf, self.ckpt, [v.pixels for v in prompt.visuals]) if prompt.visuals else []
        return prompt, embeds

    def want(self, prompt, embeds, n: int = MAX_NEW) -> list[int]:
        key = (tuple(prompt.prompt_token_ids), n)
        if key not in self.memo:
            self.memo[key] = self.generate_fn(self.hf, prompt.prompt_token_ids, embeds, n)
        return self.memo[key]


@pytest.fixture(scope="module", params=["minicpmv", "step3"])
def family(request, minicpmv_ckpt, step3_ckpt):
    if request.param == "minicpmv":
        from transformers import MiniCPMV4_6ForConditionalGeneration

        ckpt, hf = minicpmv_ckpt, MiniCPMV4_6ForConditionalGeneration.from_pretrained(minicpmv_ckpt).eval()
        generate_fn, features_fn = minicpmv_reference.hf_generate, minicpmv_reference.image_embeddings
    else:
        from transformers import Step3p7ForConditionalGeneration

        ckpt, hf = step3_ckpt, Step3p7ForConditionalGeneration.from_pretrained(step3_ckpt).eval()
        generate_fn, features_fn = step3_reference.generate, step3_reference.image_features
    with decode_ref.engine_pool(ckpt, max_num_seqs=4, max_model_len=1024) as get:
        yield Family(ckpt, get, hf, generate_fn, features_fn)


def generate(engine, tag: str, prompt, embeds, n: int = MAX_NEW):
    return asyncio.run(engine.generate_output(tag, prompt, embeds, SamplingParams(max_tokens=n, ignore_eos=True)))


def common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("k", [1, 8])
def test_next_turn_of_an_image_chat_continues_where_the_first_stopped(family, k):
    engine, image = family.engines(k), random_images([(300, 420)], seed=100 + k)[0]
    first = [("user", [image, f"What is in this picture? ({k})"])]
    prompt, embeds = family.prompt(first)
    out = generate(engine, f"turn1-{k}", prompt, embeds)
    assert out.token_ids == family.want(prompt, embeds) and out.num_cached_tokens == 0
    second, embeds2 = family.prompt(first + [("assistant", [out.text]), ("user", ["And the colours?"])])
    out2 = generate(engine, f"turn2-{k}", second, embeds2)
    assert out2.token_ids == family.want(second, embeds2)
    # At least the first turn's last block boundary: its prompt's, or the one its decode crossed last.
    shared = common(prompt.prompt_token_ids, second.prompt_token_ids)
    assert out2.num_cached_tokens % family.block == 0
    assert len(prompt.prompt_token_ids) // family.block * family.block <= out2.num_cached_tokens <= shared


@pytest.mark.parametrize("k", [1, 8])
def test_shared_system_prompt_hits_at_the_branch_point(family, k):
    engine = family.engines(k)
    system = f"You are a careful assistant for test {k}. Answer briefly, in plain words, and never guess."
    cases = [family.prompt([("user", [question])], system=system) for question in ("Hi!", "Why?", "Count.")]
    outs = [generate(engine, f"system-{k}-{i}", *case) for i, case in enumerate(cases)]
    assert [out.token_ids for out in outs] == [family.want(*case) for case in cases]
    ids = [case[0].prompt_token_ids for case in cases]
    branch = common(ids[0], ids[1]) // family.block * family.block
    assert common(ids[1], ids[2]) // family.block * family.block == branch > 0
    assert outs[0].num_cached_tokens == 0
    assert outs[2].num_cached_tokens == branch  # the state the second request kept where it left the path


@pytest.mark.parametrize("k", [1, 8])
def test_requests_sharing_a_prompt_sent_together_compute_it_once(family, k):
    # Sent at once: the later ones wait for the first's blocks instead of computing the shared prompt
    # too, and (row state) the first keeps a state where their prompts leave its own, so both hit the
    # whole shared prefix (test_decode_scheduler.py pins the waiting itself; test_prompt_burst.py a
    # burst of twelve).
    engine = family.engines(k)
    system = f"Together {k}: you are the museum's guide; answer in one sentence and name the room. " * 2
    cases = [family.prompt([("user", [question])], system=system) for question in ("Where?", "When?", "Who?")]

    async def together():
        return await asyncio.gather(*(engine.generate_output(f"together-{k}-{i}", *case,
                                                             SamplingParams(max_tokens=MAX_NEW))
                                      for i, case in enumerate(cases)))

    outs = asyncio.run(together())
    assert [out.token_ids for out in outs] == [family.want(*case) for case in cases]
    ids = [case[0].prompt_token_ids for case in cases]
    branch = common(ids[0], ids[1]) // family.block * family.block
    assert [out.num_cached_tokens for out in outs] == [0, branch, branch] and branch > 0


@pytest.mark.parametrize("k", [1, 8])
def test_hit_ending_inside_an_image(family, k):
    engine, image = family.engines(k), random_images([(380, 250)], seed=200 + k)[0]
    cases = [family.prompt([("user", [image, text])]) for text in ("A? (%d)" % k, "B? (%d)" % k, "C? (%d)" % k)]
    outs = [generate(engine, f"inside-{k}-{i}", *case) for i, case in enumerate(cases)]
    assert [out.token_ids for out in outs] == [family.want(*case) for case in cases]
    ids = cases[2][0].prompt_token_ids
    placeholders = engine.adapter.placeholder_token_ids.values()
    first_image_token, last_run = token_runs(ids, placeholders)[0][0], token_runs(ids, placeholders)[-1]
    hit = outs[2].num_cached_tokens
    assert hit == common(cases[0][0].prompt_token_ids, cases[1][0].prompt_token_ids) // family.block * family.block
    assert first_image_token < hit < last_run[0] + last_run[1]  # inside the image's placeholder runs


@pytest.mark.parametrize("k", [1, 8])
def test_prompt_shorter_than_64_tokens_hits(family, k):
    # The same short question again (a retry): it hits the state the first left at its last block boundary.
    engine = family.engines(k)
    prompt, _ = family.prompt([("user", [f"Prompt {k}: three rivers of Europe?"])])
    assert 2 * family.block < len(prompt.prompt_token_ids) < 64
    outs = [generate(engine, f"short-{k}-{i}", prompt, []) for i in range(2)]
    assert [out.token_ids for out in outs] == [family.want(prompt, [])] * 2
    assert outs[1].num_cached_tokens == (len(prompt.prompt_token_ids) - 1) // family.block * family.block


@pytest.mark.parametrize("k", [1, 8])
def test_chunked_prefill_of_a_prompt_three_times_the_round_budget(family, k):
    images = random_images([(300, 500), (420, 200)], seed=300 + k)
    long, long_embeds = family.prompt([("user", [*images, f"Describe both pictures in detail ({k})."])])
    short, _ = family.prompt([("user", [f"Tell me a long story ({k})."])])
    engine = family.engines(k, max_num_batched_tokens=len(long.prompt_token_ids) // 3)
    seen: list[str] = []

    async def both():
        async def tokens(tag, prompt, embeds, n):
            ids = []
            async for delta in engine.generate(tag, prompt, embeds, SamplingParams(max_tokens=n, ignore_eos=True)):
                seen.append(tag)
                ids += delta.token_ids
            return ids

        first = asyncio.ensure_future(tokens("short", short, [], 40))
        while engine.stats()["running"] == 0:
            await asyncio.sleep(0.001)
        return await asyncio.gather(first, tokens("long", long, long_embeds, MAX_NEW))

    before = engine.stats()
    got_short, got_long = asyncio.run(both())
    assert got_long == family.want(long, long_embeds) and got_short == family.want(short, [], 40)
    after = engine.stats()
    assert after["chunked_prefills"] - before["chunked_prefills"] >= 1
    assert after["prefill_tokens"] - before["prefill_tokens"] >= len(long.prompt_token_ids)
    assert seen[: seen.index("long")].count("short") >= 3  # the short one decoded while the long one's chunks ran
