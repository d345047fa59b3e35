"""MiniCPM-V 4.6 oracles from transformers itself: its processor, its vision path, its generate()."""

from __future__ import annotations

import numpy as np
import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

# Sizes that cover: no slices (small, and exactly one slice's area), wide and tall strips, and the
# maximum of 9 slices (700x700 with the tiny preset's 224 px slices).
SIZES = [(60, 50), (700, 700), (300, 500), (224, 224), (900, 200), (100, 1000), (450, 460), (30, 400), (640, 480)]


def processor(ckpt):
    """transformers' `MiniCPMV4_6Processor` for the checkpoint.

    Its constructor type-checks the video processor against a base class that transformers only
    exports with torchvision installed (the registry's torchvision wheels are CUDA builds that do not load with the CPU torch).
    The video processor itself builds without it, so only that one check is skipped; everything
    the processor does with images and text is transformers' own code.
    """
    from transformers import AutoTokenizer
    from transformers.models.minicpmv4_6 import MiniCPMV4_6Processor
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import MiniCPMV4_6ImageProcessorPil
    from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import MiniCPMV4_6VideoProcessor

    class Processor(MiniCPMV4_6Processor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name != "video_processor":
                return super().check_argument_for_proper_class(argument_name, argument)

    return Processor(image_processor=MiniCPMV4_6ImageProcessorPil.from_pretrained(ckpt),
                     video_processor=MiniCPMV4_6VideoProcessor.from_pretrained(ckpt),
                     tokenizer=AutoTokenizer.from_pretrained(ckpt))


def image_embeddings(hf_model, ckpt, images) -> list[torch.Tensor]:
    """Per-image embeddings (overview then slices, as the language model reads them) from
    `get_image_features` on the whole batch in one call."""
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import MiniCPMV4_6ImageProcessorPil

    if not len(images):
        return []
    processed = MiniCPMV4_6ImageProcessorPil.from_pretrained(ckpt)(list(images), return_tensors="pt")
    with torch.no_grad():
        units = hf_model.model.get_image_features(processed["pixel_values"], processed["target_sizes"]).pooler_output
    bounds = np.cumsum([0, *processed["num_patches_per_image"]])
    return [torch.cat(units[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def hf_generate(hf_model, prompt_ids, embeds, max_new_tokens: int) -> list[int]:
    """Greedy `generate()` with precomputed image features; ids after the prompt (EOS not cut)."""
    ids = torch.tensor([prompt_ids])
    kwargs = {"mm_encoder_outputs": {"image": BaseModelOutputWithPooling(pooler_output=tuple(embeds))}} if embeds else {}
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, **kwargs)
    return out[0, ids.shape[1]:].tolist()
