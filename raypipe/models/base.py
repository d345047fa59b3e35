"""What the coordinator, encoder workers and decode engine need to know about a model family.

A `VisionAdapter` is built from a checkpoint's config alone (no weights), so the coordinator can
compute each item's geometry, token count and cost without touching a GPU. Workers call
`load_tower` once and then `encode` shards of items.

`make_item` describes a whole image (its geometry and the embedding rows it yields). `split` cuts
it into units of encoder work — the image itself (Qwen2.5-VL), or its views (Step3: each crop and
the global view), each balanced on its own — whose embeddings, concatenated in `split`'s order,
are the image's embedding. The coordinator only ever sees `cost`, `num_tokens` and `content_hash`,
so new families plug in without touching it.
"""

from __future__ import annotations

import abc
import dataclasses
import pathlib

import numpy as np
import torch

from raypipe.preprocess import DecodedImage

ADAPTER_COST_MODELS = ("patches", "attention")  # what an adapter computes from geometry alone
# `calibrated` is fitted by the coordinator from measured encode times (raypipe/calibration.py).
COST_MODELS = (*ADAPTER_COST_MODELS, "calibrated")


def check_cost_model(name: str, allowed: tuple[str, ...] = COST_MODELS) -> None:
    if name not in allowed:
        raise ValueError(f"unknown cost model {name!r}; expected one of {allowed}")


@dataclasses.dataclass(slots=True)
class VisionItem:
    """One unit of vision-tower work, as it travels to an encoder worker."""

    pixels: np.ndarray  # (H, W, 3) uint8: the model's image processor runs on the worker
    content_hash: str
    grid: tuple[int, ...]  # family-specific geometry (Qwen: (t, h, w) in patches)
    num_tokens: int  # embedding rows this item yields (= placeholder tokens in the prompt)


class VisionTower(abc.ABC):
    """A loaded vision encoder on one device."""

    device: torch.device

    @abc.abstractmethod
    def encode(self, items: list[VisionItem]) -> list[torch.Tensor]:
        """One `(item.num_tokens, hidden)` CPU tensor per item, in the order given."""


class VisionAdapter(abc.ABC):
    """Config-level knowledge of a model family's vision side."""

    checkpoint: pathlib.Path
    hidden_size: int  # width of each embedding row (= the language model's hidden size)

    @abc.abstractmethod
    def make_item(self, image: DecodedImage) -> VisionItem:
        """Geometry and token count of a validated image, without running the encoder."""

    def resize_for_tower(self, image: DecodedImage) -> DecodedImage:
        """`image` at the size the tower consumes, resized exactly as the family's image processor would.

        Called where images are decoded (Serve ingress, `Pipeline`, batch preprocessing) so that
        only these pixels travel to the encoder workers; the processor's own resize on the worker
        is then the identity. Families whose processor does not resize return `image` unchanged.
        """
        return image

    def split(self, item: VisionItem) -> list[VisionItem]:
        """Units of encoder work for one image, in the order their embeddings concatenate; each
        unit's `content_hash` is unique to it. By default the image is one unit."""
        return [item]

    # What the chat template renders once per image; `placeholder_ids` replaces it in the prompt.
    image_placeholder: str = "<|image_pad|>"

    def placeholder_ids(self, item: VisionItem, tokenizer) -> list[int]:
        """The image's tokens in the prompt: by default `num_tokens` copies of the placeholder."""
        return [tokenizer.convert_tokens_to_ids(self.image_placeholder)] * item.num_tokens

    @abc.abstractmethod
    def cost(self, item: VisionItem, cost_model: str = "patches") -> float:
        """Relative compute of encoding one unit (from `split`) under `cost_model` (one of `ADAPTER_COST_MODELS`)."""

    @abc.abstractmethod
    def load_tower(self, device: torch.device, dtype: torch.dtype) -> VisionTower:
        """Load only the vision encoder's weights from the checkpoint onto `device`."""

    def embedding_nbytes(self, item: VisionItem, dtype: torch.dtype = torch.float32) -> int:
        return item.num_tokens * self.hidden_size * torch.tensor([], dtype=dtype).element_size()
