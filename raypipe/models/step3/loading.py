"""Load a Step3 checkpoint through transformers' own `from_pretrained`, then keep one side of it.

Step3 checkpoints are stored in StepFun's original layout (fused ViT qkv with a rope permutation,
per-expert MoE projections, `vit_large_projector`, ...). transformers converts that layout while
loading (`conversion_mapping.py`: renames, chunking, permutes, concatenations); re-implementing
those rules to read only the vision or only the language tensors would be a second copy that can
drift. So both sides load the whole model the supported way and drop what they do not run.

Cost: loading reads every tensor once. For the presets that is nothing; for the released
checkpoint an encoder worker would briefly hold the language model too — a part-wise loader over
transformers' conversion ops is the known next step (see the README's Step3 notes).
"""

from __future__ import annotations

import pathlib

import torch


def load_step3_model(checkpoint: str | pathlib.Path, dtype: torch.dtype):
    from transformers import Step3p7ForConditionalGeneration

    return Step3p7ForConditionalGeneration.from_pretrained(checkpoint, dtype=dtype).eval()
