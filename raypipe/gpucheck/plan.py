"""`CheckPlan`: what the GPU check runs and how long each section may take, every default in one place.

The GPU plan fits one command on the lent machine (at most 10 minutes a command, 15 minutes in all, its
start included): about eight minutes of sections. The CPU plan (`--cpu`) is the same command on tiny
presets with small batches, a dry run in seconds that the normal test suite runs.
"""

from __future__ import annotations

import dataclasses

# test files that hold `@pytest.mark.gpu` tests; none of them may import Ray at module level
GPU_TEST_FILES = ("tests/test_gpu.py", "tests/test_compiled_decode.py", "tests/test_encode_budgets.py")


@dataclasses.dataclass(frozen=True, slots=True)
class CheckPlan:
    device: str  # "cuda" or "cpu"
    dtype: str  # what the throughput sections run in
    # seconds per section, in the order they run; a section past its budget is cut
    budgets_s: dict[str, float]
    smoke_presets: tuple[str, ...]  # every family's tower on one image (the smallest preset of each family)
    smoke_engine_presets: tuple[str, ...]  # the engine generates on these
    decode_presets: tuple[str, ...]  # "large": the preset section `large` writes on the machine (synthetic.py)
    decode_batches: tuple[int, ...]
    decode_max_tokens: int
    decode_modes: tuple[str, ...]  # "graphs" (the static-shape step), "eager", "transformers" (a static batch)
    encode_presets: tuple[str, ...]
    encode_images: int
    test_files: tuple[str, ...] = GPU_TEST_FILES

    @property
    def total_s(self) -> float:
        return sum(self.budgets_s.values())

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "CheckPlan":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


SMOKE_PRESETS = ("tiny", "tiny-minicpmv", "tiny-step3", "tiny-llava-ov", "tiny-qwen3-vl", "tiny-qwen3.5")
SMOKE_ENGINE_PRESETS = ("tiny", "tiny-qwen3.5")

GPU = CheckPlan(
    device="cuda", dtype="bfloat16",
    # the first H200 run (2026-11-29): tests 41 s, large 24 s, encode 49 s; decode was cut at 150 s before
    # the large preset's transformers rows
    budgets_s={"versions": 20, "smoke": 50, "tests": 90, "large": 45, "decode": 220, "encode": 50},
    smoke_presets=SMOKE_PRESETS, smoke_engine_presets=SMOKE_ENGINE_PRESETS,
    decode_presets=("small", "small-qwen3.5", "large"), decode_batches=(1, 8, 64), decode_max_tokens=128,
    decode_modes=("graphs", "eager", "transformers"),
    encode_presets=("small", "small-qwen3.5", "large"), encode_images=64,
)

# CPU dry run: the same sections on tiny presets and small batches. What needs a GPU (CUDA graphs, the
# large preset, MFU) is reported as skipped with its reason, as on a GPU any mode that cannot run is.
# Budgets far above the ~90 s it takes on a busy 2-core machine: a test run beside others must not cut it.
CPU = CheckPlan(
    device="cpu", dtype="float32",
    budgets_s={"versions": 60, "smoke": 180, "tests": 120, "large": 60, "decode": 180, "encode": 120},
    smoke_presets=SMOKE_PRESETS, smoke_engine_presets=SMOKE_ENGINE_PRESETS,
    decode_presets=("tiny", "tiny-qwen3.5", "large"), decode_batches=(1, 2), decode_max_tokens=4,
    decode_modes=("graphs", "eager", "transformers"),
    encode_presets=("tiny", "tiny-qwen3.5", "large"), encode_images=2,
)
