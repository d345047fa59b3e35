"""transformers' own LLaVA-OneVision paths, the oracle of the LLaVA-OneVision tests.

`LlavaOnevisionProcessor` cannot be constructed here (its constructor looks up the video processor
class, which needs torchvision), so `processor` builds one without `__init__` and sets the
attributes its token expansion reads: `replace_image_token` and `_get_number_of_features` then run
as transformers wrote them, on the Pillow image processor's output.
"""

from __future__ import annotations

import json
import pathlib

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from raypipe.models.llava_onevision.vision import load_image_processor

# (height, width): tall, wide, square, tiny, large (3x3 tiles, shrunk past anyres_max_4), extreme ratios.
SIZES = [(100, 60), (40, 170), (56, 56), (20, 30), (300, 290), (160, 100), (30, 400), (500, 70), (120, 230)]


def processor(ckpt):
    from transformers import AutoTokenizer, LlavaOnevisionProcessor

    settings = json.loads((pathlib.Path(ckpt) / "processor_config.json").read_text())
    proc = object.__new__(LlavaOnevisionProcessor)
    proc.image_processor = load_image_processor(ckpt)
    proc.tokenizer = AutoTokenizer.from_pretrained(ckpt)
    proc.num_image_tokens = settings["num_image_tokens"]
    proc.vision_feature_select_strategy = settings["vision_feature_select_strategy"]
    proc.vision_aspect_ratio = settings["vision_aspect_ratio"]
    proc.image_token = settings["image_token"]
    return proc


def prompt_ids(ckpt, text: str, images) -> list[int]:
    """What `LlavaOnevisionProcessor(images=images, text=text)` tokenizes: each `<image>` replaced by
    `replace_image_token` for its image (a flat image list: every image gets AnyRes tiles)."""
    proc = processor(ckpt)
    if images:
        processed = proc.image_processor(list(images), return_tensors="pt")
        pieces = text.split(proc.image_token)
        assert len(pieces) == len(images) + 1
        text = pieces[0] + "".join(proc.replace_image_token(processed, i) + piece
                                   for i, piece in enumerate(pieces[1:]))
    return proc.tokenizer(text, add_special_tokens=False)["input_ids"]


def image_features(hf_model, ckpt, images) -> list[torch.Tensor]:
    """Per-image rows from `get_image_features` (tower, selection, projector, packing) on the whole batch."""
    if not len(images):
        return []
    processed = load_image_processor(ckpt)(list(images), return_tensors="pt")
    with torch.no_grad():
        out = hf_model.model.get_image_features(processed["pixel_values"], processed["image_sizes"]).pooler_output
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
