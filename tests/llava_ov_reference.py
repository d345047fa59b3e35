"""transformers' own LLaVA-OneVision paths, the oracle of the LLaVA-OneVision tests.

`LlavaOnevisionProcessor` cannot be constructed here (its constructor looks up the video processor
class, which needs torchvision), so `processor` builds one without `__init__` and sets the
attributes its token expansion reads: `replace_image_token`, `_get_number_of_features` and
`replace_video_token` then run as transformers wrote them, on the Pillow image processor's output and
on `LlavaOnevisionVideoProcessor.preprocess`'s (transformers' own, with `minicpmv_video_reference`'s
stand-in for the two torchvision kernels: install it first).
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
    proc.video_token = settings["video_token"]
    return proc


def video_processor(ckpt):
    from transformers.models.llava_onevision.video_processing_llava_onevision import LlavaOnevisionVideoProcessor

    return LlavaOnevisionVideoProcessor.from_pretrained(ckpt)


def preprocess_video(ckpt, source, source_fps: float, **kwargs):
    """`preprocess` of one video given all its source frames `(N, H, W, 3)` at `source_fps`, sampling frames itself.
    The frames are RGB already: its RGB conversion (a torchvision kernel, the identity on 3 channels) is off."""
    from tests.minicpmv_video_reference import metadata

    return video_processor(ckpt).preprocess([source], video_metadata=[metadata(source, source_fps)],
                                             do_sample_frames=True, do_convert_rgb=False, return_tensors="pt", **kwargs)


def prompt_ids(ckpt, text: str, images, videos=()) -> list[int]:
    """What `LlavaOnevisionProcessor(images=images, videos=videos, text=text)` tokenizes: each `<image>` replaced by
    `replace_image_token` for its image (a flat image list: every image gets AnyRes tiles), each `<video>`
    by `replace_video_token` (`videos`: `preprocess_video` outputs)."""
    proc = processor(ckpt)
    for token, items, expand in ((proc.image_token, images, proc.replace_image_token),
                                 (proc.video_token, videos, proc.replace_video_token)):
        if not len(items):
            continue
        processed = proc.image_processor(list(items), return_tensors="pt") if token == proc.image_token else {
            "pixel_values_videos": [v["pixel_values_videos"][0] for v in items]}
        pieces = text.split(token)
        assert len(pieces) == len(items) + 1
        text = pieces[0] + "".join(expand(processed, i) + piece for i, piece in enumerate(pieces[1:]))
    return proc.tokenizer(text, add_special_tokens=False)["input_ids"]


def image_features(hf_model, ckpt, images) -> list[torch.Tensor]:
    """Per-image rows from `get_image_features` (tower, selection, projector, packing) on the whole batch."""
    if not len(images):
        return []
    processed = load_image_processor(ckpt)(list(images), return_tensors="pt")
    with torch.no_grad():
        out = hf_model.model.get_image_features(processed["pixel_values"], processed["image_sizes"]).pooler_output
    return [feature.cpu() for feature in out]


def video_features(hf_model, processed) -> torch.Tensor:
    """One video's rows from `get_video_features` (tower, selection, projector, 2x2 pooling, newline)."""
    with torch.no_grad():
        return hf_model.model.get_video_features(
            processed["pixel_values_videos"], vision_feature_layer=hf_model.config.vision_feature_layer,
            vision_feature_select_strategy=hf_model.config.vision_feature_select_strategy).pooler_output[0]


def generate(hf_model, prompt_ids: list[int], features: list[torch.Tensor], max_new_tokens: int,
             video: torch.Tensor | None = None) -> list[int]:
    """Greedy `generate()` with the image features (and one video's) given; new ids (all of them: no EOS cut)."""
    ids = torch.tensor([prompt_ids])
    outputs = {}
    if features:
        outputs["image"] = BaseModelOutputWithPooling(pooler_output=tuple(features))
    if video is not None:
        outputs["video"] = BaseModelOutputWithPooling(pooler_output=video[None])
    kwargs = {"mm_encoder_outputs": outputs} if outputs else {}
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, **kwargs)
    return out[0, ids.shape[1]:].tolist()
