"""LoRA adapters on the vision tower: what a unit of an adapter's request carries, and how a worker applies it.

An adapter that targets tower linears (Qwen2.5-VL's blocks and merger) changes the embedding of every image
of a request served with it, so the encoders must run those units with the adapter, and nothing keyed by the
image alone may hand that embedding to another adapter's request or the base model's.

- The caller reads the adapter's tower part once (`read_tower_loras`: `models/lora.py`) and puts its factors in
  the object store: a unit carries a `TowerLora` (name, fingerprint, the factors' ref). Any encoder replica can
  then apply it, on any node, with no shared file system and no second read whose bytes could differ; a
  replica fetches the factors once and keeps them by fingerprint (`TowerAdapters`). The adapter's identity
  is its fingerprint (the bytes it was read from), the same one the decode engine keys it by.
- A worker runs each adapter's units in forwards of their own, with `scaling * B(A(x))` added to each
  targeted linear's output (forward hooks, PEFT's unmerged math) for that forward only: units of different
  adapters never share a forward, and the base model's units keep the budgeted / compiled / graphed path,
  which captured the base weights (an adapter's units run eagerly).
- The coordinator keys such an item by `cache_key` (its content hash and the fingerprint): the embedding cache
  and the batch's de-duplication never mix adapters. The decode engine's prefix-cache keys already chain
  from the adapter's fingerprint (`decode/prefix_hash.py`), image blocks included.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import ray
import torch

from raypipe.models.family import ModelFamily
from raypipe.models.lora import LoraWeights, check_tower_factors, read_tower_adapter

TOWER_LORAS_KEPT = 8  # adapters a worker keeps on its device (each is small next to the tower)


@dataclasses.dataclass(frozen=True, slots=True)
class TowerLora:
    """A tower adapter as it travels with its units: its identity and its factors in the object store."""

    name: str
    fingerprint: str
    factors: ray.ObjectRef  # a `LoraWeights` of tower module names


def read_tower_loras(lora_modules: dict[str, str], family: ModelFamily, where: str | None = None
                     ) -> dict[str, TowerLora]:
    """The adapters of `lora_modules` (name -> folder) that target `family`'s tower, their factors put in the
    object store; adapters on the language model alone are not in it. Errors name `where` (default
    `lora_modules.<name>`)."""
    found = {}
    for name, folder in lora_modules.items():
        weights = read_tower_adapter(name, folder, family, where)
        if weights is not None:
            found[name] = TowerLora(name, weights.fingerprint, ray.put(weights))
    return found


def cache_key(content_hash: str, lora: TowerLora | None) -> str:
    """An item's identity for the embedding cache: its content hash, and the tower adapter that encodes it."""
    return content_hash if lora is None else f"{content_hash}@lora:{lora.fingerprint}"


class TowerAdapters:
    """A worker's tower adapters on its device, by fingerprint (least recently used dropped first)."""

    def __init__(self, tower: torch.nn.Module, device: torch.device, dtype: torch.dtype):
        self.tower, self.device, self.dtype = tower, device, dtype
        self._kept: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self.fetched = 0

    def factors(self, lora: TowerLora, where: str | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Its factors on this device, fetched and checked against this tower the first time (errors name `where`,
        default `lora_modules.<name>`)."""
        if lora.fingerprint not in self._kept:
            weights: LoraWeights = ray.get(lora.factors)
            check_tower_factors(weights, self.tower, where or f"lora_modules.{lora.name}")
            self._kept[lora.fingerprint] = {module: (a.to(self.device, self.dtype), b.to(self.device, self.dtype))
                                            for module, (a, b) in weights.factors.items()}
            self.fetched += 1
            while len(self._kept) > TOWER_LORAS_KEPT:
                self._kept.popitem(last=False)
        self._kept.move_to_end(lora.fingerprint)
        return self._kept[lora.fingerprint]

    @contextlib.contextmanager
    def applied(self, lora: TowerLora):
        """The tower computes with `lora` inside the block: each targeted linear adds `x A B` (B scaled)."""
        handles = [self.tower.get_submodule(module).register_forward_hook(_adds(a, b))
                   for module, (a, b) in self.factors(lora).items()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _adds(a: torch.Tensor, b: torch.Tensor):
    def hook(module, args, output):
        return output + (args[0] @ a) @ b

    return hook
