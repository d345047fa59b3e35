"""bf16 on the CPU (`EngineConfig.dtype="bfloat16"`): the exactness statement the docs make.

fp32 stays the CPU default and the dtype every other equality test runs in. In bf16 the engine's greedy
tokens equal transformers' own bf16 `generate()` (one request at a time, embeddings from transformers'
bf16 vision tower) for a batch that joins staggered and decodes K=8 steps a round, on a full-attention
family (Qwen2.5-VL) and on the hybrid one (Qwen3.5: gated delta-net rows + paged full attention), up to
ties at bf16's precision: where oneDNN has no native bf16 GEMM the engine computes bf16 linears in fp32
(`models/packed_linear.py`), rounding once as a bf16 GEMM does but after another summation order, so a
request may leave transformers' tokens at a step whose two best logits are one bf16 ulp apart in
transformers' own logits (and is not compared after it: vLLM's tests compare so too). At most one request of
a family's four may.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText

from raypipe import SamplingParams
from raypipe.models.registry import language_adapter, preset_checkpoint, vision_adapter
from tests import decode_reference as ref

MAX_NEW = 12
CASES = range(4)  # text only, one image, three images, a short prompt with an image


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3.5"])
def test_bf16_greedy_equals_transformers_bf16_generate(preset):
    ckpt = preset_checkpoint(preset)
    hf = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    tokenizer, vision = language_adapter(ckpt).tokenizer, vision_adapter(ckpt)
    prompts = [ref.prepare(i, tokenizer, vision) for i in CASES]
    embeds = [ref.embeddings(hf, ckpt, p) for p in prompts]
    eos = hf.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    expected = [ref.hf_generate_scored(hf, p, e, MAX_NEW, cut_at=eos) for p, e in zip(prompts, embeds)]
    with ref.engine_pool(ckpt, dtype="bfloat16", max_num_seqs=4, max_model_len=512) as engines:
        engine = engines(8)
        assert engine.runner.dtype == torch.bfloat16
        outs = ref.staggered(engine, [(p.without_pixels(), e) for p, e in zip(prompts, embeds)],
                             [SamplingParams(max_tokens=MAX_NEW)] * len(prompts), tag=f"bf16-{preset}")
    left = [ref.assert_greedy_equal_up_to_ties(o.token_ids, tokens, logits, torch.bfloat16)
            for o, (tokens, logits) in zip(outs, expected)]
    assert left.count(True) <= 1, f"{left.count(True)} of {len(left)} requests left transformers' tokens at a tie"
