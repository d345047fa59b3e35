"""raypipe: distributed inference for vision-language models on Ray."""

from raypipe.errors import InvalidInput
from raypipe.pipeline import Pipeline
from raypipe.inputs.sampling import SamplingParams

__all__ = ["InvalidInput", "Pipeline", "SamplingParams"]
