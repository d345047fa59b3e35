"""A linear layer whose weight stays in the checkpoint's quantized tensors and is dequantized per forward.

On a CPU (no FP8 or int4 matmul) the point of a quantized checkpoint is memory: the layer holds the
stored tensors (an FP8 weight and its block scales, an int4 packing and its group scales, ...) at
their stored dtypes, and each forward rebuilds the weight in the activations' dtype for one
`F.linear`, so one layer's full-precision weight exists at a time. A subclass says which tensors it
stores and how they become a weight (`dequantize`).
"""

from __future__ import annotations

import torch


class StoredWeightLinear(torch.nn.Module):
    def __init__(self, in_features: int, out_features: int, stored: tuple[str, ...], bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.stored = stored
        for name in stored:  # filled by the checkpoint, as stored (`_load_from_state_dict`)
            self.register_buffer(name, None)
        self.bias = torch.nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.dequantize(x.dtype), self.bias)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if self.bias is not None:  # cast to the layer's dtype, as any parameter (before the buffers exist)
            super()._load_from_state_dict({k: v for k, v in state_dict.items() if k == prefix + "bias"}, prefix,
                                          local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        # The stored tensors are taken as they are (dtype and all): a cast would change the dequantized weight.
        for name in self.stored:
            if prefix + name in state_dict:
                setattr(self, name, state_dict[prefix + name])
            else:
                missing_keys.append(prefix + name)
        known = {prefix + name for name in (*self.stored, "bias")}
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in known
                               and "." not in k[len(prefix):])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, stored={self.stored}"
