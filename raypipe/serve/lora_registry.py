"""`LoraRegistry` deployment: the LoRA adapters loaded while the app runs (`/v1/load_lora_adapter`), for every replica.

Ingress and Decoder replicas come and go with load, so an adapter loaded through one Ingress replica must be
found by every Ingress replica and run by every Decoder replica, also one started later. One registry replica
holds name -> `LoraRef` (where to read the adapter and the fingerprint of what was read when it was loaded,
after one Decoder replica checked it). An Ingress resolves a request's `model` here and passes the reference
with the decoder call; a Decoder replica that does not serve that name with that fingerprint yet reads it
into its engine's pool first (`decoder.py`). Adapters configured at start (`engine.lora_modules`) are not
here: every Decoder has them. Memory only: a restarted registry has forgotten the runtime adapters (load
them again), as the `ResponseStore` forgets responses.
"""

from __future__ import annotations

import dataclasses

from ray import serve


@dataclasses.dataclass(frozen=True, slots=True)
class LoraRef:
    """An adapter a request names: configured at start (no path, no fingerprint) or loaded at run time."""

    name: str
    path: str | None = None
    fingerprint: str | None = None

    @property
    def routing_key(self) -> str:
        """What the prefix-affinity keys chain from: its weights' identity where known, else its name."""
        return self.fingerprint or self.name


@serve.deployment  # options (one replica) live in deployments/config.yaml
class LoraRegistry:
    def __init__(self):
        self._adapters: dict[str, LoraRef] = {}

    def add(self, ref: LoraRef) -> bool:
        """Register `ref`; False if its name is registered already (vLLM's rule: unload it first)."""
        if ref.name in self._adapters:
            return False
        self._adapters[ref.name] = ref
        return True

    def remove(self, name: str) -> bool:
        return self._adapters.pop(name, None) is not None

    def get(self, name: str) -> LoraRef | None:
        return self._adapters.get(name)

    def all(self) -> list[LoraRef]:
        return list(self._adapters.values())
