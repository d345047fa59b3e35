"""transformers' own Step3 paths, the oracle of the Step3 tests: processor, vision path, generate()."""

from __future__ import annotations

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from raypipe.models.step3.image_processor import load_image_processor

# (height, width): no crops, elongated-but-small (cropped), wide, tall, extreme (square-padded),
# large (crop grid), oversized (scaled down first).
SIZES = [(300, 200), (120, 100), (60, 500), (700, 120), (20, 400), (224, 224), (400, 700), (50, 80), (1000, 260)]


def processor(ckpt):
    """`Step3p7Processor` with the checkpoint's tokenizer and image processor settings."""
    from transformers import AutoTokenizer, Step3p7Processor

    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    return Step3p7Processor(image_processor=load_image_processor(ckpt), tokenizer=tokenizer,
                            chat_template=tokenizer.chat_template)


def image_features(hf_model, ckpt, images) -> list[torch.Tensor]:
    """Per-image features from `get_image_features` on the whole batch (crops then global view)."""
    if not len(images):
        return []
    processed = load_image_processor(ckpt)(images=list(images), return_tensors="pt")
    with torch.no_grad():
        out = hf_model.model.get_image_features(processed["pixel_values"], processed.get("pixel_values_local"),
                                                processed["num_local_patches"].tolist()).pooler_output
    return [feature.cpu() for feature in out]


def generate(hf_model, prompt_ids: list[int], features: list[torch.Tensor], max_new_tokens: int) -> list[int]:
    """Greedy `generate()` with the image features given; new ids (all of them: no EOS cut)."""
    ids = torch.tensor([prompt_ids])
    kwargs = {}
    if features:
        kwargs["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=tuple(features))}
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, **kwargs)
    return out[0, ids.shape[1]:].tolist()
