"""raypipe: distributed inference for vision-language models on Ray."""

from raypipe.errors import InvalidInput
from raypipe.inputs.sampling import SamplingParams
from raypipe.inputs.structured import StructuredOutput
from raypipe.pipeline import Pipeline

__all__ = ["InvalidInput", "Pipeline", "SamplingParams", "StructuredOutput"]
