"""The engine's gated-delta-net decode step (`models/delta_net_decode.py`) against transformers' own layer
forward: one token per row from given conv and recurrent states, the same output and the same next
states, the engine's updated in place in the cache's rows (greedy tokens against `generate()` are the
decode tests' business: tests/test_qwen3_5_decode.py, tests/test_minicpmv_decode.py)."""

from __future__ import annotations

import pytest
import torch

from raypipe.models import delta_net_decode
from raypipe.models.registry import language_adapter, preset_checkpoint


class _Rows:
    """The cache calls a gated-delta-net layer makes, over one layer's row tensors."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor):
        self.conv, self.recurrent, self.handed_back = conv, recurrent, None

    def get_conv_state(self, layer_idx, state_idx=0):
        return self.conv

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.recurrent

    def update_recurrent_state(self, state, layer_idx, state_idx=0, **kwargs):
        self.handed_back = state

    def keep_decode_rows(self, layer_idx, conv_state, recurrent_state):
        pass  # the states handed out are the rows themselves

    def is_recording_past(self, layer_idx):
        return False


@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_decode_step_equals_transformers_layer_and_updates_the_rows_in_place(preset):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

    config = language_adapter(preset_checkpoint(preset)).text_config
    layer_class = Qwen3_5MoeGatedDeltaNet if "moe" in preset else Qwen3_5GatedDeltaNet
    torch.manual_seed(0)
    net = layer_class(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.3)
    rows = 5
    hidden = torch.randn(rows, 1, config.hidden_size)
    conv = torch.randn(rows, net.conv_dim, net.conv_kernel_size)
    recurrent = torch.randn(rows, net.num_v_heads, net.head_k_dim, net.head_v_dim)

    theirs = _Rows(conv.clone(), recurrent.clone())
    ours = _Rows(conv.clone(), recurrent.clone())
    storage = ours.recurrent.data_ptr()
    with torch.inference_mode():
        want = net(hidden, cache_params=theirs)
        got = delta_net_decode.decode_forward(net, hidden, ours)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.conv, theirs.conv, rtol=0, atol=0)  # the same roll of the conv inputs
    torch.testing.assert_close(ours.recurrent, theirs.handed_back, rtol=1e-5, atol=1e-5)
    assert ours.handed_back is None and ours.recurrent.data_ptr() == storage  # in place, nothing handed back
    assert not torch.equal(ours.recurrent, recurrent)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_conv_in_fp32_gives_transformers_low_precision_conv_exactly(dtype):
    """The prefill's causal conv runs a bf16 chunk in fp32 (transformers' bf16 `F.conv1d(groups=C)` is a
    per-channel loop on a CPU) and rounds once: the same values as transformers' own conv."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet, causal_conv1d_fn

    from raypipe.models.delta_net_prefill import _causal_conv

    config = language_adapter(preset_checkpoint("tiny-qwen3.5")).text_config
    torch.manual_seed(4)
    net = Qwen3_5GatedDeltaNet(config, layer_idx=0).to(dtype).eval()
    inputs = torch.randn(3, net.conv_dim, 37).to(dtype)
    with torch.inference_mode():
        want = causal_conv1d_fn(inputs, net.conv1d.weight.squeeze(1), net.conv1d.bias, activation=net.activation)
        got = _causal_conv(net, inputs)
    assert got.dtype == dtype and torch.equal(got, want)
