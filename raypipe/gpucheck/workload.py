"""What the sections feed the models: image prompts, and their embeddings as an encoder worker makes them.

Images are drawn in code (`raypipe.testing.sample_images`); nothing is read or downloaded. The embeddings
are made as the encoder worker makes them (a tower per unit, the units joined per item) but in this
process, with no Ray.
"""

from __future__ import annotations

import torch

from raypipe.inputs.images import load_image
from raypipe.models.prompt import build_prompt
from raypipe.testing.sample_images import sample_image

SMOKE_IMAGE = (224, 160)  # (height, width): a few hundred patches on every family's tiny preset


def image_prompt(tokenizer, vision, size=SMOKE_IMAGE, text: str = "Describe the image.", seed: int = 0):
    content = [{"type": "image", "image": sample_image(*size, seed=seed)}, {"type": "text", "text": text}]
    return build_prompt([{"role": "user", "content": content}], tokenizer, vision)


def images(sizes, seed: int = 0):
    return [load_image(sample_image(h, w, seed=seed + i)) for i, (h, w) in enumerate(sizes)]


@torch.inference_mode()
def encode_visuals(vision, tower, visuals) -> list[torch.Tensor]:
    """One embedding per visual item: its units through the tower, joined as the family lays them out."""
    return [vision.encode_in_process(tower, [visual])[0] for visual in visuals]
