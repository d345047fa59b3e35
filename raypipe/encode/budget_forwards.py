"""`BudgetedForwards`: how one worker runs its shard at token budgets (`budgets.py`), eager, compiled or graphed.

For each forward of the shard's packing, the tower prepares the metadata on the CPU
(`VisionTower.prepare`) and the forward at that budget runs on it:

- on a GPU, a CUDA graph per budget, captured when the worker starts (largest first, sharing one
  memory pool) on padding-only metadata, replayed after the prepared tensors are copied into its
  buffers. The next forward is prepared on the CPU while the device still runs the previous one.
  Needs a tower whose forward can be captured (`graph_capturable`: Qwen2.5-VL with flash attention);
- on a CPU, `torch.compile` of the tower's forward, specialised per budget's shapes, where
  `TokenBudgets.compile_cpu` asks for it;
- else the same prepared forward, eagerly.

Units above the largest budget go through the tower's own `encode`, alone.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from raypipe.encode.budgets import TokenBudgets, pack
from raypipe.models.base import PreparedForward, VisionItem, VisionTower


@dataclasses.dataclass(slots=True)
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    inputs: dict[str, torch.Tensor]  # the buffers the graph reads
    output: torch.Tensor  # the buffer it writes

    def replay(self, prepared: PreparedForward) -> torch.Tensor:
        for name, tensor in prepared.tensors.items():
            self.inputs[name].copy_(tensor, non_blocking=True)
        self.graph.replay()
        return self.output.clone()  # the next replay overwrites the buffer before this one is read


class BudgetedForwards:
    def __init__(self, tower: VisionTower, budgets: TokenBudgets):
        self.tower = tower
        self.budgets = budgets
        self.run = tower.forward_prepared
        self.graphs: dict[int, _Graph] = {}
        self.stats = {"budgets": budgets.sizes, "compiled": False, "graphs": 0, "graph_capture_s": 0.0,
                      "graph_bytes": 0, "packed_forwards": 0, "eager_units": 0, "padding_tokens": 0}
        if tower.device.type == "cuda" and tower.graph_capturable:
            self._capture_graphs()
        elif tower.device.type == "cpu" and budgets.compile_cpu:
            self.run = torch.compile(tower.forward_prepared, dynamic=False)
            self.stats["compiled"] = True

    @classmethod
    def for_tower(cls, tower: VisionTower, budgets: TokenBudgets) -> "BudgetedForwards | None":
        """None where budgets are off (for this device) or the tower has no budgeted forwards (the worker runs it eagerly)."""
        return cls(tower, budgets) if budgets.on_for(tower.device) and tower.packs_to_budgets else None

    @torch.inference_mode()
    def encode(self, items: list[VisionItem]) -> list[torch.Tensor]:
        """One `(num_tokens, hidden)` CPU tensor per item, in the order given."""
        out: list[torch.Tensor | None] = [None] * len(items)
        tokens = [self.tower.budget_tokens(item) for item in items]
        pending = None  # the forward the device may still be running
        for forward in pack(tokens, self.budgets):
            units = [items[i] for i in forward.units]
            if forward.budget is None:
                out[forward.units[0]], = self.tower.encode(units)
                self.stats["eager_units"] += 1
                continue
            prepared = self.tower.prepare(units, forward.budget, static=forward.budget in self.graphs)
            launched = (forward.units, prepared, self._launch(prepared))
            if pending is not None:
                self._collect(*pending, out)
            pending = launched
            self.stats["packed_forwards"] += 1
            self.stats["padding_tokens"] += forward.budget - sum(tokens[i] for i in forward.units)
        if pending is not None:
            self._collect(*pending, out)
        return out

    def _launch(self, prepared: PreparedForward) -> torch.Tensor:
        graph = self.graphs.get(prepared.budget)
        if graph:  # copies the CPU tensors straight into its buffers (and dtype)
            return graph.replay(prepared)
        on_device = prepared.to(self.tower.device, self.tower.dtype)
        return self.run(on_device.tensors, on_device.scalars)

    @staticmethod
    def _collect(indices: list[int], prepared: PreparedForward, output: torch.Tensor, out: list) -> None:
        for i, embedding in zip(indices, prepared.split(output)):
            out[i] = embedding.cpu()

    def _capture_graphs(self) -> None:
        """One graph per budget, largest first, in one memory pool; time and memory into `stats`."""
        start, before = time.perf_counter(), torch.cuda.memory_reserved(self.tower.device)
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for budget in reversed(self.budgets.sizes):
                prepared = self.tower.prepare([], budget, static=True).to(self.tower.device, self.tower.dtype)
                side = torch.cuda.Stream(self.tower.device)
                side.wait_stream(torch.cuda.current_stream(self.tower.device))
                with torch.cuda.stream(side):  # warm-up outside the graph (allocator, kernels' lazy init)
                    self.tower.forward_prepared(prepared.tensors, prepared.scalars)
                torch.cuda.current_stream(self.tower.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    output = self.tower.forward_prepared(prepared.tensors, prepared.scalars)
                self.graphs[budget] = _Graph(graph, prepared.tensors, output)
        torch.cuda.synchronize(self.tower.device)
        self.stats.update(graphs=len(self.graphs), graph_capture_s=time.perf_counter() - start,
                          graph_bytes=torch.cuda.memory_reserved(self.tower.device) - before)
