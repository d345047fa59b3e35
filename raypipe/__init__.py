"""raypipe: distributed inference for vision-language models on Ray.

`Pipeline` loads on first use (PEP 562 `__getattr__`): it brings the decode engine and its grammar
library (llguidance, torch._dynamo), ~3.5 s of imports per process. Every Ray worker that runs any
raypipe code imports this package first, and most (a batch job's read and write tasks, its encoder
actors) never decode.
"""

from raypipe.errors import InvalidInput
from raypipe.inputs.sampling import SamplingParams
from raypipe.inputs.structured import StructuredOutput

__all__ = ["InvalidInput", "Pipeline", "SamplingParams", "StructuredOutput"]


def __getattr__(name: str):
    if name == "Pipeline":
        from raypipe.pipeline import Pipeline

        return Pipeline
    raise AttributeError(f"module 'raypipe' has no attribute {name!r}")
