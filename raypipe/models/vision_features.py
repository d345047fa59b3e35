"""Which hidden states of a fixed-size vision tower (CLIP / SigLIP style) feed the projector.

LLaVA-style configs name them with `vision_feature_layer` (an int, or a list whose selected states
are concatenated along the width) and `vision_feature_select_strategy`: `full` keeps every token,
`default` drops the first (CLIP's class token), and `class` keeps only that first token (vLLM's
third `VisionFeatureSelectStrategy`; no transformers LLaVA config uses it). Layer indices index the
tower's `hidden_states` tuple: 0 is the patch embeddings, `i` the output of encoder layer `i`,
negative ones count from the end (-1: the last layer).

Two rules follow transformers (and vLLM's `resolve_visual_encoder_outputs` for LLaVA towers):
- no post-layernorm: `hidden_states[-1]` is the last layer's output *before* `post_layernorm`, and
  LLaVA models project hidden states, never `last_hidden_state`;
- layers past the deepest selected one never affect the output, so a tower is built with only
  `layers_to_run` encoder layers (vLLM's `num_hidden_layers_override`): `-2` skips the last layer.

Every fixed-size tower family selects its features through this one module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

STRATEGIES = ("default", "full", "class")


@dataclasses.dataclass(frozen=True, slots=True)
class FeatureSelection:
    layers: tuple[int, ...]  # indices into `hidden_states`, as the config writes them
    strategy: str
    concatenated: bool  # the config named a list: selected states are concatenated (even a list of one)

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"vision_feature_select_strategy {self.strategy!r}: expected one of {STRATEGIES}")
        if not self.layers:
            raise ValueError("vision_feature_layer names no layer")

    @classmethod
    def from_config(cls, config) -> "FeatureSelection":
        layer = config.vision_feature_layer
        many = isinstance(layer, (list, tuple))
        return cls(tuple(int(i) for i in layer) if many else (int(layer),), config.vision_feature_select_strategy, many)

    def absolute(self, num_layers: int) -> list[int]:
        """The layer indices as positions in a `num_layers`-layer tower's `hidden_states` (length num_layers + 1)."""
        out = [i if i >= 0 else num_layers + 1 + i for i in self.layers]
        if not all(0 <= i <= num_layers for i in out):
            raise ValueError(f"vision_feature_layer {list(self.layers)} is outside a tower of {num_layers} layers")
        return out

    def layers_to_run(self, num_layers: int) -> int:
        """Encoder layers the tower needs: up to the deepest selected one."""
        return max(self.absolute(num_layers))

    def select(self, hidden_states: Sequence[torch.Tensor], num_layers: int) -> torch.Tensor:
        """`(batch, tokens, width x selected layers)` from a `hidden_states` tuple of a tower truncated to
        `layers_to_run(num_layers)` layers (or the whole tower)."""
        picked = [self._tokens(hidden_states[i]) for i in self.absolute(num_layers)]
        return torch.cat(picked, dim=-1) if self.concatenated else picked[0]

    def _tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.strategy == "default":
            return hidden[:, 1:]
        if self.strategy == "class":
            return hidden[:, :1]
        return hidden

    def tokens_per_image(self, vision_config) -> int:
        """Rows one tower input yields (vLLM's `get_vision_encoder_info`): its patches, less or only the first."""
        patches = (vision_config.image_size // vision_config.patch_size) ** 2
        return {"full": patches, "default": patches - 1, "class": 1}[self.strategy]
