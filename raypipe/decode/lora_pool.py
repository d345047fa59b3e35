"""`LoraPool`: which LoRA adapters the engine knows, which it keeps read in CPU memory, which hold a device slot.

Three tiers, as vLLM has them: adapters *known* by name (loaded at start from `EngineConfig.lora_modules`
or at run time by `LLMEngine.load_lora`; a name and where to read it), at most `max_cpu_loras` of them
*read* (their factors in CPU memory, least recently used dropped first and read again when asked), and
at most `max_loras` in the model's device *slots* (`models/lora.py`), assigned least recently used first
when a request is admitted (`assign`, called by the scheduler).

A slot holds an adapter by its fingerprint (the bytes it was read from), not its name: a name unloaded
and loaded again with other weights gets another slot, while requests still running under the old
weights keep theirs. A slot in use by a running or joining sequence is never given to another adapter;
a request whose adapter finds no free slot waits (`assign` returns None). Slot writes are only
recorded here (`take_writes`): the engine applies them at its round boundary, where no forward runs.

Callers (request threads, `load`/`unload`) and the engine thread (`assign`) share it, under one lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from raypipe.errors import InvalidInput
from raypipe.models.lora import LoraWeights

# reader(name, path, where) -> the adapter read and checked (raises InvalidInput naming `where`'s field)
Reader = Callable[[str, str, str], LoraWeights]


class LoraPool:
    def __init__(self, reader: Reader, max_loras: int, max_cpu_loras: int):
        self._read, self.max_loras, self.max_cpu_loras = reader, max_loras, max_cpu_loras
        self._lock = threading.Lock()
        self._paths: dict[str, str] = {}  # known adapters: name -> where to read it
        self._cpu: OrderedDict[str, LoraWeights] = OrderedDict()  # read ones, least recently used first
        self._slots: OrderedDict[int, str] = OrderedDict()  # slot -> fingerprint, least recently used first
        self._free = list(range(max_loras, 0, -1))  # slots never written (popped from the end: 1 first)
        self._writes: dict[int, LoraWeights] = {}  # slot -> adapter to write at the next round boundary
        self.counters = dict(lora_loads=0, lora_unloads=0, lora_reads=0, lora_slot_writes=0)

    def load(self, name: str, path: str, where: str | None = None) -> LoraWeights:
        """Know `name`, read from `path` now (a bad adapter is refused here, not at its first request). A name
        already known is refused (vLLM's rule: unload it first)."""
        with self._lock:
            if name in self._paths:
                raise InvalidInput(f"the LoRA adapter {name!r} has already been loaded", item="lora_name",
                                   code="lora_already_loaded")
        weights = self._read(name, path, where or f"lora_modules.{name}")
        with self._lock:
            if name in self._paths:  # loaded meanwhile by another caller
                raise InvalidInput(f"the LoRA adapter {name!r} has already been loaded", item="lora_name",
                                   code="lora_already_loaded")
            self._paths[name] = path
            self._keep(weights)
            self.counters["lora_loads"] += 1
        return weights

    def unload(self, name: str) -> None:
        """Forget `name`: new requests for it are refused; requests already holding it finish with it."""
        with self._lock:
            if self._paths.pop(name, None) is None:
                raise self._unknown(name)
            self._cpu.pop(name, None)
            self.counters["lora_unloads"] += 1

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._paths)

    def path(self, name: str) -> str | None:
        with self._lock:
            return self._paths.get(name)

    def check(self, name: str) -> None:
        """Refuse a name the engine does not know."""
        with self._lock:
            if name not in self._paths:
                raise self._unknown(name)

    def cached(self, name: str) -> LoraWeights | None:
        """`name`'s adapter if it is in CPU memory (refused if unknown)."""
        with self._lock:
            if name not in self._paths:
                raise self._unknown(name)
            weights = self._cpu.get(name)
            if weights is not None:
                self._cpu.move_to_end(name)
            return weights

    def weights(self, name: str) -> LoraWeights:
        """`name`'s adapter, read again from its path if it left CPU memory (blocking: call it off the event loop)."""
        weights = self.cached(name)
        if weights is not None:
            return weights
        path = self.path(name)
        if path is None:
            raise self._unknown(name)
        weights = self._read(name, path, f"lora_modules.{name}")
        with self._lock:
            self.counters["lora_reads"] += 1
            if self._paths.get(name) == path:
                self._keep(weights)
        return weights

    def assign(self, adapter: LoraWeights, busy: set[int]) -> int | None:
        """The slot `adapter` runs in: the one holding it already, else a free one, else the least recently
        used slot not in `busy` (slots of running and joining sequences), with its write recorded. None: every
        slot is busy with other adapters; the request waits."""
        with self._lock:
            for slot, fingerprint in self._slots.items():
                if fingerprint == adapter.fingerprint:
                    self._slots.move_to_end(slot)
                    return slot
            if self._free:
                slot = self._free.pop()
            else:
                slot = next((s for s in self._slots if s not in busy), None)
                if slot is None:
                    return None
                del self._slots[slot]
            self._slots[slot] = adapter.fingerprint
            self._writes[slot] = adapter
            return slot

    def take_writes(self) -> list[tuple[int, LoraWeights]]:
        """The slot writes assigned since the last call, to apply before the next forward."""
        with self._lock:
            writes, self._writes = list(self._writes.items()), {}
            self.counters["lora_slot_writes"] += len(writes)
            return writes

    def stats(self) -> dict:
        with self._lock:
            return {"lora_known": len(self._paths), "lora_in_cpu": len(self._cpu), "lora_in_slots": len(self._slots),
                    **self.counters}

    def _keep(self, weights: LoraWeights) -> None:
        self._cpu[weights.name] = weights
        self._cpu.move_to_end(weights.name)
        while len(self._cpu) > self.max_cpu_loras:
            self._cpu.popitem(last=False)

    def _unknown(self, name: str) -> InvalidInput:
        return InvalidInput(f"unknown LoRA adapter {name!r}; this engine serves {sorted(self._paths)}", item="lora",
                            code="lora_not_found")
