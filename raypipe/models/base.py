"""What the coordinator, encoder workers and decode engine need to know about a model family.

A `VisionAdapter` is built from a checkpoint's config alone (no weights), so the coordinator can
compute each item's geometry, token count and cost without touching a GPU. Workers call
`load_tower` once and then `encode` shards of items.

An item is whatever the family's vision tower consumes as one unit and produces one embedding
tensor for, made from one visual item (`raypipe.inputs.media.DecodedVisual`, an image or a video):
a whole variable-size image or video (Qwen2.5-VL), a fixed-size image or its crops stacked
(LLaVA/SigLIP, Step3), or an image's slices (MiniCPM-V). The coordinator only ever sees `cost`,
`num_tokens` and `content_hash`, so new families plug in without touching it.

An item may be cut into finer units of work (`units`: MiniCPM-V's overview and slices, Step3's
crops and global view) that workers encode separately; with `split_units` the coordinator balances
units rather than whole items and concatenates each item's unit embeddings in unit order. A
Qwen2.5-VL video's units are chunks of its temporal groups, so one long video spreads over every worker.

The language side sees each visual item of a prompt as a `VisualLayout`: its kind, grid, and for a
video the time between temporal groups and the EVS pruning rate.
"""

from __future__ import annotations

import abc
import dataclasses
import pathlib
from collections.abc import Sequence

import numpy as np
import torch

from raypipe.errors import InvalidInput
from raypipe.inputs.media import DecodedVisual, VisualKind
from raypipe.inputs.video import PlanFrames, VideoSampling
from raypipe.models import evs

ADAPTER_COST_MODELS = ("patches", "attention")  # what an adapter computes from geometry alone
# `calibrated` is fitted by the coordinator from measured encode times (raypipe/encode/calibration.py).
COST_MODELS = (*ADAPTER_COST_MODELS, "calibrated")


def check_cost_model(name: str, allowed: tuple[str, ...] = COST_MODELS) -> None:
    if name not in allowed:
        raise ValueError(f"unknown cost model {name!r}; expected one of {allowed}")


@dataclasses.dataclass(slots=True)
class VisionItem:
    """One unit of vision-tower work, as it travels to an encoder worker."""

    pixels: np.ndarray  # image (H, W, 3) / video (T, H, W, 3) uint8: the model's processor runs on the worker
    content_hash: str
    grid: tuple[int, ...]  # family-specific geometry (Qwen: (t, h, w) in patches)
    num_tokens: int  # embedding rows this item yields (before any EVS pruning)
    unit_index: int = 0  # which of its item's units this is (`VisionAdapter.units` order); 0 for a whole item
    kind: VisualKind = "image"
    # video: each temporal group's time in seconds, for a family whose prompt writes it (Qwen3-VL); () otherwise
    group_times_s: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class VisualLayout:
    """What the language side needs of one visual item in a prompt (`PreparedPrompt.visual_layouts`)."""

    kind: VisualKind
    grid: tuple[int, ...]  # as `VisionItem.grid`
    seconds_per_grid: float | None = None  # video: seconds between temporal groups (Qwen's `second_per_grid_ts`)
    pruning_rate: float = 0.0  # video: EVS, the fraction of its tokens dropped after encoding (0: none)
    # The item's identity: `DecodedVisual.content_hash`, a hash of its pixels as the tower consumes them (so of
    # its frame sampling and resize too); set by `models.prompt`. With the fields above it keys the prefix cache
    # (`decode/prefix_hash.py`). None: no identity, so blocks from this item on are never shared.
    content_hash: str | None = None


@dataclasses.dataclass(slots=True)
class PreparedForward:
    """One tower forward padded to a token budget, its metadata computed (`VisionTower.prepare`).

    `tensors` have fixed shapes per budget (with `static`, even the segment boundaries), so a compiled
    forward or a CUDA graph captured for that budget replays on them; `scalars` are what the
    forward takes besides (maximum run lengths)."""

    budget: int
    tensors: dict[str, torch.Tensor]
    scalars: dict[str, int]
    rows: list[int]  # output rows of each unit, in order; the padding's rows follow them

    def to(self, device: torch.device, dtype: torch.dtype) -> "PreparedForward":
        """On `device`, `pixel_values` in the tower's `dtype`; the metadata keeps its own (rotary
        cos/sin stay fp32, as the eager tower computes them)."""
        moved = {k: t.to(device, dtype if k == "pixel_values" else t.dtype, non_blocking=True)
                 for k, t in self.tensors.items()}
        return PreparedForward(self.budget, moved, self.scalars, self.rows)

    def split(self, output: torch.Tensor) -> list[torch.Tensor]:
        """Each unit's rows of the forward's `output`, cut back out (the padding's dropped)."""
        return list(torch.split(output[:sum(self.rows)], self.rows))


class VisionTower(abc.ABC):
    """A loaded vision encoder on one device.

    A tower that can run forwards padded to token budgets (`raypipe.encode.budgets`) sets
    `packs_to_budgets` and implements `budget_tokens`, `prepare` (metadata, on the CPU) and
    `forward_prepared` (tensor work only); the others are run by `encode` alone."""

    device: torch.device
    dtype: torch.dtype
    packs_to_budgets: bool = False
    graph_capturable: bool = False  # `forward_prepared` on static metadata can be captured in a CUDA graph

    @abc.abstractmethod
    def encode(self, items: list[VisionItem]) -> list[torch.Tensor]:
        """One `(item.num_tokens, hidden)` CPU tensor per item, in the order given."""

    def budget_tokens(self, item: VisionItem) -> int:
        """The sequence length `item` takes in one forward of this tower."""
        raise NotImplementedError(f"{type(self).__name__} has no budgeted forwards")

    def prepare(self, items: list[VisionItem], budget: int, static: bool = False) -> PreparedForward:
        """`items` processed and packed into one forward of `budget` tokens, with all of its metadata."""
        raise NotImplementedError(f"{type(self).__name__} has no budgeted forwards")

    def forward_prepared(self, tensors: dict[str, torch.Tensor], scalars: dict[str, int]) -> torch.Tensor:
        """The tensor work of a prepared forward: every row, padding's last (`PreparedForward.split` cuts)."""
        raise NotImplementedError(f"{type(self).__name__} has no budgeted forwards")

    @property
    def lora_root(self) -> torch.nn.Module:
        """The module whose submodules' names LoRA adapters on this tower use (`ModelFamily.lora_tower_prefixes`
        maps checkpoint names onto them); `encode` must run those submodules' own forwards."""
        raise NotImplementedError(f"{type(self).__name__} takes no LoRA adapters")


class PlaceholderTokens:
    """The placeholder token of each kind of visual item: one answer for both sides of a family."""

    image_token_id: int  # the token whose rows the image embeddings replace
    video_token_id: int | None = None  # the same for videos, in families that take them

    @property
    def placeholder_token_ids(self) -> dict[VisualKind, int]:
        """Per kind of visual item, the token whose rows its embeddings replace (the kinds this family
        takes; `TextDecoder.embed` scatters over all of them)."""
        ids: dict[VisualKind, int] = {"image": self.image_token_id}
        if self.video_token_id is not None:
            ids["video"] = self.video_token_id
        return ids


class VisionAdapter(PlaceholderTokens, abc.ABC):
    """Config-level knowledge of a model family's vision side."""

    checkpoint: pathlib.Path
    # width of each embedding row: the language model's hidden size (times 1 + deepstack levels for Qwen3-VL,
    # whose rows carry those levels on their columns)
    hidden_size: int
    split_units: bool = False  # balance an item's units separately (slices of one image on several workers)

    @abc.abstractmethod
    def make_item(self, image: DecodedVisual) -> VisionItem:
        """Geometry and token count of a validated visual item, without running the encoder."""

    def plan_frames(self, sampling: VideoSampling) -> PlanFrames:
        """Which frames of a video to keep and their size, under `sampling` (families that take videos)."""
        raise InvalidInput("this model does not take videos", item="video", code="video_not_supported")

    def layout(self, visual: DecodedVisual, item: VisionItem, pruning_rate: float = 0.0) -> VisualLayout:
        """What the language side needs of `visual` (made into `item`) in a prompt."""
        return VisualLayout(item.kind, tuple(item.grid))

    def resize_for_tower(self, image: DecodedVisual) -> DecodedVisual:
        """`image` at the size the tower consumes, resized exactly as the family's image processor would.

        Called where images are decoded (Serve ingress, `Pipeline`, batch preprocessing) so that
        only these pixels travel to the encoder workers; the processor's own resize on the worker
        is then the identity. Families whose processor does not resize return `image` unchanged.
        """
        return image

    def prompt_visuals(self, visuals: list[DecodedVisual], tile_every_image: bool) -> list[DecodedVisual]:
        """The visual items of one prompt as this family processes them there: unchanged, unless the family's
        processing of an image depends on the prompt's other items (LLaVA-OneVision). `tile_every_image` asks such
        a family to process every image as if it were alone; the others refuse it, having nothing to change."""
        if tile_every_image:
            raise InvalidInput("tile_every_image applies to LLaVA-OneVision only: this model processes each image "
                               "the same way whatever else the prompt holds", item="mm_processor_kwargs",
                               code="invalid_mm_processor_kwargs")
        return visuals

    @abc.abstractmethod
    def cost(self, item: VisionItem, cost_model: str = "patches") -> float:
        """Relative compute of encoding one unit (from `units`) under `cost_model` (one of `ADAPTER_COST_MODELS`)."""

    @abc.abstractmethod
    def load_tower(self, device: torch.device, dtype: torch.dtype) -> VisionTower:
        """Load only the vision encoder's weights from the checkpoint onto `device`."""

    def units(self, item: VisionItem) -> list[VisionItem]:
        """What workers encode for `item`, in the order their embeddings concatenate into its embedding."""
        return [item]

    def join_units(self, item: VisionItem, parts: list[torch.Tensor]) -> torch.Tensor:
        """`item`'s embedding from its units' embeddings (in `units` order): concatenated, unless the family
        assembles them otherwise (LLaVA-OneVision lays tiles side by side)."""
        return torch.cat(parts)

    def encode_in_process(self, tower: VisionTower, visuals: list[DecodedVisual]) -> list[torch.Tensor]:
        """The embeddings of `visuals` from a tower in this process (no encoder workers): every unit of every
        visual through one `tower.encode`, each visual's joined as the family lays them out. The GPU check and
        `raypipe bench peer` encode this way."""
        items = [self.make_item(visual) for visual in visuals]
        units = [self.units(item) for item in items]
        embeds = iter(tower.encode([unit for parts in units for unit in parts]))
        return [self.join_units(item, [next(embeds) for _ in parts]) for item, parts in zip(items, units)]

    def replaced_around(self, kind: VisualKind) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Tokens a chat template puts right before and after a placeholder of `kind` that the placeholder's
        expansion replaces with it (Qwen3-VL's video: the template's `<|vision_start|>`/`<|vision_end|>`
        around it, since every temporal group brings its own); none by default."""
        return (), ()

    def placeholder_ids(self, item: VisionItem, index: int, tokenizer) -> list[int]:
        """Prompt tokens that stand for the `index`-th visual item of its kind in a prompt (placeholder tokens included)."""
        return [self.placeholder_token_ids[item.kind]] * item.num_tokens

    def embedding_nbytes(self, item: VisionItem, dtype: torch.dtype = torch.float32) -> int:
        return item.num_tokens * self.hidden_size * torch.tensor([], dtype=dtype).element_size()


class LanguageAdapter(PlaceholderTokens, abc.ABC):
    """Config-level knowledge of a family's language side (no weights): tokens, limits, positions."""

    def __init__(self, checkpoint: str | pathlib.Path):
        from transformers import AutoConfig, AutoTokenizer

        self.checkpoint = pathlib.Path(checkpoint)
        self.config = AutoConfig.from_pretrained(self.checkpoint)
        self.text_config = self.config.text_config
        self.tokenizer = AutoTokenizer.from_pretrained(self.checkpoint)
        self.hidden_size = self.text_config.hidden_size
        # width of a visual item's embedding rows: the hidden size, unless the rows carry more (Qwen3-VL's deepstack)
        self.embedding_width = self.hidden_size
        self.vocab_size = self.text_config.vocab_size
        self.max_position_embeddings = self.text_config.max_position_embeddings
        self.image_token_id = self.config.image_token_id
        found = self.text_config.eos_token_id
        found = self.tokenizer.eos_token_id if found is None else found
        self.eos_token_ids = tuple(int(i) for i in (found if isinstance(found, (list, tuple)) else [found])
                                   if i is not None)

    @abc.abstractmethod
    def token_runs(self, grid) -> list[int]:
        """Lengths of the placeholder runs one visual item with this geometry puts in the prompt (unpruned)."""

    def tokens_per_image(self, grid) -> int:
        """Embedding rows the encoder yields for a visual item with this geometry."""
        return sum(self.token_runs(grid))

    def prompt_runs(self, layout: VisualLayout) -> list[int]:
        """The placeholder runs `layout` puts in the prompt: its token runs, or a pruned video's shorter ones
        (`evs.run_counts`; a run planned empty is no run)."""
        runs = self.token_runs(layout.grid)
        if layout.pruning_rate <= 0:
            return runs
        return [n for n in evs.run_counts(runs, layout.grid[0], layout.pruning_rate) if n]

    def positions(self, token_ids, layouts: Sequence[VisualLayout], kept: Sequence[torch.Tensor | None] = ()
                  ) -> tuple[torch.Tensor, int]:
        """`(position_ids (3, L), rope_delta)` of one prompt; decode position = cache index + rope_delta.

        `kept` holds, per visual item, the EVS retention mask over its unpruned rows (None: unpruned).
        By default a token's position is its index, on each of the engine's 3 rows, whatever the
        visual items (MiniCPM-V, Step3); families with multimodal rope (Qwen2.5-VL) override this."""
        return torch.arange(len(token_ids)).expand(3, -1).clone(), 0

    @abc.abstractmethod
    def load_model(self, device: torch.device, dtype: torch.dtype, shard=None) -> torch.nn.Module:
        """The language model alone (`text_decoder.TextDecoder`) on `device`; with `shard`, one
        tensor-parallel rank's part of it (`raypipe.parallel.shards.WeightShard`)."""
