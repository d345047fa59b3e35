"""State snapshots from inside one prefill forward (models/delta_rule.py, models/delta_net_prefill.py).

The chunked delta rule is checked against transformers' token-by-token rule (the oracle: the state
after every token, so also at any boundary). Then the tiny MiniCPM-V 4.6 language model runs one
prefill forward with captures at three positions, two rows at once (one continuing from an earlier
chunk), against forwards split at those positions with the row state copied out between (what the
engine did before): every gated-delta-net layer's captured conv and recurrent state, the rows' final
state and the hidden states must agree (fp32, atol 1e-5).
"""

from __future__ import annotations

import pytest
import torch

from raypipe.models.delta_rule import chunked_gated_delta_rule

BLOCK = 16


def test_chunked_rule_matches_token_by_token_rule_and_its_states_at_boundaries():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    batch, length, k_heads, v_heads, k_dim, v_dim = 2, 150, 2, 4, 16, 8
    q, k = (torch.randn(batch, length, k_heads, k_dim, generator=gen) for _ in range(2))
    v = torch.randn(batch, length, v_heads, v_dim, generator=gen)
    g = -torch.rand(batch, length, v_heads, generator=gen)
    beta = torch.rand(batch, length, v_heads, generator=gen)
    initial = torch.randn(batch, v_heads, k_dim, v_dim, generator=gen)
    boundaries = [16, 80, 96]  # inside a chunk of 64, on one's edge, and one right after
    out, final, states = chunked_gated_delta_rule(q, k, v, g, beta, initial, boundaries=boundaries)
    want, want_final = torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=initial,
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(final, want_final, atol=1e-5, rtol=1e-4)
    for point, state in zip(boundaries, states, strict=True):
        _, at_point = torch_recurrent_gated_delta_rule(q[:, :point], k[:, :point], v[:, :point], g=g[:, :point],
                                                       beta=beta[:, :point], initial_state=initial,
                                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(state, at_point, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="boundaries"):
        chunked_gated_delta_rule(q, k, v, g, beta, boundaries=[80, 16])


@pytest.fixture(scope="module")
def hybrid(minicpmv_ckpt):
    from raypipe.decode.kv_cache import KVCache
    from raypipe.models.registry import language_adapter

    adapter = language_adapter(minicpmv_ckpt)
    model = adapter.load_model(torch.device("cpu"), torch.float32)

    def new_cache():
        cache = KVCache(adapter.text_config, max_num_seqs=2, max_model_len=256, num_blocks=20, block_size=BLOCK,
                        device=torch.device("cpu"), dtype=torch.float32)
        cache.allocate_snapshots(8)
        return cache

    return adapter, model, new_cache


def _forward(model, cache, tokens, rows, starts, lengths, captures=()):
    width = max(lengths)
    ids = torch.stack([tokens[r][s: s + n] for r, s, n in zip(rows, starts, lengths)])
    positions = (torch.tensor(starts)[:, None] + torch.arange(width)[None, :]).expand(3, -1, -1)
    tables = [list(range(1 + 9 * r, 10 + 9 * r)) for r in rows]
    cache.prepare_prefill(rows, starts, lengths, tables, captures=captures)
    return model.prefill(ids, None, positions, cache.masks(torch.float32), cache)


@torch.inference_mode()
def test_one_forward_captures_the_states_a_split_forward_copies(hybrid):
    adapter, model, new_cache = hybrid
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, adapter.vocab_size, (128,), generator=gen) for _ in range(2)]
    # Row 0 starts fresh; row 1 has 16 tokens computed already (an earlier chunk). Both compute 112 now.
    points = {0: [32, 80], 1: [80]}  # positions; row 1's offset 64 is a chunk edge, row 0's are not
    slots = {(0, 32): 0, (0, 80): 1, (1, 80): 2}
    starts = [0, 16]

    one = new_cache()
    _forward(model, one, tokens, [1], [0], [16])
    captures = [(b, p - starts[b], slots[b, p]) for b in (0, 1) for p in points[b]]
    hidden = _forward(model, one, tokens, [0, 1], starts, [112, 112], captures)

    split = new_cache()
    _forward(model, split, tokens, [1], [0], [16])
    for b in (0, 1):
        pieces, at = [], starts[b]
        for end in points[b] + [starts[b] + 112]:
            pieces.append(_forward(model, split, tokens, [b], [at], [end - at])[0])
            if end in points[b]:
                split.save_state(b, 4 + slots[b, end])
            at = end
        torch.testing.assert_close(hidden[b], torch.cat(pieces), atol=1e-5, rtol=1e-4)

    linear = [i for i, kind in enumerate(one.layer_types) if kind == "linear_attention"]
    assert linear
    for i in linear:
        for got, want in zip(one.snapshots[i], split.snapshots[i], strict=True):  # conv, recurrent
            assert want[4:7].abs().sum() > 0
            torch.testing.assert_close(got[:3], want[4:7], atol=1e-5, rtol=0)
        for got, want in zip(one.caches[i].row_tensors(), split.caches[i].row_tensors(), strict=True):
            torch.testing.assert_close(got[:2], want[:2], atol=1e-5, rtol=0)
