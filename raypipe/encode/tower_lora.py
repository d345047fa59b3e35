"""LoRA adapters on the vision tower: what a unit of an adapter's request carries, and how a worker applies it.

An adapter that targets tower linears (Qwen2.5-VL's blocks and merger) changes the embedding of every image
of a request served with it, so the encoders must run those units with the adapter, and nothing keyed by the
image alone may hand that embedding to another adapter's request or the base model's.

- The coordinator's side reads the adapter's tower part once (`TowerLoras`, `models/lora.py`) and puts its
  factors in the object store: a unit carries a `TowerLora` (name, fingerprint, the factors' ref). Any encoder
  replica can then apply it, on any node, without reading the folder itself; a replica fetches the factors once
  and keeps them by fingerprint (`TowerAdapters`). The adapter's identity
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
import threading
from collections.abc import Callable

import ray
import torch

from raypipe.errors import InvalidInput
from raypipe.models.family import ModelFamily
from raypipe.models.lora import LoraWeights, check_tower_factors, read_tower_adapter

TOWER_LORAS_KEPT = 8  # adapters loaded at run time a coordinator keeps read, and a worker on its device


@dataclasses.dataclass(frozen=True, slots=True)
class TowerLora:
    """A tower adapter as it travels with its units: its identity and its factors in the object store."""

    name: str
    fingerprint: str
    factors: ray.ObjectRef  # a `LoraWeights` of tower module names

    @classmethod
    def put(cls, weights: LoraWeights) -> "TowerLora":
        """A tower part as read (`read_tower_adapter`), its factors put in the object store."""
        return cls(weights.name, weights.fingerprint, ray.put(weights))


class TowerLoras:
    """The tower adapters a coordinator's requests may name: those configured at start, by name, and those loaded
    while it runs, by name and fingerprint (the `TOWER_LORAS_KEPT` most recently used; a dropped one is read again
    from its path). Each is read here once, its factors put in the object store, and checked against an encoder's
    tower by `check(lora, where)` before any request uses it."""

    def __init__(self, family: ModelFamily, check: Callable[[TowerLora, str | None], None]):
        self.family, self._check = family, check
        self.configured: dict[str, TowerLora] = {}
        self._loaded: collections.OrderedDict[tuple[str, str], TowerLora | None] = collections.OrderedDict()
        self._lock = threading.Lock()  # a Serve replica reads adapters on several threads

    def configure(self, lora_modules: dict[str, str]) -> None:
        """Read the adapters of `lora_modules` (name -> folder); those on the language model alone are not kept."""
        found = {name: self.read(name, folder) for name, folder in lora_modules.items()}
        self.configured = {name: lora for name, lora in found.items() if lora is not None}

    def read(self, name: str, folder: str, where: str | None = None) -> TowerLora | None:
        """Adapter `name`'s tower part, read, put in the object store and checked (None: it targets no tower
        module); errors name `where` (default `lora_modules.<name>`)."""
        weights = read_tower_adapter(name, folder, self.family, where)
        if weights is None:
            return None
        lora = TowerLora.put(weights)
        self._check(lora, where)
        return lora

    def load(self, name: str, path: str) -> str | None:
        """A run-time load (`/v1/load_lora_adapter`): the tower part's fingerprint, None when there is none."""
        lora = self.read(name, path, "lora_path")
        if lora is not None:
            self._keep((name, lora.fingerprint), lora)
        return lora and lora.fingerprint

    def for_request(self, name: str, path: str | None = None, fingerprint: str | None = None) -> TowerLora | None:
        """The tower part of the adapter a request names: configured at start (no fingerprint), or loaded at run
        time from `path` with `fingerprint` (read now if this coordinator has not kept it; refused if the files
        there changed since)."""
        if fingerprint is None:
            return self.configured.get(name)
        key = (name, fingerprint)
        with self._lock:
            kept = key in self._loaded
        if not kept:
            lora = self.read(name, path, "lora_path")
            if lora is not None and lora.fingerprint != fingerprint:
                raise InvalidInput(f"the LoRA adapter {name!r} at {path} changed since it was loaded; load it again",
                                   item="model", code="invalid_lora_adapter")
            self._keep(key, lora)
        with self._lock:
            self._loaded.move_to_end(key)
            return self._loaded[key]

    def _keep(self, key: tuple[str, str], lora: TowerLora | None) -> None:
        with self._lock:
            self._loaded[key] = lora
            self._loaded.move_to_end(key)
            while len(self._loaded) > TOWER_LORAS_KEPT:
                self._loaded.popitem(last=False)


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
